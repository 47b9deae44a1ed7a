"""Issue 18 items 3 (Docker variant) and 9 on the real engine of the test suite.

- A SIGTERM from outside stops the container mid-request (exit 143): the step is `stopped`, not a crash; a
  resume sends it again, and the verdict is never offload-works from it (a clean run says fits-resident).
- The engine goes away mid-run (here: the runner reaches it through a TCP relay to the engine's socket,
  which the test closes): no traceback, the lost server is recorded, the other lane (a local server) runs
  to the end, the report is written; once the engine answers again a resume finishes the run and the
  container the lost engine kept is reaped (its owner, the first runner, is dead)."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import docker
import pytest
from dockerkit import ROOT, new_run_id

from runner.core.records import FailureClass, Status
from runner.judge.decision import World
from runner.judge.verdict import decide_all
from runner.plan.lanes import make_plan
from runner.plan.matrix import load_matrix
from runner.run.events import Events
from runner.run.execute import RunContext, run_plan
from runner.run.pending import pending
from runner.run.store import RunStore

REF = str(ROOT / "examples" / "refs" / "ref-1.png")

SIGTERMED = """
[run]
name = "sigtermed"
seeds = [1, 2, 3]
steps = 2
size = "64x64"
request_timeout_s = 60
ready_timeout_s = 120
restarts = 1
repeats = 1
determinism_check = false

# `sh -c` without exec: the shell is the server's parent and dies of SIGTERM at once (exit 143), as a
# container the engine stops mid-request does.
[servers.ref]
image = "{image}"
port = 8000
command = {command}
model = "refserver-tiny"

[cards.box]
server = "ref"
backend = "docker"
vram_gib = 1
meters = ["host"]

# Request 2 of the first start hangs until the test sends SIGTERM to the container.
[flags.default]
role = "default"
args = ["--fault", "hang@2"]

[flags.host-cache]
role = "offload"
args = ["--cond-cache", "host"]

[fixtures.shapes]
prompt = "shapes on a table"
references = ["{ref}"]

[matrix]
references = [1]
"""


class TermSecondRequest(Events):
    def __init__(self, client: docker.DockerClient, run_id: str, log: Path) -> None:
        self.client, self.run_id, self.log = client, run_id, log
        self.sent: list[str] = []

    def step_done(self, record) -> None:
        if record.flags == "default" and record.attempt == 0 and record.status == Status.OK:
            threading.Thread(target=self._term, daemon=True).start()

    def _term(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the server logs a request's start on arrival
            if self.log.is_file() and "request 2 " in self.log.read_text(errors="replace"):
                break
            time.sleep(0.05)
        filters = {"label": ["runner.managed=true", f"runner.run={self.run_id}", "runner.flags=default",
                             "runner.attempt=0"]}
        for c in self.client.containers.list(filters=filters, ignore_removed=True):
            c.kill(signal="SIGTERM")
            self.sent.append(c.name)


@pytest.mark.docker
def test_a_container_sigtermed_mid_request_is_stopped_redone_and_never_offload_works(
        docker_client, refserver_image, tmp_path):
    command = ["sh", "-c", "python -m runner.refserver --host {host} --port {port} --preset tiny --vram-gib "
               '{vram_gib} --model {model} "$@"; true', "sh"]  # the flag set's args arrive as "$@"
    (tmp_path / "matrix.toml").write_text(textwrap.dedent(SIGTERMED).format(image=refserver_image, ref=REF,
                                                                            command=json.dumps(command)))
    matrix = load_matrix(tmp_path / "matrix.toml")
    plan = make_plan(matrix)
    run_id = new_run_id()
    store = RunStore(tmp_path / "results" / run_id)
    events = TermSecondRequest(docker_client, run_id, store.session_dir("box/default") / "server.log")
    run_plan(RunContext(matrix=matrix, plan=plan, store=store, run_id=run_id, events=events))
    assert events.sent, "the SIGTERM was not sent"
    steps = {(s.flags, s.seed): s for s in store.load_steps()}
    cut = steps[("default", 2)]
    assert cut.status == Status.FAILED and cut.failure is not None
    assert cut.failure.kind == FailureClass.STOPPED and cut.failure.exit_code == 143, cut.failure
    assert steps[("default", 3)].status == Status.OK  # restarted for the rest
    verdict = decide_all(store.load_steps(), store.load_sessions(), matrix.verdict, ["box"])[0]
    assert verdict.world == World.UNDECIDED, verdict.reason  # was offload-works
    # the resume sends exactly the cut step, and the card is what a clean run says
    todo = pending(plan, store.load_steps(), store.load_sessions())
    assert [st.key for s in todo.sessions for st in s.steps] == [cut.key]
    run_plan(RunContext(matrix=matrix, plan=plan, store=store, run_id=run_id,
                        records={s.key: s for s in store.load_steps()}, todo=todo))
    assert store.load_steps()[[s.key for s in store.load_steps()].index(cut.key)].status == Status.OK
    verdict = decide_all(store.load_steps(), store.load_sessions(), matrix.verdict, ["box"])[0]
    assert verdict.world == World.FITS_RESIDENT, verdict.reason


class Relay:
    """127.0.0.1:port ↔ the engine's unix socket; close() is the engine going away for the runner."""

    def __init__(self, port: int = 0, sock: str = "/var/run/docker.sock") -> None:
        self.sock = sock
        self.server = socket.create_server(("127.0.0.1", port), reuse_port=False)
        self.port = self.server.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            engine = socket.socket(socket.AF_UNIX)
            engine.connect(self.sock)
            self.conns += [client, engine]
            for a, b in ((client, engine), (engine, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):  # wakes the blocked accept(); close() alone would not on Linux
            self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()


ENGINE_LOST = """
[run]
name = "engine-lost"
seeds = [1, 2]
steps = 2
size = "64x64"
request_timeout_s = 15
ready_timeout_s = 120
restarts = 1
repeats = 1
determinism_check = false
results_dir = "{results}"

[servers.boxed]
image = "{image}"
port = 8000
command = ["python", "-m", "runner.refserver", "--host", "{{host}}", "--port", "{{port}}", "--preset", "tiny",
           "--vram-gib", "{{vram_gib}}", "--model", "{{model}}", "--fault", "hang@2"]
model = "refserver-tiny"

[servers.local]
command = ["{python}", "-m", "runner.refserver", "--port", "{{port}}", "--preset", "tiny", "--vram-gib",
           "{{vram_gib}}", "--fault", "jitter=1.5:2"]

[cards.far]
server = "boxed"
backend = "docker"
docker_host = "tcp://127.0.0.1:{port}"
publish_host = "0.0.0.0"  # the matrix takes a tcp:// engine for another machine
vram_gib = 1
meters = ["host"]

[cards.near]
server = "local"
vram_gib = 1
meters = ["host"]

[flags.default]
role = "default"

[fixtures.shapes]
prompt = "shapes on a table"
references = ["{ref}"]

[matrix]
references = [1]
"""


@pytest.mark.docker
def test_the_engine_going_away_mid_run_loses_one_lane_only_and_resume_finishes(
        docker_client, refserver_image, tmp_path):
    relay = Relay()
    path = tmp_path / "matrix.toml"
    path.write_text(textwrap.dedent(ENGINE_LOST).format(image=refserver_image, ref=REF, port=relay.port,
                                                        results=tmp_path / "results", python=sys.executable))
    proc = subprocess.Popen([sys.executable, "-m", "runner", str(path), "--no-progress"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_id = ""
    try:
        def hanging() -> Path | None:  # the container's request 2 (seed 2) has arrived, and hangs
            for run in (tmp_path / "results").glob("engine-lost-*"):
                log = run / "far/default/server.log"
                if log.is_file() and "request 2 " in log.read_text(errors="replace"):
                    return log
            return None

        deadline = time.monotonic() + 180
        while (log := hanging()) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if log is None:
            proc.kill()
            pytest.fail(f"the container never got its second request: {proc.communicate()[1][-3000:]}")
        run_dir = log.parents[2]
        run_id = run_dir.name
        relay.close()  # the engine is gone for the runner (the container itself runs on)
        _, err = proc.communicate(timeout=240)
        assert "Traceback" not in err, err[-3000:]
        assert proc.returncode == 1, err[-3000:]  # incomplete: steps are left for a resume
        steps = {json.loads(p.read_text())["key"]: json.loads(p.read_text())
                 for p in run_dir.glob("*/*/refs-*/*.json")}
        assert all(steps[f"near/default/refs-1/shapes-seed-{s}"]["status"] == "ok" for s in (1, 2))
        cut = steps["far/default/refs-1/shapes-seed-2"]
        assert cut["failure"]["kind"] == "stopped" and "Docker engine" in cut["failure"]["message"], cut
        session = json.loads((run_dir / "far/default/session.json").read_text())
        assert any("server lost during" in n for n in session["notes"])
        assert session["starts"][0]["info"].get("engine_lost") or session["starts"][0]["info"].get("stop_error")
        assert (run_dir / "report.md").is_file() and (run_dir / "verdict.json").is_file()

        relay2 = Relay(relay.port)  # the engine answers again
        try:
            resumed = subprocess.run([sys.executable, "-m", "runner", str(path), "--no-progress", "--resume",
                                      str(run_dir)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
        finally:
            relay2.close()
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        # the container the lost engine kept running: its runner is dead, so the resume removes it
        assert f"removed container runner-{run_id}-far-default-0".lower() in resumed.stderr.lower(), resumed.stderr
        after = [json.loads(p.read_text()) for p in run_dir.glob("*/*/refs-*/*.json")]
        assert len(after) == 4 and all(d["status"] == "ok" for d in after)
        assert "1 step(s) to send of 4" in resumed.stderr
    finally:
        if proc.poll() is None:
            proc.kill()
        relay.close()
        for c in docker_client.containers.list(all=True, filters={"label": "runner.managed=true"}, ignore_removed=True):
            if run_id and c.labels.get("runner.run") == run_id:
                c.remove(force=True)
