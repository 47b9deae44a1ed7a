"""The seed's fork pinned as an image that names no release: its flag sets checked at the run's preflight
against the image's own `--help` (runner.run.flag_help), on the local Docker Engine.

The image stands for the seed's `runner-vllm-omni:8484d85d1` (which this machine cannot build): the runner's
offline base with a tiny argparse program as its entrypoint, built from vLLM-Omni 0.30.0's shipped vocabulary
(tests/docker/fake_vllm_omni/vllm_serve.py says what is real in it and what is not). Its name is like
vllm-omni, its tag a commit, as the seed's."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import docker
import pytest
from docker.errors import ImageNotFound
from dockerkit import ROOT

from runner.plan.lanes import make_plan
from runner.plan.matrix import load_matrix
from runner.run import flag_help

pytestmark = pytest.mark.docker

FAKE = Path(__file__).parent / "fake_vllm_omni" / "vllm_serve.py"
VOCAB = ROOT / "runner" / "plan" / "vllm_omni_flags" / "0.30.0.json"
DOCKERFILE = """FROM {base}
COPY vllm_serve.py 0.30.0.json /opt/vllm-serve/
ENTRYPOINT ["python3", "/opt/vllm-serve/vllm_serve.py"]
"""


@pytest.fixture(scope="session")
def fork_image(docker_client: docker.DockerClient, base_image: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Built once per content (a second session reuses it): seconds, no registry."""
    digest = hashlib.sha256(FAKE.read_bytes() + VOCAB.read_bytes() + DOCKERFILE.encode()).hexdigest()[:12]
    tag = f"runner-test-vllm-omni:{digest}"
    try:
        docker_client.images.get(tag)
        return tag
    except ImageNotFound:
        pass
    ctx = tmp_path_factory.mktemp("fork-image")
    shutil.copy(FAKE, ctx / "vllm_serve.py")
    shutil.copy(VOCAB, ctx / "0.30.0.json")
    (ctx / "Dockerfile").write_text(DOCKERFILE.format(base=base_image))
    docker_client.images.build(path=str(ctx), tag=tag, rm=True, forcerm=True)
    return tag


def seed_matrix(tmp_path: Path, image: str, *, old: str = "", new: str = "") -> Path:
    """The seed's own matrix.toml on this machine's engine: its image, local references, the host meter (its
    hosts' sidecars and exporters are not here), an emulated baseline cell; `old` → `new` is the edit under test."""
    text = (ROOT / "matrix.toml").read_text()
    edits = [('image = "runner-vllm-omni:8484d85d1"', f'image = "{image}"'),
             ('results_dir = "results"', f'results_dir = "{tmp_path / "results"}"'),
             ('meters = ["sidecar", "dcgm", "host"]', 'meters = ["host"]')]
    for old_text, new_text in [*edits, (old, new)] if old else edits:
        assert old_text in text, old_text
        text = text.replace(old_text, new_text)
    lines = [ln for ln in text.splitlines() if not ln.startswith(("docker_host", "publish_host", "sidecar_url",
                                                                   "dcgm_url", "dir = "))]
    text = "\n".join(lines).replace("\n[baseline]\n", "\n[baseline]\ncell = \"rtx3090/layerwise\"\n")
    home = "/home/anodyine/.local/share/multi-model-helper-server/data/evaluation/media/image/references-suite-2"
    text = text.replace(home, str(ROOT / "examples" / "refs"))
    path = tmp_path / "matrix.toml"
    path.write_text(text)
    return path


def runner(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "RUNNER_CACHE_DIR": str(cache)})


def helpers(client: docker.DockerClient) -> list[str]:
    return [c.name for c in client.containers.list(all=True, filters={"label": "runner.purpose=flag-help"})]


def test_the_seeds_fork_with_a_misspelt_flag_is_refused_before_any_session_starts(
        tmp_path: Path, fork_image: str, docker_client: docker.DockerClient) -> None:
    """Before: the fork named no release; the typo planned and ran with exit 0 and no word, until its servers
    failed to start on the GPU hosts."""
    path = seed_matrix(tmp_path, fork_image, old='args = ["--enable-cpu-offload", "--enable-layerwise-offload"]',
                       new='args = ["--enable-cpu-offlaod", "--enable-layerwise-offload"]')
    planned = runner("plan", str(path), cache=tmp_path / "cache")
    assert planned.returncode == 0, planned.stderr
    assert f"flags: server 'vllm-omni' is vLLM-Omni and image {fork_image} names no release: its flag sets are " \
           f"checked against the server's own --help at the run's preflight" in planned.stdout
    t0 = time.monotonic()
    proc = runner(str(path), "--no-progress", cache=tmp_path / "cache")
    took = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    image_id = docker_client.images.get(fork_image).id
    assert line == (f"runner: error: {path}: key 'flags.layerwise.args': --enable-cpu-offlaod is not a flag of image "
                    f"{fork_image} (its --help=all on unix:///var/run/docker.sock, image id {image_id[:19]}); did "
                    f"you mean --enable-cpu-offload?")
    assert not (tmp_path / "results").exists()  # no run folder: nothing started
    assert helpers(docker_client) == []  # the help container is gone too
    assert not docker_client.containers.list(all=True, filters={"label": "runner.card"})
    # the image's answer is cached by its id: the next preflight asks the engine for the id only
    t0 = time.monotonic()
    again = runner(str(path), "--no-progress", cache=tmp_path / "cache")
    assert again.returncode == 2 and "cached in" in again.stderr
    print(f"preflight with the image asked: {took:.1f} s; from the cache: {time.monotonic() - t0:.1f} s")


def test_the_fork_s_own_flags_pass(tmp_path: Path, fork_image: str, docker_client: docker.DockerClient) -> None:
    m = load_matrix(seed_matrix(tmp_path, fork_image), check_files=False)
    assert flag_help.check(m, make_plan(m), ["rtx3090", "rtx5080"]) == []
    assert helpers(docker_client) == []


def test_an_image_not_on_the_engine_is_one_line(tmp_path: Path, docker_client: docker.DockerClient) -> None:
    """The runner never pulls: the flags are not checked, and one line says why (a start needs it too)."""
    m = load_matrix(seed_matrix(tmp_path, "runner-test-vllm-omni:absent"), check_files=False)
    (line,) = flag_help.check(m, make_plan(m), ["rtx3090", "rtx5080"])
    assert line == ("server 'vllm-omni' names no vLLM-Omni release and its flag sets are not checked against its "
                    "own --help (card rtx3090: image runner-test-vllm-omni:absent is not on the engine "
                    "unix:///var/run/docker.sock (the runner never pulls; a start needs it there too)); a bad flag "
                    "shows only when the server fails to start")


def test_an_engine_that_does_not_answer_is_one_line(tmp_path: Path) -> None:
    path = seed_matrix(tmp_path, "runner-test-vllm-omni:x")
    text = path.read_text().replace('backend = "docker"', 'backend = "docker"\ndocker_host = "tcp://127.0.0.1:9"')
    path.write_text(text.replace('backend = "docker"\ndocker_host', 'backend = "docker"\npublish_host = '
                                 '"0.0.0.0"\ndocker_host'))
    m = load_matrix(path, check_files=False)
    (line,) = flag_help.check(m, make_plan(m), ["rtx3090"])
    assert "(card rtx3090: " in line and "tcp://127.0.0.1:9" in line and "not checked" in line
