"""`runner provision` drives the real playbook through ansible-runner; here against localhost only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ANSIBLE_DIR, local_inventory

pytestmark = pytest.mark.slow


def test_provision_preflight_on_a_machine_without_nvidia_smi(tmp_path: Path) -> None:
    inventory = local_inventory(tmp_path / "inventory.yml")
    proc = subprocess.run([sys.executable, "-m", "runner", "provision", "-i", str(inventory), "--tags", "preflight"],
                          capture_output=True, text=True, timeout=180,
                          env={"ANSIBLE_PYTHON_INTERPRETER": sys.executable, "ANSIBLE_NOCOLOR": "1",
                               "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode != 0
    assert "nvidia-smi is not usable on localhost" in proc.stdout
    assert "runner provision: failed" in proc.stderr


def test_provision_bad_extra_var_is_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "runner", "provision", "-e", "novalue"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "--extra-var must be KEY=VALUE" in proc.stderr and "Traceback" not in proc.stderr
    assert (ANSIBLE_DIR / "provision.yml").is_file()


def test_provision_forwards_become_password_skip_tags_and_diff() -> None:
    from runner.provision import BECOME_PROMPT, build_parser, run_kwargs

    args = build_parser().parse_args(["-K", "--diff", "--check", "--skip-tags", "meters_dcgm", "-l", "rtx3090"])
    kw = run_kwargs(args, {"a": "1"}, "s3cret")
    assert kw["cmdline"] == "--check --diff --ask-become-pass"
    assert kw["skip_tags"] == "meters_dcgm" and kw["limit"] == "rtx3090" and kw["extravars"] == {"a": "1"}
    assert kw["passwords"] == {BECOME_PROMPT: "s3cret"}
    plain = run_kwargs(build_parser().parse_args([]), {}, None)
    assert plain["cmdline"] is None and "passwords" not in plain


def test_provision_check_diff_with_a_become_password_for_real(tmp_path: Path) -> None:
    """`runner provision -K --check --diff --skip-tags`: ansible-playbook's BECOME prompt is answered (else
    this would hang until the timeout), the Grafana part is skipped, and the Prometheus change is shown as a diff
    without being made."""
    inventory = local_inventory(tmp_path / "inventory.yml", group="monitor")
    prom = tmp_path / "prometheus.yml"
    proc = subprocess.run(
        [sys.executable, "-m", "runner", "provision", "-i", str(inventory), "--tags", "monitoring",
         "--skip-tags", "monitoring_grafana", "--check", "--diff", "-K",
         "-e", f"monitoring_prometheus_config={prom}", "-e", "monitoring_become=false",
         "-e", "monitoring_manage_services=false"],
        input="not-a-real-password\n", capture_output=True, text=True, timeout=300,
        env={**os.environ, "ANSIBLE_PYTHON_INTERPRETER": sys.executable, "ANSIBLE_NOCOLOR": "1",
             "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "+# BEGIN runner scrape jobs" in proc.stdout and "+  - job_name: runner-sidecar" in proc.stdout
    assert "Provision the Prometheus datasource" not in proc.stdout  # skipped by --skip-tags
    assert "localhost READY: monitoring" in proc.stdout
    assert not prom.exists()
    assert "not-a-real-password" not in proc.stdout
