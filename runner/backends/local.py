"""Backend `local`: the server as a subprocess in its own process group, output to the session log.

Three guarantees on a shared machine:
- the port is free before the start, and the process listening on it is in the started process tree before
  any request is sent (a busy fixed port fails the start with "port N is in use by PID/name");
- the server dies with the runner: a small supervisor (its parent, the group leader) stops the whole group
  when the runner process dies, even by SIGKILL (it watches a pipe only the runner writes to);
- each start is recorded (PID + start time + the runner's identity) in a state folder, so the next run
  stops what a dead runner left (if the supervisor died with it) — by recorded PID and start time, never by
  name.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from runner.backends import owner, sockdiag
from runner.backends.base import ExitInfo, RunningServer, StartFailed
from runner.core.errors import UserError
from runner.core.records import Failure, FailureClass
from runner.core.secrets import resolve_env
from runner.plan.lanes import Plan
from runner.plan.matrix import Matrix

HOST = "127.0.0.1"  # where a local server listens and the runner reaches it


def state_dir() -> Path:
    """Where local server records live: RUNNER_STATE_DIR, else $XDG_STATE_HOME/runner/servers."""
    if os.environ.get("RUNNER_STATE_DIR"):
        return Path(os.environ["RUNNER_STATE_DIR"])
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return base / "runner" / "servers"


def supervised_argv(argv: tuple[str, ...], fd: int) -> list[str]:
    """The server's command under the supervisor (runner.backends.supervisor), which watches pipe `fd`.

    Run by its file path, isolated (-I: no PYTHONPATH, no cwd on sys.path): it needs only the standard
    library, so it starts wherever runner itself was importable from (an install, or PYTHONPATH alone)."""
    from runner.backends import supervisor

    return [sys.executable, "-I", str(Path(supervisor.__file__)), str(fd), *argv]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def listeners(port: int) -> list[tuple[int | None, str]]:
    """(PID, process name) of every TCP listener on `port` (PID None when it cannot be seen)."""
    out = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            name = "?"
            with contextlib.suppress(psutil.Error):
                name = psutil.Process(conn.pid).name() if conn.pid else "?"
            out.append((conn.pid, name))
    return out


def _tree_listens(tree: set[int], port: int) -> bool:
    for pid in tree:
        with contextlib.suppress(psutil.Error):
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in psutil.Process(pid).net_connections(kind="tcp")):
                return True
    return False


def _anyone_listens(port: int) -> bool:
    """Whether any TCP socket listens on `port`: the kernel's list of listeners, else a full scan."""
    ports = sockdiag.tcp_listening_ports()
    return port in ports if ports is not None else bool(listeners(port))


def port_busy(host: str, port: int) -> str | None:
    """Why `port` cannot be ours, or None when it is free to bind."""
    with socket.socket() as s:
        # As servers do: a connection of a stopped server in TIME_WAIT must not count as busy (a restart on a
        # fixed port); on Linux the bind still fails while anything listens there.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return None
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return f"port {port} cannot be bound on {host}: {exc.strerror}"
    who = ", ".join(f"PID {pid} ({name})" if pid else "a process this user cannot see"
                    for pid, name in listeners(port)) or "another socket"
    return f"port {port} is in use by {who}"


# Listing a server's processes reads every process's /proc entry: once a second, not at every host sample
# (a worker started since is counted from the next listing on).
TREE_REFRESH_S = 1.0


class LocalServer(RunningServer):
    proc: subprocess.Popen[bytes] | None = None  # the supervisor (group leader); the server is its child
    argv: tuple[str, ...] = ()  # the command of this start (the plan's, its port filled in)
    _record: Path | None = None
    _lifeline: int | None = None  # write end of the supervisor's pipe; closing it stops the server
    _listed: tuple[list[psutil.Process], float] | None = None  # the server's processes and when they were listed

    def start(self) -> None:
        # The profile's fixed port must be free (never measure someone else's server); port 0: a free one
        # picked now, put where the plan's argv/env say RUNTIME_PORT.
        fixed = self.plan.profile.port
        if fixed:
            busy = port_busy(HOST, fixed)
            if busy:
                raise StartFailed(Failure(kind=FailureClass.LOAD_EXIT,
                                          message=f"{busy}; not starting (the runner would "
                                          f"measure that server instead of its own)"))
        self.port = fixed or free_port(HOST)
        self._listed = None
        self.argv, server_env = self.command(self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **resolve_env(server_env, os.environ)}
        if self.plan.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.plan.gpu
        read_end, self._lifeline = os.pipe()  # both non-inheritable: no other child holds the write end
        try:
            with self.log_path.open("ab") as log:
                # Own session/process group: stop() signals only what this runner started.
                self.proc = subprocess.Popen(supervised_argv(self.argv, read_end), stdout=log,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                             start_new_session=True, pass_fds=(read_end,))
        finally:
            os.close(read_end)
        self._record = _record_start(self.proc.pid, self.name)

    @property
    def port_picked(self) -> bool:
        return not self.plan.profile.port

    def exited(self) -> ExitInfo | None:
        if self.proc is None:
            return ExitInfo(None)
        code = self.proc.poll()
        return None if code is None else ExitInfo(code)

    def _tree(self) -> set[int]:
        assert self.proc is not None
        try:
            root = psutil.Process(self.proc.pid)
            return {root.pid, *(p.pid for p in root.children(recursive=True))}
        except psutil.Error:
            return set()

    def foreign_answer(self) -> str | None:
        if self.proc is None or not self.port:
            return None
        # Cheap first (this runs before every readiness probe, for as long as a model loads): whether anyone
        # listens at all (0.04 ms of CPU), then our own tree's sockets; the full system scan only when someone
        # else might.
        if not _anyone_listens(self.port):
            return None
        tree = self._tree()
        if _tree_listens(tree, self.port):
            return None
        found = listeners(self.port)
        if not found or any(pid in tree for pid, _ in found):
            return None
        who = ", ".join(f"PID {pid} ({name})" if pid else "an unseen process" for pid, name in found)
        return (f"port {self.port} is in use by {who}, not by the server this runner started "
                f"(PID {self.proc.pid}); not measuring it")

    def stop(self) -> None:
        try:
            if self.proc is None:
                return
            if self.proc.poll() is None:
                _stop_group(self.proc.pid, lambda t: _wait(self.proc, t))
            # Workers a crashed server left behind are still in its group (a PGID is not reused while it
            # has members): they go too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        finally:
            if self._lifeline is not None:
                os.close(self._lifeline)
                self._lifeline = None
            if self._record is not None:
                self._record.unlink(missing_ok=True)

    def kill(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.stop()

    def host_memory_bytes(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None
        now = time.monotonic()
        if self._listed is None or now - self._listed[1] >= TREE_REFRESH_S:
            try:  # the server and its workers, not the supervisor
                self._listed = psutil.Process(self.proc.pid).children(recursive=True), now
            except psutil.Error:
                return None
        rss = []
        for p in self._listed[0]:
            with contextlib.suppress(psutil.Error):  # a worker that ended since the listing
                rss.append(p.memory_info().rss)
        return sum(rss) if rss else None

    def info(self) -> dict[str, Any]:
        return {"pid": self.proc.pid if self.proc else None, "argv": list(self.argv)}


def _wait(proc: subprocess.Popen[bytes] | None, timeout: float) -> bool:
    try:
        if proc is not None:
            proc.wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


def _stop_group(pgid: int, wait: Any) -> None:
    """SIGTERM the group, SIGKILL what is left after 10 s (pgid: the leader's PID, start_new_session)."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        if wait(grace):
            return


# --- records of started servers, and cleanup of what a dead runner left ---------------------------------


def _record_start(pid: int, name: str) -> Path | None:
    """One small JSON per running server; removed at stop. Best effort: no state folder, no record."""
    try:
        started = owner.started(pid)
    except psutil.Error:
        return None
    doc = {"pid": pid, "since_boot": started, "name": name, **owner.me().labels()}
    path = state_dir() / f"{pid}-{int(started * 1000)}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc))
    except OSError:
        return None
    return path


def reap(options: object = ()) -> list[str]:
    """The backend's cleanup before a run (registry entry `reap`): what dead runners left on this machine."""
    return reap_orphans()


def preflight(matrix: Matrix, plan: Plan) -> None:
    """Local servers on a fixed port: the port is free now, and no two lanes start that server at once."""
    lanes_of: dict[str, set[str]] = {}
    for lane in plan.lanes:
        for session in lane.sessions:
            if session.server is not None and session.server.backend == "local" and session.server.profile.port:
                lanes_of.setdefault(session.server.profile.name, set()).add(lane.name)
    for server, lanes in sorted(lanes_of.items()):
        port = matrix.servers[server].port
        if len(lanes) > 1:
            raise UserError(f"{matrix.path}: key 'servers.{server}.port' is fixed ({port}) but lanes "
                            f"{', '.join(sorted(lanes))} start that server at the same time; use port = 0")
        busy = port_busy(HOST, port)
        if busy:
            raise UserError(f"{matrix.path}: key 'servers.{server}.port': {busy}; the runner will not measure "
                            f"someone else's server (stop it, or use port = 0)")


def reap_orphans() -> list[str]:
    """Stop the process groups of local servers whose runner is dead; each line says what and why.

    A group is identified by its leader's recorded PID + start time; members are signalled only when their
    process group is that PID and they started after the leader (a PGID is not reused while it has members).
    """
    notes: list[str] = []
    folder = state_dir()
    if not folder.is_dir():
        return notes
    for path in sorted(folder.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
            pid, started = int(doc["pid"]), float(doc["since_boot"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        dead, why = owner.owner_state({k: str(v) for k, v in doc.items()})
        if not dead:
            continue
        members = _group_members(pid, started)
        for p in members:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(members, timeout=5)
        if members:
            notes.append(f"stopped local server {doc.get('name', '?')} (PID {pid}, {len(members)} process(es)): "
                         f"{why}")
        path.unlink(missing_ok=True)
    return notes


def _group_members(pgid: int, started: float) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue  # already dead, waiting for its parent to reap it
            if os.getpgid(p.pid) == pgid and owner.started(p.pid) >= started - owner.SAME_START_S:
                out.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return out

