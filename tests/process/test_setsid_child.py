"""Issue 18 item 15: a server's `setsid` child never outlives the run — whether its parent exits at load
(daemonizing) or stays as a worker — on real processes of this machine."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from runner.backends.base import Attempt, StartFailed
from runner.backends.local import LocalServer
from runner.plan.lanes import ServerPlan
from runner.plan.matrix import ServerProfile
from tests.ports import free_port

# Forks a child that leaves the process group (setsid) and sleeps; the parent then exits (mode "exit") or
# serves /health and stays (mode "stay").
SERVER = textwrap.dedent("""
    import http.server, os, sys, time
    mode, port, pidfile = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:  # the classic double fork: the worker is not even the session leader's child
            open(pidfile, "w").write(str(os.getpid()))
            time.sleep(300)
        os._exit(0)
    time.sleep(0.5)
    if mode == "exit":
        sys.exit(3)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("mode", ["exit", "stay"])
def test_a_setsid_child_does_not_outlive_its_server(tmp_path: Path, mode: str) -> None:
    script, pidfile, port = tmp_path / "server.py", tmp_path / "child.pid", free_port()
    script.write_text(SERVER)
    argv = (sys.executable, str(script), mode, str(port), str(pidfile))
    plan = ServerPlan(backend="local", profile=ServerProfile(name="t", command=argv, port=port), argv=argv, env={})
    server = LocalServer(plan, Attempt(name=f"t-setsid-{mode}", log_path=tmp_path / "server.log"))
    server.start()
    child = None
    try:
        if mode == "exit":
            with pytest.raises(StartFailed):
                server.wait_ready(20)
        else:
            server.wait_ready(20)
        deadline = time.monotonic() + 10
        while not pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(pidfile.read_text())  # written by the child itself: it ran, in a session of its own
        server.stop()
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child), f"the setsid child {child} outlived its server ({mode})"
    finally:
        if child is not None and alive(child):
            psutil.Process(child).kill()  # a process this test started (through the server it started)
        server.stop()
