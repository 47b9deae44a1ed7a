"""`runner provision` drives the real playbook through ansible-runner; here against localhost only."""

from __future__ import annotations

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
