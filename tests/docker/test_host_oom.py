"""Issue 18 item 11 on the real engine of the test suite: a container the kernel's OOM killer ends.

The card limits its container's host memory (`mem_limit = "512m"`, swap the same); the refserver's
`host-memory=MIB@N` fault makes request N allocate far more than that, and `load-host-memory=MIB` does the
same at load. The engine reports the container OOMKilled; the step is an `oom` of host memory (not a crash),
the start an `oom_at_load` of host memory, and the verdict line, verdict.json and report.md say host memory,
never a VRAM figure."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import docker
import pytest
from dockerkit import ROOT, RUN_PREFIX

REF = str(ROOT / "examples" / "refs" / "ref-1.png")

MATRIX = """
[run]
name = "{name}"
seeds = [1, 2]
steps = 2
size = "64x64"
request_timeout_s = 60
ready_timeout_s = 120
restarts = 0
repeats = 1
determinism_check = false
results_dir = "{results}"

[servers.ref]
image = "{image}"
port = 8000
command = ["python", "-m", "runner.refserver", "--host", "{{host}}", "--port", "{{port}}", "--preset", "tiny",
           "--vram-gib", "{{vram_gib}}", "--model", "{{model}}"]
model = "refserver-tiny"

[cards.box]
server = "ref"
backend = "docker"
mem_limit = "512m"
vram_gib = 1
meters = ["host"]

# Request 1 (seed 1) is served; request 2 (seed 2) allocates 2 GiB of host memory in a 512 MiB container.
[flags.default]
role = "default"
args = ["--fault", "host-memory=2048@2"]

# The same 2 GiB at load, after the model and before the port is bound.
[flags.host-cache]
role = "offload"
args = ["--cond-cache", "host", "--fault", "load-host-memory=2048"]

[fixtures.shapes]
prompt = "shapes on a table"
references = ["{ref}"]

[matrix]
references = [1]
"""


@pytest.mark.docker
def test_a_container_oom_killed_is_a_host_memory_oom_in_a_request_and_at_load(
        docker_client: docker.DockerClient, refserver_image: str, tmp_path: Path) -> None:
    path = tmp_path / "matrix.toml"
    path.write_text(textwrap.dedent(MATRIX).format(name=f"{RUN_PREFIX}host-oom", results=tmp_path / "results",
                                                   image=refserver_image, ref=REF))
    plan = subprocess.run([sys.executable, "-m", "runner", "plan", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert plan.returncode == 0 and "host memory limited to 512 MiB" in plan.stdout, plan.stdout + plan.stderr

    proc = subprocess.run([sys.executable, "-m", "runner", str(path), "--no-progress"], capture_output=True,
                          text=True, timeout=400)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    run = next((tmp_path / "results").glob(f"{RUN_PREFIX}host-oom*"))

    # during a request: the engine said OOMKilled, the step is an OOM of host memory
    served = json.loads((run / "box/default/refs-1/shapes-seed-1.json").read_text())
    killed = json.loads((run / "box/default/refs-1/shapes-seed-2.json").read_text())
    assert served["status"] == "ok", served
    failure = killed["failure"]
    assert killed["status"] == "failed" and failure["kind"] == "oom", failure  # not "crash"
    assert "host memory" in failure["message"] and "not device memory" in failure["message"], failure
    assert failure["exit_code"] == 137 and failure["oom"]["memory"] == "host", failure
    assert any("fault host-memory@2" in line for line in failure["evidence"]), failure["evidence"]
    session = json.loads((run / "box/default/session.json").read_text())
    assert session["starts"][-1]["info"]["oom_killed"] is True, session["starts"][-1]["info"]
    assert session["starts"][-1]["info"]["mem_limit"] == 512 * 2**20

    # at load: the same kill before the server was ready
    load = json.loads((run / "box/host-cache/session.json").read_text())
    start = load["starts"][-1]["failure"]
    assert start["kind"] == "oom_at_load" and "host memory" in start["message"], start
    assert start["oom"]["memory"] == "host" and load["starts"][-1]["info"]["oom_killed"] is True, load

    # the verdict says which memory: on the console, in verdict.json and in report.md
    (verdict,) = json.loads((run / "verdict.json").read_text())["verdicts"]
    assert verdict["world"] == "not-built", verdict
    line = next(ln for ln in proc.stdout.splitlines() if "not-built" in ln)
    assert "default host-memory OOM at 1 ref" in line and "host-cache host-memory OOM at load" in line, line
    assert "VRAM" not in line and "GiB" not in line, line
    stops = verdict["evidence"]["flag_sets"]
    assert {f: (s["cause"], s["memory"]) for f, s in stops.items()} == {
        "default": ("oom", "host"), "host-cache": ("oom-at-load", "host")}, stops
    report = (run / "report.md").read_text()
    assert "It ran out of host memory at 1 ref: the kernel's OOM killer ended the server" in report
    assert "It ran out of host memory at load" in report
    assert proc.returncode == 0, proc.stderr[-2000:]  # the card reached a world
