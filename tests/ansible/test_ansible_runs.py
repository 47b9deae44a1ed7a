"""Real runs of provision.yml against localhost (ansible_connection=local) through ansible-runner.

What runs here: preflight (no NVIDIA driver here; and a stand-in nvidia-smi for the parsing and holder logic),
assets (manifest and single files, passing and tampered), docker and serving_image checks when a Docker
Engine answers, dcgm-exporter's ownership guard in --check, and the monitoring role's files rendered into a
temp dir. What does not: anything on a GPU host, a real image build, Grafana itself, systemd units.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml
from conftest import ANSIBLE_DIR, local_base_image, local_inventory, run_playbook

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_env")]


# --- preflight ---------------------------------------------------------------------------------------------

def test_preflight_without_nvidia_smi_fails_clearly(tmp_path: Path, inventory) -> None:
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi")
    r = run_playbook(tmp_path, inventory(), "preflight")
    assert not r.ok
    assert r.hosts == {"localhost"}
    assert any("nvidia-smi is not usable on localhost" in m and "could not be executed" in m
               and "driver >= 580.65.06" in m for m in r.failures), r.failures


def fake_nvidia_smi(tmp_path: Path, holders: str = "", card: str = "NVIDIA GeForce RTX 3090, 615.71.09, 24576, 8.6",
                    ) -> str:
    """A stand-in for nvidia-smi that answers the three queries preflight makes."""
    (tmp_path / "holders").write_text(holders)
    exe = tmp_path / "nvidia-smi"
    exe.write_text(f"""#!/bin/sh
case "$*" in
  *--query-gpu=*) echo "{card}, GPU-00000000-0000-0000-0000-fake00003090" ;;
  *--query-compute-apps=*) cat "{tmp_path}/holders" ;;
  "") echo "| NVIDIA-SMI 615.71.09    Driver Version: 615.71.09    CUDA Version: 13.4 |" ;;
  *) exit 2 ;;
esac
""")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe)


SEED_3090 = {"gpu_name": "NVIDIA GeForce RTX 3090", "gpu_arch": "sm_86", "gpu_vram_gib": 24}


def test_preflight_reports_a_holder_without_stopping_it(tmp_path: Path, inventory) -> None:
    # Our own PID stands in for relayview-inference's worker: ps can name it, and nothing may touch it.
    smi = fake_nvidia_smi(tmp_path, f"{os.getpid()}, relayview-inference-worker, 22000\n")
    r = run_playbook(tmp_path, inventory(**SEED_3090), "preflight", {"preflight_nvidia_smi": smi})
    assert r.ok, r.failures
    assert "NVIDIA GeForce RTX 3090" in r.stdout and "sm_86" in r.stdout and "CUDA 13.4" in r.stdout
    assert "WARNING: GPU 0 on localhost is in use by 1 process(es)" in r.stdout
    assert f"pid {os.getpid()} relayview-inference-worker, 22000 MiB" in r.stdout
    assert r.changed == 0


def test_preflight_require_idle_gpu_stops_with_a_clear_message(tmp_path: Path, inventory) -> None:
    smi = fake_nvidia_smi(tmp_path, f"{os.getpid()}, relayview-inference-worker, 22000\n")
    r = run_playbook(tmp_path, inventory(**SEED_3090, require_idle_gpu=True), "preflight",
                     {"preflight_nvidia_smi": smi})
    assert not r.ok
    (msg,) = r.failures
    assert "is held by" in msg and "relayview-inference-worker" in msg
    assert "require_idle_gpu is set" in msg and "never stops a process it did not start" in msg


def test_preflight_rejects_the_wrong_card_and_old_driver(tmp_path: Path, inventory) -> None:
    smi = fake_nvidia_smi(tmp_path, card="NVIDIA GeForce RTX 3090, 550.54.14, 24576, 8.6")
    r = run_playbook(tmp_path, inventory(gpu_name="NVIDIA GeForce RTX 5080", gpu_arch="sm_120", gpu_vram_gib=16),
                     "preflight", {"preflight_nvidia_smi": smi})
    assert not r.ok
    (msg,) = r.failures
    assert "is not the machine the inventory describes" in msg
    assert "NVIDIA GeForce RTX 3090 sm_86" in msg and "driver 550.54.14" in msg and "sm_120" in msg


# --- assets ------------------------------------------------------------------------------------------------

def _assets(tmp_path: Path) -> dict:
    root = tmp_path / "weights" / "snapshots" / "790c9263"
    (root / "transformer").mkdir(parents=True)
    files = {"model_index.json": b'{"_class_name": "QwenImagePipeline"}',
             "transformer/part-1.safetensors": b"\x01" * 4096,
             "transformer/part-2.safetensors": b"\x02" * 4096}
    for rel, data in files.items():
        (root / rel).write_bytes(data)
    manifest = tmp_path / "weights.sha256"
    manifest.write_text("".join(f"{hashlib.sha256(d).hexdigest()}  {rel}\n" for rel, d in files.items()))
    ref = tmp_path / "refs" / "ref-1.png"
    ref.parent.mkdir()
    ref.write_bytes(b"\x89PNG fake reference")
    return {
        "assets_manifests": [{"name": "weights", "root": str(root), "manifest": str(manifest),
                              "sha256": hashlib.sha256(manifest.read_bytes()).hexdigest()}],
        "assets_files": [{"path": str(ref), "sha256": hashlib.sha256(ref.read_bytes()).hexdigest()}],
    }


def test_assets_verify(tmp_path: Path, inventory) -> None:
    r = run_playbook(tmp_path, inventory(), "assets", _assets(tmp_path))
    assert r.ok, r.failures
    assert "assets verified on localhost: weights; 1 single file(s)" in r.stdout
    assert r.changed == 0


def test_assets_name_the_tampered_and_missing_files(tmp_path: Path, inventory) -> None:
    v = _assets(tmp_path)
    root = Path(v["assets_manifests"][0]["root"])
    (root / "transformer/part-2.safetensors").write_bytes(b"\x02" * 4095 + b"\x03")  # one byte changed
    r = run_playbook(tmp_path, inventory(), "assets", v)
    assert not r.ok
    (msg,) = r.failures
    assert "weights under" in msg and "transformer/part-2.safetensors: FAILED" in msg
    assert "part-1" not in msg and "model_index.json" not in msg

    (root / "model_index.json").unlink()
    Path(v["assets_files"][0]["path"]).write_bytes(b"\x89PNG another image")
    v["assets_manifests"] = []  # now only the single file speaks
    r = run_playbook(tmp_path, inventory(), "assets", v)
    assert not r.ok
    (msg,) = r.failures
    assert "refs/ref-1.png on localhost has sha256" in msg and "expected" in msg


def test_assets_refuse_placeholders_and_a_changed_manifest(tmp_path: Path, inventory) -> None:
    v = _assets(tmp_path)
    v["assets_files"][0]["sha256"] = "FILL-IN"
    r = run_playbook(tmp_path, inventory(), "assets", v)
    assert not r.ok and "no real sha256 for" in r.failures[0] and "ref-1.png" in r.failures[0]

    v = _assets(tmp_path / "b")
    Path(v["assets_manifests"][0]["manifest"]).write_text("0" * 64 + "  model_index.json\n")
    r = run_playbook(tmp_path, inventory(), "assets", v)
    assert not r.ok and "weights.sha256 (weights) does not have sha256" in r.failures[0]


# --- docker, serving_image, meters (need a Docker Engine on this machine) -----------------------------------

@pytest.mark.docker
def test_docker_checks_report_and_install_nothing(tmp_path: Path, inventory, docker_engine) -> None:
    # probed with an image no test removes: the newest local image may be another test's, gone by the probe
    r = run_playbook(tmp_path, inventory(), "docker", {"docker_probe_image": local_base_image()})
    assert "answers for" in r.stdout and "--gpus:" in r.stdout
    assert r.changed == 0  # runner_install_packages is false: nothing installed or configured
    if r.ok:  # a machine where `docker run --gpus all` works
        assert "--gpus: works" in r.stdout
    else:  # here: the throwaway --gpus probe fails the way Docker fails without the toolkit
        (msg,) = r.failures
        assert "cannot run GPU containers" in msg and "docker run --gpus all" in msg
        assert "could not select device driver" in msg or "not on PATH" in msg
        assert "localhost NOT READY: docker:" in "\n".join(r.summary)


@pytest.fixture
def pinned_test_image(docker_engine, tmp_path: Path):
    """A tiny local image carrying the serving image's pin labels (no registry needed), removed afterwards."""
    name = f"runner-ansible-test/vllm-omni:{uuid.uuid4().hex[:8]}"
    d = yaml.safe_load((ANSIBLE_DIR / "roles/serving_image/defaults/main.yml").read_text())
    labels = {"runner.pins.vllm": d["serving_image_vllm_version"],
              "runner.pins.torch": f"{d['serving_image_torch_version']}+{d['serving_image_torch_cuda']}",
              "runner.pins.transformers": d["serving_image_transformers_version"],
              "runner.pins.diffusers": d["serving_image_diffusers_ref"],
              "runner.pins.vllm-omni": d["serving_image_vllm_omni_ref"],
              "runner.pins.python": d["serving_image_python_version"]}
    ctx = tmp_path / "img"
    ctx.mkdir()
    (ctx / "marker").write_text("runner ansible test\n")
    tar = subprocess.run(["tar", "-C", str(ctx), "-c", "."], capture_output=True, check=True).stdout
    change = "LABEL " + " ".join(f"{k}={v}" for k, v in labels.items())
    subprocess.run(["docker", "import", "-c", change, "-", name], input=tar, capture_output=True, check=True)
    yield name
    subprocess.run(["docker", "rm", "--force", f"runner-ansible-test-{name.rsplit(':', 1)[1]}"], capture_output=True)
    subprocess.run(["docker", "image", "rm", "--force", name], capture_output=True)


@pytest.mark.docker
def test_serving_image_skips_a_tag_with_the_same_pins(tmp_path: Path, inventory, pinned_test_image) -> None:
    r = run_playbook(tmp_path, inventory(), "serving_image", {"serving_image_name": pinned_test_image})
    assert r.ok, r.failures
    assert "present with the expected pins; no build" in r.stdout
    assert r.changed == 0


@pytest.mark.docker
def test_serving_image_would_rebuild_other_pins(tmp_path: Path, inventory, pinned_test_image) -> None:
    build_dir = tmp_path / "build"
    r = run_playbook(tmp_path, inventory(), "serving_image",
                     {"serving_image_name": pinned_test_image, "serving_image_vllm_version": "0.30.0",
                      "serving_image_build_dir": str(build_dir)}, check=True)
    # Not the pinned image: NOT READY in --check too (a real run would build it).
    assert not r.ok and "localhost NOT READY: serving_image: serving_image: --check:" in "\n".join(r.summary)
    assert "present with other pins" in r.stdout and "would build (check mode)" in r.stdout
    assert not build_dir.exists()  # --check wrote nothing and built nothing


@pytest.mark.docker
def test_dcgm_exporter_leaves_a_foreign_container_alone(tmp_path: Path, inventory, pinned_test_image) -> None:
    name = f"runner-ansible-test-{pinned_test_image.rsplit(':', 1)[1]}"
    subprocess.run(["docker", "create", "--name", name, pinned_test_image, "/marker"], capture_output=True, check=True)
    before = subprocess.run(["docker", "inspect", "--format", "{{.Id}} {{.Created}}", name], capture_output=True,
                            text=True, check=True).stdout
    r = run_playbook(tmp_path, inventory(), "meters_dcgm", {"meters_dcgm_container": name}, check=True)
    # dcgm-exporter is optional: the run goes on, and the summary says why it is not ready.
    assert "localhost NOT READY (optional): meters_dcgm" in "\n".join(r.summary)
    assert any("without runner's label" in m and "not runner's to replace" in m for m in r.failures), r.failures
    after = subprocess.run(["docker", "inspect", "--format", "{{.Id}} {{.Created}}", name], capture_output=True,
                           text=True, check=True).stdout
    assert before == after


# --- monitoring (files only: no Grafana here, services not managed) -----------------------------------------

def test_monitoring_renders_prometheus_and_grafana_files(tmp_path: Path) -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool is missing (Debian: apt-get install -y prometheus)")
    out = tmp_path / "mon"
    ev = {"monitoring_become": False, "monitoring_manage_services": False, "monitoring_install_packages": False,
          "monitoring_prometheus_config": str(out / "prometheus/prometheus.yml"),
          "monitoring_grafana_provisioning_dir": str(out / "grafana/provisioning"),
          "monitoring_grafana_dashboards_dir": str(out / "grafana/dashboards")}
    # The shipped inventory, limited to the workstation: the GPU hosts appear only as scrape targets in text.
    inv = ANSIBLE_DIR / "inventory.yml"
    r = run_playbook(tmp_path, inv, "monitoring", ev, limit="localhost")
    assert r.ok, r.failures
    assert r.hosts == {"localhost"}

    # No config there yet: one is started from monitoring/prometheus.yml's global settings plus runner's block.
    prom = yaml.safe_load((out / "prometheus/prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert [c["targets"] for c in jobs["dcgm-exporter"]["static_configs"]] == [["192.168.0.39:9400"],
                                                                             ["192.168.0.40:9400"]]
    assert [c["labels"]["card"] for c in jobs["runner-sidecar"]["static_configs"]] == ["rtx3090", "rtx5080"]
    assert jobs["runner-sidecar"]["static_configs"][0]["targets"] == ["192.168.0.39:9500"]
    source = yaml.safe_load((ANSIBLE_DIR.parent / "monitoring/prometheus.yml").read_text())
    assert prom["global"] == source["global"]
    runner_job = next(j for j in source["scrape_configs"] if j["job_name"] == "runner")
    # The timeout is spelled out per job (a user's global one may exceed the job's interval): the interval.
    assert jobs["runner"] == {"scrape_timeout": runner_job["scrape_interval"], **runner_job}
    check = subprocess.run(["promtool", "check", "config", str(out / "prometheus/prometheus.yml")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr

    ds = yaml.safe_load((out / "grafana/provisioning/datasources/runner.yml").read_text())
    uid = ds["datasources"][0]["uid"]
    prov = yaml.safe_load((out / "grafana/provisioning/dashboards/runner.yml").read_text())
    assert prov["providers"][0]["options"]["path"] == str(out / "grafana/dashboards")
    dash_text = (out / "grafana/dashboards/runner-vram.json").read_text()
    assert "${DS_PROMETHEUS}" not in dash_text and "__inputs" not in dash_text
    dash = json.loads(dash_text)
    assert dash["uid"] == "runner-vram"
    assert {p["datasource"]["uid"] for p in dash["panels"] if "datasource" in p} == {uid}

    again = run_playbook(tmp_path, inv, "monitoring", ev, limit="localhost")
    assert again.ok and again.changed == 0  # idempotent: a rerun reloads nothing


def test_monitoring_never_edits_a_job_of_the_users_own(tmp_path: Path) -> None:
    """A config that already has a job named like one of runner's (Prometheus refuses duplicates): runner says
    so and changes nothing, rather than renaming or dropping the user's job."""
    if shutil.which("promtool") is None:
        pytest.skip("promtool is missing (Debian: apt-get install -y prometheus)")
    prom = tmp_path / "prometheus.yml"
    mine = "scrape_configs:\n  - job_name: runner-sidecar\n    static_configs:\n      - targets: ['10.0.0.1:1']\n"
    prom.write_text(mine)
    ev = {"monitoring_become": False, "monitoring_manage_services": False, "monitoring_grafana": False,
          "monitoring_prometheus_config": str(prom)}
    r = run_playbook(tmp_path, local_inventory(tmp_path / "inventory.yml", group="monitor"), "monitoring", ev)
    assert not r.ok
    (msg,) = r.failures
    assert "already has job(s) runner-sidecar outside runner's block" in msg
    assert prom.read_text() == mine and not list(tmp_path.glob("prometheus.yml.*"))


def test_monitoring_without_promtool_says_what_to_install(tmp_path: Path) -> None:
    ev = {"monitoring_become": False, "monitoring_manage_services": False, "monitoring_grafana": False,
          "monitoring_prometheus_config": str(tmp_path / "prometheus.yml"),
          "monitoring_promtool": str(tmp_path / "no-promtool")}
    r = run_playbook(tmp_path, local_inventory(tmp_path / "inventory.yml", group="monitor"), "monitoring", ev)
    (msg,) = r.failures
    assert "promtool" in msg and "pacman -S prometheus" in msg and "apt install prometheus" in msg
    assert not (tmp_path / "prometheus.yml").exists()
    assert "localhost NOT READY: monitoring:" in "\n".join(r.summary) and "--tags monitoring -K" in "\n".join(r.summary)


def test_sidecar_without_a_user_systemd_manager_says_what_to_do(tmp_path: Path, inventory) -> None:
    # This machine's PID 1 is not systemd: no user manager answers for the connecting user.
    if subprocess.run(["systemctl", "--user", "show", "--property=Version"], capture_output=True).returncode == 0:
        pytest.skip("a user systemd manager answers here")
    r = run_playbook(tmp_path, inventory(), "meters_sidecar", {"meters_sidecar_home": str(tmp_path / "meter")})
    (msg,) = r.failures
    assert "no systemd user manager for" in msg and "loginctl enable-linger" in msg
    assert not (tmp_path / "meter").exists()  # stopped before anything was written
