"""Issue 18 item 7, Docker variant, on the real engine of the test suite: SIGHUP (a dropped ssh session) or
SIGTERM to a runner whose server is a container ends the run like Ctrl-C — exit 128+N, the container stopped
and removed before the runner exits (09c7220: exit -1, the container still up 15 s later, until the next run
reaped it) — and `--resume` finishes the run: 0 lost, 0 duplicated, 0 corrupt records."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import docker
import pytest
from dockerkit import ROOT, RUN_PREFIX

REF = str(ROOT / "examples" / "refs" / "ref-1.png")
PLANNED = 4  # seeds [1, 2, 3, 4] × references [1]

MATRIX = """
[run]
name = "{name}"
seeds = [1, 2, 3, 4]
steps = 2
size = "64x64"
request_timeout_s = 60
ready_timeout_s = 120
repeats = 1
determinism_check = false
results_dir = "{results}"

# Every request takes 1.5-2.5 s, so the signal lands while one is in flight.
[servers.ref]
image = "{image}"
port = 8000
command = ["python", "-m", "runner.refserver", "--host", "{{host}}", "--port", "{{port}}", "--preset", "tiny",
           "--vram-gib", "{{vram_gib}}", "--model", "{{model}}", "--fault", "jitter=1.5:2.5"]
model = "refserver-tiny"

[cards.box]
server = "ref"
backend = "docker"
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


def containers(client: docker.DockerClient, name: str) -> list[str]:
    found = client.containers.list(all=True, filters={"label": "runner.managed=true"}, ignore_removed=True)
    return [c.name for c in found if c.labels.get("runner.run", "").startswith(name)]


def steps(run: Path) -> list[dict]:
    out = []
    for p in sorted(run.glob("box/default/refs-*/*.json")):
        with contextlib.suppress(ValueError):  # being written
            out.append(json.loads(p.read_text()))
    return out


@pytest.mark.docker
@pytest.mark.parametrize("name", ["SIGHUP", "SIGTERM"])
def test_a_signal_stops_the_container_before_the_runner_exits_and_resume_finishes(
        docker_client: docker.DockerClient, refserver_image: str, tmp_path: Path, name: str) -> None:
    sig = getattr(signal, name)
    run_name = f"{RUN_PREFIX}{name.lower()}-{os.getpid()}"
    path = tmp_path / "matrix.toml"
    path.write_text(textwrap.dedent(MATRIX).format(name=run_name, results=tmp_path / "results",
                                                   image=refserver_image, ref=REF))
    log = (tmp_path / "runner.out").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "runner", str(path), "--no-progress"], stdout=log,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not any(d["status"] == "ok" for d in steps(
                next(iter((tmp_path / "results").glob(f"{run_name}*")), tmp_path / "none"))):
            time.sleep(0.1)
        assert containers(docker_client, run_name), "no container of the run is up"
        os.killpg(proc.pid, sig)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    out = (tmp_path / "runner.out").read_text()
    assert code == 128 + sig, out[-3000:]
    assert f"runner: {name}: stopping" in out and "Traceback" not in out, out[-3000:]
    assert not containers(docker_client, run_name), "a container outlived the runner"
    run = next((tmp_path / "results").glob(f"{run_name}*"))
    assert f"--resume {run}" in out and json.loads((run / "run.json").read_text())["interrupted"] is True
    kept = {d["key"]: d for d in steps(run) if d["status"] == "ok"}
    assert 1 <= len(kept) < PLANNED, sorted(kept)

    resumed = subprocess.run([sys.executable, "-m", "runner", str(path), "--no-progress", "--resume", str(run)],
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    docs = [json.loads(p.read_text()) for p in sorted(run.glob("box/default/refs-*/*.json"))]  # corrupt: raises
    keys = [d["key"] for d in docs]
    assert len(keys) == len(set(keys)) == PLANNED and all(d["status"] == "ok" for d in docs), keys
    for p in run.glob("box/default/refs-*/*.json"):
        assert p.relative_to(run).as_posix() == f"{json.loads(p.read_text())['key']}.json"
    assert all(d == kept[d["key"]] for d in docs if d["key"] in kept)  # what was kept is not sent again
    assert not containers(docker_client, run_name)
