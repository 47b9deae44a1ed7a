"""Backend `local`: the server as a subprocess in its own process group, output to the session log."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

import psutil

from runner.backends.base import ExitInfo, RunningServer


class LocalServer(RunningServer):
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.spec.env}
        if self.spec.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.spec.gpu
        with self.spec.log_path.open("ab") as log:
            # Own session/process group: stop() signals only what this runner started.
            self.proc = subprocess.Popen(self.spec.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)

    def exited(self) -> ExitInfo | None:
        if self.proc is None:
            return ExitInfo(None)
        code = self.proc.poll()
        return None if code is None else ExitInfo(code)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = self.proc.pid  # equal to the group id: start_new_session made it the leader
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def host_memory_bytes(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
            return sum(p.memory_info().rss for p in procs)
        except psutil.Error:
            return None

    def info(self) -> dict[str, Any]:
        return {"pid": self.proc.pid if self.proc else None, "argv": list(self.spec.argv)}
