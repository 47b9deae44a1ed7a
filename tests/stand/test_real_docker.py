"""The production path: one card of examples/real-omni.toml through the docker backend, against the stand's image
(docker/omni-stand/: the released vLLM-Omni 0.30.0 with our CPU platform, built offline from a wheelhouse). The real
server behind a port the engine publishes, its log through the engine, the tiny pipeline mounted read-only as the
seed mounts its weights — and the same worlds and OOM sites as the local backend's (tests/stand/test_real_runs.py):
cpu-small runs out in a request at vLLM-Omni's own line, cpu-tiny at load.

The image is built by the README's test command (scripts/test.sh → docker/omni-stand/build.sh) outside pytest;
where it is not there the tests skip with that reason, unless RUNNER_REQUIRE_STAND=1 (CI)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stand.conftest import EDIT_PLUS, OOM_SITE, REQUIRED, ROOT, require_stand, stand_example

# On the worker of tests/docker/: a run with docker cards first reaps the runner-managed containers whose runner is
# gone, which tests/docker/test_owners.py makes on purpose (tests/conftest.py, GROUP_BY_FOLDER).
pytestmark = pytest.mark.xdist_group("docker-engine")


def stand_image() -> str:
    """The tag this checkout's content makes, when the engine holds it."""
    require_stand()
    why = None
    try:
        tag = subprocess.run([str(ROOT / "docker" / "omni-stand" / "build.sh"), "tag"], capture_output=True,
                             text=True, timeout=60, cwd=ROOT).stdout.strip().splitlines()[-1:]
        found = tag and subprocess.run(["docker", "image", "inspect", tag[0]], capture_output=True,
                                       timeout=30).returncode == 0
        if found:
            return tag[0]
        why = f"the stand's image {tag[0] if tag else '(no tag)'} is not built: run docker/omni-stand/build.sh"
    except (OSError, subprocess.SubprocessError) as exc:
        why = f"no Docker engine to ask for the stand's image: {exc}"
    if REQUIRED:
        pytest.fail(why + "; RUNNER_REQUIRE_STAND=1 requires it")
    pytest.skip(why)


def docker_matrix(folder: Path, image: str) -> Path:
    """examples/real-omni.toml with its server in the stand's image on the docker backend: the same command after
    `vllm-omni serve` (the image's entrypoint), the model at /models, the cards cpu-small and cpu-tiny. No diagnosis
    pass: what these tests compare with the local backend is read from the measured starts and requests, and a pass
    is two more starts of the real server (the local backend's are tests/stand/test_real_runs.py's)."""
    path = stand_example(folder, diagnosis='"off"',
                         matrix={"flags": '["default"]', "cards": '["cpu-small", "cpu-tiny"]'})
    text = path.read_text()
    text = re.sub(r'command = \[".stand/venv/bin/vllm-omni", "serve", ".stand/models/tiny-qwen-image-edit-plus",',
                  f'image = "{image}"\nport = 8000\nmounts = [{{ source = "{EDIT_PLUS.resolve()}", '
                  'target = "/models/tiny-qwen-image-edit-plus" }]\n'
                  'command = ["/models/tiny-qwen-image-edit-plus",', text)
    text = re.sub(r'(\[cards\.cpu-(small|tiny)\]\n)', r'\1backend = "docker"\n', text)
    assert text.count('backend = "docker"') == 2 and f'image = "{image}"' in text, text
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def docker_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    image = stand_image()
    results = tmp_path_factory.mktemp("real-omni-docker")
    matrix = docker_matrix(results / "matrix", image)
    proc = subprocess.run([sys.executable, "-m", "runner", str(matrix), "--results", str(results), "--no-progress"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run_dir,) = results.glob("real-omni-*")
    return run_dir


def verdict(run_dir: Path, card: str) -> dict:
    return next(v for v in json.loads((run_dir / "verdict.json").read_text())["verdicts"] if v["card"] == card)


def test_the_small_card_runs_out_in_a_request_at_vllm_omnis_line_inside_the_container(docker_run: Path) -> None:
    card = verdict(docker_run, "cpu-small")
    assert card["world"] == "not-built"
    steps = [json.loads(p.read_text()) for p in (docker_run / "cpu-small" / "default").glob("refs-*/*.json")]
    (oom,) = [s for s in steps if s["status"] == "failed"]
    assert oom["references"] == 3 and oom["failure"]["kind"] == "oom"
    assert oom["failure"]["oom"]["site"] == OOM_SITE, oom["failure"]["oom"]  # the local backend's (test_real_runs)
    served = {s["references"]: s for s in steps if s["status"] == "ok"}
    assert sorted(served) == [1, 2] and all(s["server_peak_mib"] > 100 for s in served.values())
    session = json.loads((docker_run / "cpu-small" / "default" / "session.json").read_text())
    start = session["starts"][0]
    assert session["backend"] == "docker" and start["info"].get("container_id"), start["info"]
    # its log came through the engine: the server's own lines, the accounted card's OOM line among them
    log = (docker_run / "cpu-small" / "default" / start["info"]["log"]).read_text()
    assert "accounted card: torch.OutOfMemoryError" in log


def test_the_tiny_card_runs_out_at_load_inside_the_container(docker_run: Path) -> None:
    card = verdict(docker_run, "cpu-tiny")
    assert card["world"] == "not-built", card["reason"]
    session = json.loads((docker_run / "cpu-tiny" / "default" / "session.json").read_text())
    assert session["starts"][0]["failure"]["kind"] == "oom_at_load", session["starts"][0]["failure"]
