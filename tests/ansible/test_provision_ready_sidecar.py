"""READY when the sidecar's port is somebody else's, and after runs interrupted by a real SIGINT (issue 22,
items 2 and 3), over real SSH to a throwaway user (ready.py). The tests share one host and run in file order:
each interrupted run starts from the sidecar the one before left running.
"""

from __future__ import annotations

import pwd
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from ready import cli, interrupt_at, proc_of, ready_world, unit_build
from sshhost import SIDECAR_UNIT

pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.usefixtures("clean_env")]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    yield from ready_world(tmp_path_factory)

# --- 2: somebody else's server on the sidecar's port ------------------------------------------------------

FOREIGN = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        code = int(sys.argv[2])
        self.send_response(code); self.send_header("Content-Type", "application/json"); self.end_headers()
        self.wfile.write(b"{}")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _serve(port: int, code: int, host, as_user: bool) -> subprocess.Popen:
    """Somebody else's HTTP server on the port: root's, or the sidecar user's own but outside the unit (its
    process is then visible to that user, so it is named by PID and command)."""
    script = host.home / "foreign.py"
    script.write_text(FOREIGN)
    script.chmod(0o644)
    ids = {"user": host.uid, "group": pwd.getpwnam(host.user).pw_gid, "extra_groups": []} if as_user else {}
    proc = subprocess.Popen(["/usr/bin/python3", str(script), str(port), str(code)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, **ids)
    deadline = time.monotonic() + 10
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/info", timeout=1)
            return proc
        except httpx.HTTPError:
            assert proc.poll() is None and time.monotonic() < deadline, "the foreign server did not start"
            time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(10)


def test_a_foreign_server_on_the_sidecar_port_is_named_and_nothing_loops(world, tmp_path: Path) -> None:
    host, port = world["host"], world["port"]
    for code, as_user in ((200, False), (404, True)):
        foreign = _serve(port, code, host, as_user)
        try:
            r = cli(world, tmp_path, "--tags", "meters_sidecar")  # no -l: only this item is under test
        finally:
            _stop(foreign)
        assert r.rc != 0, r.out[-3000:]
        assert "rtx3090 NOT READY: meters_sidecar:" in r.text, r.out[-3000:]
        assert f"port {port} on 127.0.0.1 (rtx3090) is not runner-meter's" in r.text, r.text
        if not as_user:
            assert "a process of user root (uid 0)" in r.text, r.text
        else:
            assert "foreign.py" in r.text and f"of user {host.user}" in r.text, r.text
        # Left stopped and disabled, not restarting every 5 s.
        time.sleep(6)
        state = host.unit_state()
        assert state["ActiveState"] in ("inactive", "failed") and state["MainPID"] == "0", state
        assert state["UnitFileState"] == "disabled", state
    # The port free again: READY, and /info comes from the unit's own process.
    r = cli(world, tmp_path, "-l", "rtx3090", "--tags", "meters_sidecar")
    assert r.rc == 0 and "rtx3090 READY: meters_sidecar" in r.text, r.out[-3000:]
    state = host.unit_state()
    assert state["ActiveState"] == "active" and int(state["MainPID"]) > 0
    assert httpx.get(f"http://127.0.0.1:{port}/info", timeout=5).json()["gpu"]["uuid"] == "GPU-REPLAY-replay"
    # ...and a run with --check changes nothing and says READY too: the host is as it should be.
    r = cli(world, tmp_path, "-l", "rtx3090", "--tags", "meters_sidecar", "--check")
    assert r.rc == 0 and "rtx3090 READY: meters_sidecar" in r.text, r.out[-3000:]
    assert host.unit_state()["MainPID"] == state["MainPID"]


# --- 3: interrupted runs ------------------------------------------------------------------------------------

def _sidecar_running(world, tmp_path: Path) -> dict[str, str]:
    """The sidecar as a plain run leaves it (started here if an earlier test left none)."""
    state = world["host"].unit_state()
    if state["ActiveState"] != "active":
        r = cli(world, tmp_path, "-l", "rtx3090", "--tags", "meters_sidecar")
        state = world["host"].unit_state()
        assert state["ActiveState"] == "active", (state, r.out[-3000:])
    return state


def test_new_code_runs_after_a_run_interrupted_before_the_restart(world, tmp_path: Path) -> None:
    host = world["host"]
    before = _sidecar_running(world, tmp_path)
    assert before["ActiveState"] == "active", before
    (world["src"] / "meters" / "interrupted_marker.py").write_text("# new code, shipped by an interrupted run\n")
    interrupt_at(world, tmp_path, "Create the sidecar's venv", "-l", "rtx3090", "--tags", "meters_sidecar")
    # The interruption came after the new code was unpacked and before any restart: the old process still runs.
    assert (host.home / ".local/share/runner-meter/src/runner/meters/interrupted_marker.py").exists()
    assert host.unit_state()["MainPID"] == before["MainPID"]

    r = cli(world, tmp_path, "-l", "rtx3090", "--tags", "meters_sidecar")
    # What runs first (the point of the item), then what the run says.
    after = host.unit_state()
    assert after["ActiveState"] == "active" and after["MainPID"] != before["MainPID"], (before, after, r.out[-3000:])
    assert proc_of(after["MainPID"])[1]["RUNNER_METER_BUILD"] == unit_build(host)
    assert r.rc == 0 and "rtx3090 READY: meters_sidecar" in r.text, r.out[-3000:]


def test_a_new_unit_runs_after_a_run_interrupted_at_the_restart(world, tmp_path: Path) -> None:
    host = world["host"]
    before = _sidecar_running(world, tmp_path)
    assert "--hz" in proc_of(before["MainPID"])[0] and "500" in proc_of(before["MainPID"])[0]
    out = interrupt_at(world, tmp_path, "Enable and start the user unit", "-l", "rtx3090", "--tags", "meters_sidecar",
                       ev={"meters_sidecar_hz": 250})
    # The unit file says 250, the process still runs with 500: the restart never happened.
    assert "--hz 250" in (host.home / ".config/systemd/user" / SIDECAR_UNIT).read_text(), out[-2000:]
    argv = proc_of(host.unit_state()["MainPID"])[0]
    assert argv[argv.index("--hz") + 1] == "500"

    r = cli(world, tmp_path, "-l", "rtx3090", "--tags", "meters_sidecar", ev={"meters_sidecar_hz": 250})
    state = host.unit_state()
    argv = proc_of(state["MainPID"])[0]
    assert argv[argv.index("--hz") + 1] == "250" and state["NeedDaemonReload"] == "no", (argv, state, r.out[-3000:])
    assert r.rc == 0 and "rtx3090 READY: meters_sidecar" in r.text, r.out[-3000:]
    # And back to the default, so a rerun of the module starts from a plain sidecar.
    r = cli(world, tmp_path, "-l", "rtx3090", "--tags", "meters_sidecar")
    assert r.rc == 0, r.out[-3000:]
