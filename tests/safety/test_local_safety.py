"""Issue 9 items 1 and 3 against real processes on this machine: a busy fixed port is never measured, and
local servers do not outlive a SIGKILLed runner (nor survive the next run's cleanup)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from runner.backends import local
from runner.backends.base import PORT_TRIES, Attempt, StartFailed
from runner.backends.local import LocalServer
from runner.plan.lanes import RUNTIME_PORT, ServerPlan
from runner.plan.matrix import ServerProfile
from tests.ports import free_port

DECOY = Path(__file__).with_name("decoy.py")


def wait_for(predicate, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Decoy:
    """Someone else's server: started by the test, in its own session, never by the runner."""

    def __init__(self, tmp: Path, port: int, *extra: str) -> None:
        self.port, self.log = port, tmp / f"decoy-{port}.log"
        self.proc = subprocess.Popen([sys.executable, str(DECOY), str(port), str(self.log), *extra],
                                     start_new_session=True)
        assert wait_for(lambda: Path(str(self.log) + ".pid").exists()), "decoy did not start"

    def requests(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def decoy(tmp_path: Path) -> Iterator[Decoy]:
    d = Decoy(tmp_path, free_port())
    yield d
    d.close()


@pytest.fixture(autouse=True)
def _state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNNER_STATE_DIR", str(tmp_path / "state"))


def spec(tmp: Path, port: int, argv: tuple[str, ...]) -> tuple[ServerPlan, Attempt]:
    plan = ServerPlan(backend="local", profile=ServerProfile(name="t", command=argv, port=port), argv=argv, env={})
    return plan, Attempt(name="t", log_path=tmp / "server.log")


def test_busy_fixed_port_refused_before_start(tmp_path: Path, decoy: Decoy) -> None:
    server = LocalServer(*spec(tmp_path, decoy.port, (sys.executable, "-c", "import time; time.sleep(30)")))
    with pytest.raises(StartFailed) as info:
        server.start()
    message = info.value.failure.message
    assert f"port {decoy.port} is in use by PID {decoy.proc.pid} (python" in message, message
    assert server.proc is None  # nothing was started
    assert decoy.alive() and decoy.requests() == []


def test_port_taken_after_start_is_never_probed(tmp_path: Path) -> None:
    """The port was free at start, but another process took it before our server listened: readiness must
    not probe (let alone measure) that server; the start fails naming its PID, and ours is stopped."""
    port = free_port()
    server = LocalServer(*spec(tmp_path, port, (sys.executable, "-c", "import time; time.sleep(30)")))
    server.start()
    ours = server.proc.pid  # type: ignore[union-attr]
    d = Decoy(tmp_path, port)
    try:
        with pytest.raises(StartFailed) as info:
            server.wait_ready(10, poll_s=0.05)
        assert f"port {port} is in use by PID {d.proc.pid}" in info.value.failure.message
        assert "not by the server this runner started" in info.value.failure.message
        assert d.alive() and d.requests() == []
        assert wait_for(lambda: not running(ours), 5)
    finally:
        server.stop()
        d.close()


def picks(monkeypatch: pytest.MonkeyPatch, *first: int) -> None:
    """The local backend's port picks: `first` in order, then free ones (the race, driven: the picked port is
    taken between the pick and the server's bind)."""
    queue = list(first)
    monkeypatch.setattr(local, "free_port", lambda host="127.0.0.1": queue.pop(0) if queue else free_port())


def picked_spec(tmp: Path, argv: tuple[str, ...]) -> tuple[ServerPlan, Attempt]:
    return spec(tmp, 0, argv)  # port 0: the backend picks one at each start


SERVE = (sys.executable, str(DECOY), RUNTIME_PORT)


def test_a_picked_port_bound_first_by_another_socket_is_given_up_for_another(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Our server exits with "Address already in use" on the port the backend picked: not a load failure; it
    starts again on a new port, and the loss is kept."""
    holder = socket.socket()  # bound, not listening, no SO_REUSEADDR: the server's bind fails, nobody answers
    holder.bind(("127.0.0.1", 0))
    taken = holder.getsockname()[1]
    picks(monkeypatch, taken)
    server = LocalServer(*picked_spec(tmp_path, (*SERVE, str(tmp_path / "own.log"))))
    try:
        assert server.launch(20) < 20
        assert server.port != taken and "GET /health" in (tmp_path / "own.log").read_text()
        [lost] = server.port_losses
        assert f"port {taken} was taken before the server listened on it" in lost
        assert "Address already in use" in lost, lost
    finally:
        server.stop()
        holder.close()


def test_a_picked_port_another_server_listens_on_is_never_probed_and_given_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, decoy: Decoy) -> None:
    """The clean-clone race: another process listens on the picked port while ours loads. That server is never
    probed; ours is stopped and started again on a new port."""
    picks(monkeypatch, decoy.port)
    # Ours never binds on the port the decoy holds (it "loads" there), so only the listener can end that try.
    loads_forever_there = ("import os, sys, time; port = sys.argv[1]; "
                           f"time.sleep(60) if port == '{decoy.port}' else None; "
                           f"os.execv(sys.executable, [sys.executable, {str(DECOY)!r}, port, sys.argv[2]])")
    server = LocalServer(*picked_spec(tmp_path, (sys.executable, "-c", loads_forever_there, RUNTIME_PORT,
                                                 str(tmp_path / "own.log"))))
    try:
        assert server.launch(20) < 20
        [lost] = server.port_losses
        assert f"port {decoy.port} is in use by PID {decoy.proc.pid}" in lost, lost
        assert server.port != decoy.port and decoy.alive() and decoy.requests() == []
        # The first try (its supervisor and server, both with the decoy's port in their command) was stopped.
        first = [p for p in psutil.process_iter(["cmdline"])
                 if loads_forever_there in (p.info["cmdline"] or []) and str(decoy.port) in p.info["cmdline"]]
        assert not any(running(p.pid) for p in first), first
    finally:
        server.stop()


def test_a_port_lost_at_every_start_fails_the_start_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, decoy: Decoy) -> None:
    picks(monkeypatch, *[decoy.port] * PORT_TRIES)
    server = LocalServer(*picked_spec(tmp_path, (sys.executable, "-c", "import time; time.sleep(60)")))
    try:
        with pytest.raises(StartFailed) as failed:
            server.launch(20)
        assert f"lost to another process at each of {PORT_TRIES} starts" in failed.value.failure.message
        assert len(server.port_losses) == PORT_TRIES and decoy.requests() == []
        assert server.proc is not None and wait_for(lambda: not running(server.proc.pid), 5)  # type: ignore[union-attr]
    finally:
        server.stop()


def test_own_server_on_fixed_port_is_accepted_and_restarts_there(tmp_path: Path) -> None:
    """Our own listener passes; after it stops, a restart on the same fixed port is not refused (the closed
    connections' TIME_WAIT on that port is no listener)."""
    port = free_port()
    for attempt in range(2):
        log = tmp_path / f"own-{attempt}.log"
        server = LocalServer(*spec(tmp_path, port, (sys.executable, str(DECOY), str(port), str(log))))
        server.start()
        try:
            assert server.wait_ready(20, poll_s=0.05) < 20
            assert "GET /health" in log.read_text()
        finally:
            server.stop()


MATRIX = """
[run]
name = "kill"
seeds = [1]
steps = 1
request_timeout_s = 600
ready_timeout_s = 30
determinism_check = false
results_dir = "results"

[servers.decoy]
command = ["{python}", "DECOY", "{port}", "LOG", "--fork-child"]
PORT_LINE

[cards.a]
server = "decoy"
vram_gib = 1

[flags.default]
role = "default"

[fixtures.one]
prompt = "p"
references = ["ref.png"]
"""


def write_matrix(tmp: Path, port_line: str = "") -> Path:
    from PIL import Image

    Image.new("RGB", (8, 8), (200, 10, 10)).save(tmp / "ref.png")
    text = MATRIX.replace("DECOY", str(DECOY)).replace("LOG", str(tmp / "server-requests.log"))
    (tmp / "m.toml").write_text(textwrap.dedent(text.replace("PORT_LINE", port_line)))
    return tmp / "m.toml"


def test_runner_refuses_a_busy_fixed_port(tmp_path: Path, decoy: Decoy) -> None:
    """The whole command: exit 2, one line naming the port and the decoy's PID; no request reaches it."""
    matrix = write_matrix(tmp_path, f"port = {decoy.port}")
    proc = subprocess.run([sys.executable, "-m", "runner", str(matrix), "--no-progress"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1
    assert f"port {decoy.port} is in use by PID {decoy.proc.pid}" in proc.stderr
    assert decoy.alive() and decoy.requests() == []
    assert not (tmp_path / "results").exists()


class KilledRun:
    """A real `runner` whose server (the decoy, which forked a child of its own) holds a request."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.env = {**os.environ, "RUNNER_STATE_DIR": str(tmp / "state")}
        self.proc = subprocess.Popen([sys.executable, "-m", "runner", str(write_matrix(tmp)), "--no-progress"],
                                     env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        requests = tmp / "server-requests.log"
        assert wait_for(lambda: requests.exists() and "POST" in requests.read_text(), 60), "no request sent"
        self.server = int((tmp / "server-requests.log.pid").read_text())
        self.child = int((tmp / "server-requests.log.child").read_text())
        self.supervisor = psutil.Process(self.server).ppid()
        assert psutil.Process(self.supervisor).ppid() == self.proc.pid  # really this runner's server

    def reap(self) -> str:
        """The next run's cleanup (alone, in a fresh process, with the same state folder)."""
        return subprocess.run([sys.executable, "-c", "from runner.backends.local import reap_orphans; "
                               "print('\\n'.join(reap_orphans()))"], env=self.env, capture_output=True,
                              text=True, timeout=30).stdout

    def close(self) -> None:
        for pid in (self.proc.pid, self.supervisor, self.server, self.child):
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()


def test_servers_die_with_a_killed_runner(tmp_path: Path) -> None:
    """kill -9 of the runner while its server holds a request: within seconds no process of that server is
    left — the server and the child it forked (the supervisor stops the whole group)."""
    run = KilledRun(tmp_path)
    try:
        run.proc.send_signal(signal.SIGKILL)
        run.proc.wait()
        for pid in (run.server, run.child, run.supervisor):
            assert wait_for(lambda pid=pid: not running(pid), 8), f"PID {pid} outlived the SIGKILLed runner"
        assert run.reap().strip() == ""  # nothing left to clean up
        assert not list((tmp_path / "state").glob("*.json"))  # the stale record is gone too
    finally:
        run.close()


def test_next_run_stops_what_a_dead_runner_left(tmp_path: Path) -> None:
    """If the supervisor died with the runner (both SIGKILLed), the server survives: the next run's cleanup
    stops its whole group by the recorded PID + start time (not by name), and says why."""
    run = KilledRun(tmp_path)
    try:
        for pid in (run.proc.pid, run.supervisor):
            os.kill(pid, signal.SIGKILL)
        run.proc.wait()
        time.sleep(1)
        assert running(run.server) and running(run.child)
        out = run.reap()
        assert f"(PID {run.supervisor}, 2 process(es)): its runner (PID {run.proc.pid}" in out, out
        assert wait_for(lambda: not running(run.server) and not running(run.child), 5)
        assert not list((tmp_path / "state").glob("*.json"))
    finally:
        run.close()


CLOCK_STEPPED = """
import psutil, psutil._pslinux as linux
stepped = psutil.boot_time() + {shift}
psutil.boot_time = linux.boot_time = lambda: stepped
from runner.backends.local import reap_orphans
print(reap_orphans())
"""


def test_cleanup_never_touches_a_live_runners_server(tmp_path: Path) -> None:
    port = free_port()
    server = LocalServer(*spec(tmp_path, port, (sys.executable, str(DECOY), str(port), str(tmp_path / "l.log"))))
    server.start()
    try:
        env = {**os.environ, "RUNNER_STATE_DIR": str(tmp_path / "state")}
        # The second cleanup sees the wall clock stepped by a second since the server started (NTP, a VM's
        # host): psutil then computes every process's create_time a second later. That made a live runner
        # look dead, and one test's runner killed the servers of runs in parallel with it.
        for shift in (0, 1):
            out = subprocess.run([sys.executable, "-c", CLOCK_STEPPED.format(shift=shift)], env=env,
                                 capture_output=True, text=True, timeout=30)
            assert out.stdout.strip() == "[]", out
            assert server.exited() is None
    finally:
        server.stop()
    assert not list((tmp_path / "state").glob("*.json"))  # a clean stop removes its record


def fill(path: Path) -> None:
    with path.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * 2**20)
                f.flush()
        except OSError:
            pass


def read_only(folder: Path) -> None:
    """Make one folder of the run read-only for real: a read-only bind mount of it onto itself."""
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
    subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)


@pytest.mark.parametrize(("how", "expected"), [("full", "No space left on device"),
                                               ("read-only", "Read-only file system")])
def test_results_disk_failing_mid_run_stops_with_one_line(tmp_path: Path, how: str, expected: str) -> None:
    """A real run on a real tmpfs that fills up (or whose step folder turns read-only) after the first
    records: exit 2, one error line naming the file and saying finished records are kept; those records are
    intact; no server left."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=80m", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    steps = None
    try:
        matrix = write_matrix(tmp_path)
        text = matrix.read_text().replace('"--fork-child"', '"--images"').replace("seeds = [1]", "seeds = "
                                                                                    f"{list(range(1, 41))}")
        matrix.write_text(text.replace("[servers.decoy]", '[servers.decoy]\ndialect = "openai-images"'))
        env = {**os.environ, "RUNNER_STATE_DIR": str(tmp_path / "state")}
        runner = subprocess.Popen([sys.executable, "-m", "runner", str(matrix), "--no-progress", "--results",
                                   str(disk)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert wait_for(lambda: len(list(disk.glob("*/a/default/refs-1/*.json"))) >= 2, 60), "no records"
        if how == "full":
            fill(disk / "filler.bin")
        else:
            steps = next(disk.glob("*/a/default/refs-1"))
            read_only(steps)
        _, err = runner.communicate(timeout=60)
        assert runner.returncode == 2, err
        errors = [line for line in err.splitlines() if line.startswith("runner: error:")]
        assert len(errors) == 1 and expected in errors[0], err
        assert "every record finished before it is kept" in errors[0] and str(disk) in errors[0]
        assert "Traceback" not in err
        records = list(disk.glob("*/a/default/refs-1/*.json"))
        assert 2 <= len(records) < 40
        for r in records:
            assert json.loads(r.read_text())["status"] == "ok"
        server = int((tmp_path / "server-requests.log.pid").read_text())
        assert wait_for(lambda: not running(server), 5)
    finally:
        if steps is not None:
            subprocess.run(["umount", "-l", str(steps)])
        subprocess.run(["umount", "-l", str(disk)])


LOSES_EVERY_PORT = ("import sys; print('OSError: [Errno 98] error while attempting to bind on address "
                    "(127.0.0.1, %s): address already in use' % sys.argv[1], flush=True); sys.exit(1)")


def test_after_the_last_port_loss_the_notes_say_the_start_failed(tmp_path: Path) -> None:
    """Issue 46 L-1: a server that loses its picked port at every try. Before: the note of the third loss
    still said "started again on another port", though nothing started again and the start failed."""
    matrix = write_matrix(tmp_path)
    text = matrix.read_text()
    start = text.index("command = [")
    end = text.index("\n", start)
    matrix.write_text(text[:start] + f'command = ["{{python}}", "-c", {json.dumps(LOSES_EVERY_PORT)}, "{{port}}"]'
                      + text[end:])
    proc = subprocess.run([sys.executable, "-m", "runner", str(matrix), "--no-progress"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path, env={**os.environ,
                                                                     "RUNNER_STATE_DIR": str(tmp_path / "state")})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (session,) = (tmp_path / "results").glob("kill-*/a/default/session.json")
    record = json.loads(session.read_text())
    (start_record,) = record["starts"]
    assert "lost to another process at each of" in start_record["failure"]["message"], start_record
    notes = [n for n in record["notes"] if "address already in use" in n]
    assert len(notes) == PORT_TRIES, record["notes"]
    assert all(n.endswith("started again on another port") for n in notes[:-1]), notes
    assert notes[-1].endswith("the start failed: the port was lost at every try"), notes
