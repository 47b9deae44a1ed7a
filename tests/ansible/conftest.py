"""Helpers for the provisioning tests: run ansible/provision.yml for real against localhost only.

Every run here uses an inventory whose only host is localhost with ansible_connection=local (or the shipped
inventory with --limit localhost): nothing is sent to the user's GPU hosts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ANSIBLE_DIR = ROOT / "ansible"
PLAYBOOK = ANSIBLE_DIR / "provision.yml"
VENV_BIN = Path(sys.executable).parent
# The summary's own failure (a required step not ready) repeats the steps' failures: not listed again.
SUMMARY_FAIL_TASK = "Exit non-zero when a required step is not ready"


def tool(name: str) -> str | None:
    """The venv's copy of an Ansible tool, else one on PATH."""
    here = VENV_BIN / name
    return str(here) if here.exists() else shutil.which(name)


@dataclass
class PlaybookResult:
    status: str
    rc: int
    stdout: str
    failures: list[str] = field(default_factory=list)  # msg of every failed task
    hosts: set[str] = field(default_factory=set)  # hosts that any task ran on
    changed: int = 0
    summary: list[str] = field(default_factory=list)  # the lines of the final "what is ready" summary

    @property
    def ok(self) -> bool:
        return self.status == "successful" and self.rc == 0


def local_inventory(path: Path, host_vars: dict[str, Any] | None = None, group: str = "gpu_hosts") -> Path:
    """An inventory whose one host is this machine, in `group`."""
    hv = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable, **(host_vars or {})}
    path.write_text(yaml.safe_dump({group: {"hosts": {"localhost": hv}}}))
    return path


def run_playbook(tmp_path: Path, inventory: Path, tags: str, extravars: dict[str, Any] | None = None,
                 check: bool = False, limit: str | None = None, diff: bool = False,
                 skip_tags: str | None = None) -> PlaybookResult:
    """provision.yml through ansible-runner's Python API (the design drives provisioning with ansible-runner)."""
    import ansible_runner

    pdd = tmp_path / f"runner-{tags}-{len(list(tmp_path.glob('runner-*')))}"
    pdd.mkdir()
    cmdline = " ".join(f for f, on in (("--check", check), ("--diff", diff)) if on) or None
    env = {
        "ANSIBLE_CONFIG": str(ANSIBLE_DIR / "ansible.cfg"),
        "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp"),
        "ANSIBLE_NOCOLOR": "1",
        # SSH control sockets in the test's temp dir, not in ~/.ansible/cp.
        "ANSIBLE_SSH_CONTROL_PATH_DIR": str(tmp_path / "cp"),
        "ANSIBLE_SSH_ARGS": "-o ControlMaster=auto -o ControlPersist=10s",
        # The modules run under this interpreter; never let discovery pick a broken shim.
        "ANSIBLE_PYTHON_INTERPRETER": sys.executable,
        # ansible-runner starts `ansible-playbook` from PATH: make it this venv's.
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    r = ansible_runner.run(
        private_data_dir=str(pdd), playbook=str(PLAYBOOK), inventory=str(inventory), tags=tags,
        extravars=extravars or {}, cmdline=cmdline, limit=limit, quiet=True, envvars=env, skip_tags=skip_tags,
    )
    failures, hosts = [], set()
    for ev in r.events:
        data = ev.get("event_data", {})
        if data.get("host"):
            hosts.add(data["host"])
        if (ev.get("event") == "runner_on_failed" and not data.get("ignore_errors")
                and data.get("task") != SUMMARY_FAIL_TASK):
            res = data.get("res", {})
            # A failed loop reports "One or more items failed" plus the items: keep the items' messages.
            items = [x.get("msg", "") for x in res.get("results", []) if x.get("failed")]
            msgs = items or [res.get("msg", "")]
            failures.extend(m for m in msgs if m)
    changed = sum((r.stats or {}).get("changed", {}).values()) if r.stats else 0
    summary = next((ev["event_data"]["res"].get("msg") for ev in r.events
                    if ev.get("event") == "runner_on_ok"
                    and ev.get("event_data", {}).get("task") == "What is ready, what is not"), None)
    return PlaybookResult(r.status, r.rc, r.stdout.read(), failures, hosts, changed,
                          summary if isinstance(summary, list) else [])


def docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=15).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def local_base_image() -> str:
    """An image on the local engine no other test removes: the offline base scripts/services.sh builds. The newest
    tagged image may be a test's short-lived one (test_ansible_runs imports and removes its pinned image while a
    build here used it: a clean-clone failure, 2026-12-03)."""
    base = "runner-base:bookworm"
    if subprocess.run(["docker", "image", "inspect", base], capture_output=True).returncode != 0:
        pytest.skip(f"no {base} image: scripts/services.sh builds it (docker/refserver/build.sh)")
    return base


@pytest.fixture
def inventory(tmp_path: Path):
    def make(**host_vars: Any) -> Path:
        return local_inventory(tmp_path / f"inventory-{len(list(tmp_path.glob('inventory-*')))}.yml", host_vars)

    return make


@pytest.fixture(scope="session")
def docker_engine() -> None:
    if not docker_answers():
        pytest.skip("no Docker Engine answers on this machine (`docker info`)")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # An ANSIBLE_* variable from the caller's shell must not change what the tests see.
    for k in list(os.environ):
        if k.startswith("ANSIBLE_"):
            monkeypatch.delenv(k)
