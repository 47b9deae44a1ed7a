"""The executor with the docker backend: a whole plan in containers, and a container killed while a request
is in flight (the session restarts once and records the lost step)."""

from __future__ import annotations

import textwrap
import threading
import time
from pathlib import Path

import docker
import pytest
from dockerkit import new_run_id

from runner.core.records import FailureClass, Status
from runner.plan.lanes import make_plan
from runner.plan.matrix import load_matrix
from runner.run.events import Events
from runner.run.execute import RunContext, run_plan
from runner.run.store import RunStore

MATRIX = """
[run]
name = "docker-session"
seeds = [1, 2, 3]
steps = 2
size = "64x64"
request_timeout_s = 60
ready_timeout_s = 90
restarts = 1
repeats = 1
determinism_check = true  # seed 1 is sent twice: requests 1 and 2
sample_hz = 20

[servers.ref]
image = "{image}"
port = 8000
command = ["python", "-m", "runner.refserver", "--host", "{{host}}", "--port", "{{port}}", "--preset", "tiny",
           "--vram-gib", "{{vram_gib}}", "--model", "{{model}}"]
model = "refserver-tiny"

[cards.box]
server = "ref"
backend = "docker"
vram_gib = 1
meters = ["host"]

[flags.default]
role = "default"

# Request 3 (seed 2) of a server start hangs until the test kills the container.
[flags.killed]
role = "other"
args = ["--fault", "hang@3"]

[fixtures.shapes]
prompt = "shapes on a table"
references = ["refs/a.png"]

[matrix]
references = [1]
"""


class KillSecondRequest(Events):
    """Kills the `killed` session's first container once its third request (seed 2) is in flight."""

    def __init__(self, client: docker.DockerClient, run_id: str, log: Path) -> None:
        self.client, self.run_id, self.log = client, run_id, log
        self.killed: list[str] = []
        self.thread: threading.Thread | None = None

    def step_done(self, record) -> None:
        if record.flags == "killed" and record.attempt == 0 and record.status == Status.OK:
            self.thread = threading.Thread(target=self._kill, daemon=True)
            self.thread.start()

    def _kill(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the server logs a request's start on arrival
            if self.log.is_file() and "request 3 " in self.log.read_text(errors="replace"):
                break
            time.sleep(0.05)
        filters = {"label": ["runner.managed=true", f"runner.run={self.run_id}", "runner.flags=killed",
                             "runner.attempt=0"]}
        for c in self.client.containers.list(filters=filters, ignore_removed=True):
            c.kill()
            self.killed.append(c.name)


@pytest.mark.docker
def test_plan_in_containers_with_a_killed_server(docker_client, refserver_image, tmp_path):
    (tmp_path / "refs").mkdir()
    from PIL import Image

    Image.new("RGB", (40, 40), (200, 60, 30)).save(tmp_path / "refs" / "a.png")
    (tmp_path / "matrix.toml").write_text(textwrap.dedent(MATRIX).format(image=refserver_image))
    matrix = load_matrix(tmp_path / "matrix.toml")
    run_id = new_run_id()
    store = RunStore(tmp_path / "results" / run_id)
    events = KillSecondRequest(docker_client, run_id, store.session_dir("box/killed") / "server.log")
    ctx = RunContext(matrix=matrix, plan=make_plan(matrix), store=store, run_id=run_id, events=events)

    sessions = {s.flags: s for s in run_plan(ctx)}
    steps = {(s.flags, s.seed): s for s in store.load_steps()}

    # A clean session: one container, every step served, the image recorded.
    default = sessions["default"]
    assert default.backend == "docker" and len(default.starts) == 1
    start = default.starts[0]
    assert start.failure is None and start.ready_s is not None
    assert start.info["image_id"] == docker_client.images.get(refserver_image).id
    assert start.info["container_id"] and start.info["engine_version"]
    assert [steps[("default", s)].status for s in (1, 2, 3)] == [Status.OK] * 3
    assert steps[("default", 1)].deterministic is True  # same request twice, same bytes
    host = [p for p in steps[("default", 1)].peaks if p.metric == "host"]
    assert host and host[0].available and host[0].bytes > 0  # the container's memory was sampled

    # The killed session: second request lost with the container, one restart, the rest served.
    assert events.killed and events.killed[0].endswith("-killed-0")
    killed = sessions["killed"]
    assert len(killed.starts) == 2 and all(s.failure is None for s in killed.starts)
    lost = steps[("killed", 2)]
    assert lost.status == Status.FAILED and lost.lost and lost.wall_s < 30  # killed in flight, no timeout
    assert lost.failure.kind == FailureClass.CRASH and lost.failure.exit_code == 137  # SIGKILL
    assert steps[("killed", 1)].status == Status.OK and steps[("killed", 1)].attempt == 0
    assert steps[("killed", 3)].status == Status.OK and steps[("killed", 3)].attempt == 1
    assert any("server lost during" in n for n in killed.notes)
    session_dir = store.session_dir("box/killed")
    assert (session_dir / "server.log").is_file() and (session_dir / "server.1.log").is_file()
    assert "request 1 " in (session_dir / "server.1.log").read_text()
