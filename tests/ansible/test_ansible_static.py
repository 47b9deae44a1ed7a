"""Static checks of ansible/: syntax, lint, the shipped inventory, and pins that must agree with build.sh."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml
from conftest import ANSIBLE_DIR, PLAYBOOK, ROOT, tool


def test_syntax_check() -> None:
    exe = tool("ansible-playbook")
    assert exe, "ansible-playbook is not installed (pip install ansible-core)"
    p = subprocess.run([exe, "-i", str(ANSIBLE_DIR / "inventory.yml"), str(PLAYBOOK), "--syntax-check"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.slow
def test_ansible_lint_default_profile() -> None:
    exe = tool("ansible-lint")
    if exe is None:
        pytest.skip("ansible-lint is not installed (pip install ansible-lint)")
    # --offline: no Galaxy look-ups; no .ansible-lint file, so the default rules and profile apply, none skipped.
    p = subprocess.run([exe, "--offline", "--nocolor", "provision.yml"], cwd=ANSIBLE_DIR,
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    assert not (ANSIBLE_DIR / ".ansible-lint").exists()


def _inventory() -> dict:
    exe = tool("ansible-inventory")
    p = subprocess.run([exe, "-i", str(ANSIBLE_DIR / "inventory.yml"), "--list"], capture_output=True, text=True,
                       timeout=60, check=True)
    return json.loads(p.stdout)


def test_inventory_describes_the_seed_hosts() -> None:
    inv = _inventory()
    assert sorted(inv["gpu_hosts"]["hosts"]) == ["rtx3090", "rtx5080"]
    assert inv["monitor"]["hosts"] == ["localhost"]
    hv = inv["_meta"]["hostvars"]
    assert hv["rtx3090"]["ansible_host"] == "192.168.0.39" and hv["rtx5080"]["ansible_host"] == "192.168.0.40"
    assert hv["rtx3090"]["gpu_arch"] == "sm_86" and hv["rtx5080"]["gpu_arch"] == "sm_120"
    assert (hv["rtx3090"]["gpu_vram_gib"], hv["rtx5080"]["gpu_vram_gib"]) == (24, 16)
    for h in ("rtx3090", "rtx5080"):
        assert hv[h]["ansible_user"] == "anodyine"
        assert hv[h]["weights_dir"].endswith("/state/image-service/weights")
        assert "references-suite-2" in hv[h]["references_dir"]
        assert hv[h]["baseline_dir"].endswith("attempts/2026-10-07T170729Z-q3-4r")
        # Digests only the owner can supply stay visibly unfilled (the assets role refuses them).
        assert {f["sha256"] for f in hv[h]["assets_files"]} == {"FILL-IN"}
        assert {m["name"] for m in hv[h]["assets_manifests"]} == {"weights", "baseline"}
    assert hv["localhost"]["ansible_connection"] == "local"


def test_inventory_matches_matrix_toml() -> None:
    import tomllib

    matrix = tomllib.loads((ROOT / "matrix.toml").read_text())
    hv = _inventory()["_meta"]["hostvars"]
    for name, card in matrix["cards"].items():
        assert name in hv, f"matrix card {name} has no inventory host"
        addr = hv[name]["ansible_host"]
        assert card["docker_host"] == f"ssh://{hv[name]['ansible_user']}@{addr}"
        assert card["sidecar_url"] == f"http://{addr}:9500"
        assert card["dcgm_url"] == f"http://{addr}:9400/metrics"
        assert card["vram_gib"] == hv[name]["gpu_vram_gib"]
    image = matrix["servers"]["vllm-omni"]["image"]
    defaults = yaml.safe_load((ANSIBLE_DIR / "roles/serving_image/defaults/main.yml").read_text())
    assert defaults["serving_image_name"].replace("{{ serving_image_vllm_omni_ref }}",
                                                  defaults["serving_image_vllm_omni_ref"]) == image
    mount = matrix["servers"]["vllm-omni"]["mounts"][0]["source"]
    assert mount == hv["rtx3090"]["weights_dir"]


def test_serving_image_pins_equal_build_sh() -> None:
    build = (ROOT / "docker/vllm-omni/build.sh").read_text()
    pins = dict(re.findall(r'^([A-Z_]+)="\$\{[A-Z_]+:-([^}]*)\}"', build, re.M))
    defaults = yaml.safe_load((ANSIBLE_DIR / "roles/serving_image/defaults/main.yml").read_text())
    for var, value in pins.items():
        if var == "IMAGE":
            continue
        assert str(defaults[f"serving_image_{var.lower()}"]) == value, var
    assert {"VLLM_VERSION", "TORCH_VERSION", "TRANSFORMERS_VERSION", "DIFFUSERS_REF", "VLLM_OMNI_REF"} <= set(pins)


def test_meters_defaults() -> None:
    d = yaml.safe_load((ANSIBLE_DIR / "roles/meters/defaults/main.yml").read_text())
    assert d["meters_dcgm_interval_ms"] <= 1000  # the 30 s default would miss every peak
    assert d["meters_dcgm_image"] == "nvcr.io/nvidia/k8s/dcgm-exporter" and d["meters_dcgm_tag"] not in ("", "latest")
    assert (d["meters_dcgm_port"], d["meters_sidecar_port"]) == (9400, 9500)
    dcgm = (ANSIBLE_DIR / "roles/meters/tasks/dcgm.yml").read_text()
    assert "--gpus=all" in dcgm and '- -c' in dcgm


def test_no_task_touches_owner_services() -> None:
    """Only runner's own unit, docker (opt-in, restart gated) and the monitoring stack are ever managed."""
    allowed = {"docker", "{{ meters_sidecar_unit }}", "{{ monitoring_prometheus_service }}",
               "{{ monitoring_grafana_service }}"}
    for f in (ANSIBLE_DIR / "roles").rglob("*.yml"):
        for doc in yaml.safe_load_all(f.read_text()):
            for task in _tasks(doc):
                for key in ("ansible.builtin.systemd_service", "ansible.builtin.service", "ansible.builtin.systemd"):
                    if key in task:
                        assert task[key]["name"] in allowed, f"{f}: {task.get('name')}"


def _tasks(doc):
    if isinstance(doc, list):
        for t in doc:
            if isinstance(t, dict):
                yield t
                for section in ("block", "rescue", "always"):
                    yield from _tasks(t.get(section, []))


def test_only_ansible_core_modules() -> None:
    """Arch hosts and offline workstations have ansible-core only: no community.* collection may be needed
    (ansible.builtin.package on pacman would silently need community.general.pacman, so pacman is called)."""
    for f in (ANSIBLE_DIR / "roles").rglob("*.yml"):
        for doc in yaml.safe_load_all(f.read_text()):
            for task in _tasks(doc):
                modules = [k for k in task if "." in k and not k.startswith("ansible.builtin.")]
                assert not modules, f"{f}: {task.get('name')}: {modules}"
    packages = (ANSIBLE_DIR / "roles/packages/tasks/main.yml").read_text()
    assert "pacman" in packages and "ansible_facts.pkg_mgr" in packages
