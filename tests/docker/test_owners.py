"""Issue 9 item 2 against the real engine: two concurrent runs never touch each other's containers; a run's
containers are reaped only once its runner process is dead, and the reap says why."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from dockerkit import new_run_id

CHILD = Path(__file__).with_name("owner_child.py")


class Run:
    def __init__(self, image: str, tmp: Path) -> None:
        self.run_id = new_run_id()
        self.proc = subprocess.Popen([sys.executable, str(CHILD), image, self.run_id, str(tmp)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.name = self._read()["started"]

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"run {self.run_id} ended early (exit {self.proc.poll()})"
        return json.loads(line)

    def reap(self) -> dict[str, tuple[bool, str]]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("reap\n")
        self.proc.stdin.flush()
        return {name: (removed, why) for name, removed, why in self._read()["notes"]}

    def stop(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.write("stop\n")
            self.proc.stdin.flush()
            self.proc.wait(60)


def status(client, name: str) -> str | None:  # type: ignore[no-untyped-def]
    found = client.containers.list(all=True, filters={"name": f"^/{name}$"}, ignore_removed=True)
    return found[0].status if found else None


@pytest.mark.docker
def test_concurrent_runs_never_touch_each_other(docker_client, base_image, tmp_path: Path) -> None:
    a, b = Run(base_image, tmp_path), Run(base_image, tmp_path)
    try:
        seen_by_b, seen_by_a = b.reap(), a.reap()
        # Each sees the other's container, keeps it and says why; its own is kept as its own.
        assert seen_by_b[a.name][0] is False and "is still running" in seen_by_b[a.name][1]
        assert seen_by_a[b.name][0] is False and "is still running" in seen_by_a[b.name][1]
        assert seen_by_b[b.name] == (False, "kept: this run's own")
        assert status(docker_client, a.name) == "running" and status(docker_client, b.name) == "running"
        # Run A dies without cleaning up (SIGKILL): now, and only now, B reaps A's container.
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait()
        after = b.reap()
        assert after[a.name][0] is True and f"its runner (PID {a.proc.pid}" in after[a.name][1]
        assert status(docker_client, a.name) is None
        assert status(docker_client, b.name) == "running"
    finally:
        b.stop()
        a.stop()
        for name in (a.name, b.name):
            for c in docker_client.containers.list(all=True, filters={"name": f"^/{name}$"}, ignore_removed=True):
                c.remove(force=True)
