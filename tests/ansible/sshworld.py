"""The world provision.yml runs in over real SSH (test_ansible_ssh.py, test_ansible_ssh_images.py).

The GPU host is a throwaway user on this machine behind its own sshd on 127.0.0.1 (sshhost.py), with its own
systemd user manager and the real Docker Engine; a second inventory host points at a closed port and is
unreachable. The workstation is localhost, with a Prometheus config in a temp dir (never /etc/prometheus).
Stand-ins only for what needs a GPU: nvidia-smi and the container hook are scripts, the sidecar replays a
recorded series instead of NVML.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from conftest import ROOT, local_base_image
from sshhost import GPU, executable, free_port, gpu_host

# The user's own Prometheus config: jobs, alerting, rule files (relative, as Debian's are), external labels
# and comments, none of which runner may drop.
USER_PROM = """\
# my workstation's Prometheus (hand-written)
global:
  scrape_interval: 15s
  evaluation_interval: 15s
  external_labels:
    monitor: desk

alerting:
  alertmanagers:
    - static_configs:
        - targets: ["127.0.0.1:9093"]

rule_files:
  - rules/alerts.yml

scrape_configs:
  # Prometheus itself
  - job_name: prometheus
    static_configs:
      - targets: ["127.0.0.1:9090"]

  - job_name: node
    static_configs:
      - targets: ["127.0.0.1:9100"]
"""
RULES = """\
groups:
  - name: desk
    rules:
      - alert: NodeDown
        expr: up{job="node"} == 0
        for: 5m
"""


def ssh_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The GPU host (sshhost.py's, with stand-ins for nvidia-smi and the toolkit's hook), an unreachable second
    host, and the workstation's Prometheus config, as a fixture yields them."""
    d = tmp_path_factory.mktemp("ssh-world")
    with gpu_host(d / "sshd") as host:
        bin_dir, replay = host.home / "bin", host.home / "replay.txt"
        executable(bin_dir / "nvidia-smi", """#!/bin/sh
case "$*" in
  *--query-gpu=*) echo "NVIDIA GeForce RTX 3090, 615.71.09, 24576, 8.6, GPU-00000000-0000-0000-0000-fake00003090" ;;
  *--query-compute-apps=*) ;;
  "") echo "| NVIDIA-SMI 615.71.09    Driver Version: 615.71.09    CUDA Version: 13.4 |" ;;
  *) exit 2 ;;
esac
""", host.user)
        # The toolkit's hook on the user's PATH: what the role looks for. dockerd here was not started with it,
        # so the decisive `docker run --gpus all` probe still fails, as it would on a host without the toolkit.
        executable(bin_dir / "nvidia-container-runtime-hook", "#!/bin/sh\nexit 0\n", host.user)

        # The workstation's runner/ as the sidecar's source, without bytecode (the second run adds some).
        src = d / "ws" / "runner"
        shutil.copytree(ROOT / "runner", src, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        prom = d / "prom" / "prometheus.yml"
        (prom.parent / "rules").mkdir(parents=True)
        prom.write_text(USER_PROM)
        (prom.parent / "rules" / "alerts.yml").write_text(RULES)

        sidecar_port, dcgm_port = free_port(), free_port()
        unreachable = {**host.hostvars(), "ansible_port": free_port()}  # nothing listens there
        inventory = {
            "gpu_hosts": {"vars": {"assets_manifests": [], "assets_files": []},
                          "hosts": {"rtx3090": {**host.hostvars(), **GPU}, "rtx5080": {**unreachable, **GPU}}},
            "monitor": {"hosts": {"localhost": {"ansible_connection": "local",
                                                "ansible_python_interpreter": sys.executable}}},
        }
        inv_all = d / "inventory.yml"
        inv_all.write_text(yaml.safe_dump(inventory))
        inventory["gpu_hosts"]["hosts"].pop("rtx5080")
        inv_one = d / "inventory-reachable.yml"
        inv_one.write_text(yaml.safe_dump(inventory))
        extravars = {
            "preflight_nvidia_smi": str(bin_dir / "nvidia-smi"),
            # The `--gpus` probe's image: the role's default (the newest local image) can be another test's
            # short-lived one, removed between the listing and the probe (a parallel run, 2026-12-03).
            "docker_probe_image": local_base_image(),
            "docker_nvidia_hook": str(bin_dir / "nvidia-container-runtime-hook"),
            "meters_sidecar_host": "127.0.0.1", "meters_sidecar_port": sidecar_port,
            "meters_sidecar_args": f"--fake-replay {replay} --loop",
            "meters_sidecar_src": str(src),
            "meters_dcgm_port": dcgm_port, "meters_dcgm_container": f"runner-test-dcgm-{uuid.uuid4().hex[:6]}",
            "serving_image_name": f"runner-test/absent:{uuid.uuid4().hex[:6]}", "serving_image_build": False,
            "monitoring_become": False, "monitoring_manage_services": False, "monitoring_install_packages": False,
            "monitoring_prometheus_config": str(prom),
            "monitoring_grafana_provisioning_dir": str(d / "grafana/provisioning"),
            "monitoring_grafana_dashboards_dir": str(d / "grafana/dashboards"),
        }
        yield {"host": host, "d": d, "inv_all": inv_all, "inv_one": inv_one, "ev": extravars, "prom": prom,
               "src": src, "sidecar_port": sidecar_port}
        subprocess.run(["docker", "rm", "--force", extravars["meters_dcgm_container"]], capture_output=True)
