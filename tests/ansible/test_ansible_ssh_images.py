"""dcgm-exporter and the serving image over real SSH (sshworld.py): each test on a host of its own, so they run
beside test_ansible_ssh.py's chain of runs instead of after it.
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest
from conftest import local_base_image, run_playbook
from sshhost import free_port
from sshworld import ssh_world

pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.usefixtures("clean_env")]


@pytest.fixture
def world(tmp_path_factory: pytest.TempPathFactory):
    yield from ssh_world(tmp_path_factory)

def test_dcgm_that_cannot_start_leaves_no_container(world, tmp_path: Path) -> None:
    """dcgm-exporter run on its own (the docker step did not say --gpus is unusable): `docker run --gpus all`
    fails here, and the container it created is removed, not left Created with a restart policy."""
    name = world["ev"]["meters_dcgm_container"]
    image, tag = local_base_image().rsplit(":", 1)
    ev = {**world["ev"], "meters_dcgm_image": image, "meters_dcgm_tag": tag}
    r = run_playbook(tmp_path, world["inv_one"], "meters_dcgm", ev)
    summary = "\n".join(r.summary)
    assert r.rc == 0, summary  # optional: not ready, but not a failed run
    assert "rtx3090 NOT READY (optional): meters_dcgm: meters: dcgm-exporter did not start" in summary, summary
    assert "The container was removed" in summary
    ps = subprocess.run(["docker", "ps", "-a", "--filter", f"name={name}", "-q"], capture_output=True, text=True)
    assert ps.stdout.strip() == ""

    # A registry the host cannot reach: the message says how to bring the image over instead.
    ev = {**world["ev"], "meters_dcgm_image": f"127.0.0.1:{free_port()}/dcgm-exporter"}
    r = run_playbook(tmp_path, world["inv_one"], "meters_dcgm", ev)
    summary = "\n".join(r.summary)
    assert "could not pull" in summary and "cannot reach the registry" in summary, summary
    assert "docker save" in summary and "docker load" in summary


def test_serving_image_build_over_ssh_leaves_no_async_files(world, tmp_path: Path) -> None:
    """The build path for real, with a stand-in build context (a one-layer Dockerfile that labels the pins it is
    given; the real one needs CUDA, torch and hours): async over SSH, the image carries the pins, and the async
    job files went to runner's build directory and were removed, not to ~/.ansible_async."""
    host = world["host"]
    base = local_base_image()
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    pins = {"vllm": "VLLM_VERSION", "transformers": "TRANSFORMERS_VERSION", "diffusers": "DIFFUSERS_REF",
            "vllm-omni": "VLLM_OMNI_REF", "python": "PYTHON_VERSION"}
    (ctx / "Dockerfile").write_text(
        f"FROM {base}\nARG {' '.join(pins.values())} TORCH_VERSION TORCH_CUDA\n"
        + "".join(f"LABEL runner.pins.{k}=${v}\n" for k, v in pins.items())
        + "LABEL runner.pins.torch=${TORCH_VERSION}+${TORCH_CUDA}\n")
    name = f"runner-test/serving:{uuid.uuid4().hex[:6]}"
    build_dir = host.home / ".cache/runner/build/vllm-omni"
    ev = {**world["ev"], "serving_image_name": name, "serving_image_build": True,
          "serving_image_context_src": f"{ctx}/", "serving_image_min_free_gib": 0}
    try:
        r = run_playbook(tmp_path, world["inv_one"], "serving_image", ev)
        assert r.ok, (r.failures, r.summary)
        assert "rtx3090 READY: serving_image" in "\n".join(r.summary)
        labels = subprocess.run(["docker", "image", "inspect", "--format", "{{json .Config.Labels}}", name],
                                capture_output=True, text=True, check=True).stdout
        assert '"runner.pins.vllm-omni":"8484d85d1"' in labels
        assert (build_dir / "Dockerfile").exists() and not (build_dir / ".async").exists()
        assert not (host.home / ".ansible_async").exists()
        again = run_playbook(tmp_path, world["inv_one"], "serving_image", ev)
        assert again.ok and again.changed == 0 and "present with the expected pins; no build" in again.stdout
    finally:
        subprocess.run(["docker", "image", "rm", "--force", name], capture_output=True)
