"""The world the READY tests run in (issue 22), and running ansible-playbook in it the way its user does.

The GPU host is sshhost.py's (a new user, its own sshd on 127.0.0.1, its own `systemd --user`, the real Docker
Engine); the workstation is localhost with a Prometheus config in a temp dir. test_provision_ready.py gives each
of its tests a world of its own; test_provision_ready_sidecar.py's tests share one and build on its sidecar.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ANSIBLE_DIR, PLAYBOOK, ROOT, VENV_BIN
from sshhost import GPU, SIDECAR_UNIT, free_port, gpu_host

BEGIN = "# BEGIN runner scrape jobs"


def ready_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The GPU host (a new user over real SSH) and the workstation's temp folder, as a fixture yields them."""
    d = tmp_path_factory.mktemp("ready-world")
    with gpu_host(d / "sshd") as host:
        replay = host.home / "replay.txt"
        src = d / "ws" / "runner"
        shutil.copytree(ROOT / "runner", src, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        (d / "prom").mkdir()
        inventory = {
            "gpu_hosts": {"vars": {"assets_manifests": [], "assets_files": []},
                          "hosts": {"rtx3090": {**host.hostvars(), **GPU}}},
            "monitor": {"hosts": {"localhost": {"ansible_connection": "local",
                                                "ansible_python_interpreter": sys.executable}}},
        }
        inv = d / "inventory.yml"
        inv.write_text(yaml.safe_dump(inventory))
        port = free_port()
        extravars = {
            "meters_sidecar_host": "127.0.0.1", "meters_sidecar_port": port,
            "meters_sidecar_args": f"--fake-replay {replay} --loop", "meters_sidecar_src": str(src),
            "monitoring_become": False, "monitoring_manage_services": False, "monitoring_install_packages": False,
            "monitoring_grafana": False, "monitoring_prometheus_config": str(d / "prom" / "prometheus.yml"),
        }
        yield {"host": host, "d": d, "inv": inv, "ev": extravars, "src": src, "port": port}


# --- running the playbook the way its user does: ansible-playbook on the command line ------------------------

def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "ANSIBLE_CONFIG": str(ANSIBLE_DIR / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp"), "ANSIBLE_SSH_CONTROL_PATH_DIR": str(tmp_path / "cp"),
            "ANSIBLE_PYTHON_INTERPRETER": sys.executable, "PYTHONUNBUFFERED": "1",
            "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def _argv(world, tmp_path: Path, args: list[str], ev: dict | None) -> list[str]:
    evfile = tmp_path / f"ev-{len(list(tmp_path.glob('ev-*')))}.json"
    evfile.write_text(json.dumps({**world["ev"], **(ev or {})}))
    return [str(VENV_BIN / "ansible-playbook"), "-i", str(world["inv"]), str(PLAYBOOK), "-e", f"@{evfile}", *args]


class Cli:
    def __init__(self, rc: int, out: str) -> None:
        self.rc, self.out = rc, out
        # The summary task's result as ansible.cfg prints it (YAML): `ok: [host] =>` and then `msg:` with the lines.
        block = out.split("TASK [What is ready, what is not]", 1)
        self.summary = []
        if len(block) > 1:
            result = re.split(r"\n(?:TASK \[|PLAY RECAP)", block[1], maxsplit=1)[0]
            self.summary = (yaml.safe_load(result.split("=>", 1)[1]) or {}).get("msg", [])

    @property
    def text(self) -> str:
        return "\n".join(self.summary)


def cli(world, tmp_path: Path, *args: str, ev: dict | None = None) -> Cli:
    p = subprocess.run(_argv(world, tmp_path, list(args), ev), capture_output=True, text=True, timeout=600,
                       env=_env(tmp_path))
    return Cli(p.returncode, p.stdout + p.stderr)


def interrupt_at(world, tmp_path: Path, task: str, *args: str, ev: dict | None = None) -> str:
    """A real SIGINT to ansible-playbook as soon as it starts `task`, repeated every 0.2 s until it exits.

    To ansible-playbook itself, not its process group: Ctrl-C would also kill the task's own child (promtool),
    failing the task so that its rescue runs before Ansible stops. Repeated: Ansible's handler raises
    KeyboardInterrupt wherever the main thread is, and one raised inside a weakref callback is swallowed
    ("Exception ignored") and the run goes on, as a person pressing Ctrl-C once can see. The callers check the
    state the interruption left before they rely on it."""
    proc = subprocess.Popen(_argv(world, tmp_path, list(args), ev), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_env(tmp_path), start_new_session=True)
    out, hit = [], threading.Event()

    def keep_interrupting() -> None:
        hit.wait()
        while proc.poll() is None:  # not reaped yet: the PID is still this process's
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGINT)
            time.sleep(0.2)

    threading.Thread(target=keep_interrupting, daemon=True).start()
    assert proc.stdout is not None
    for line in proc.stdout:
        out.append(line)
        if not hit.is_set() and line.startswith("TASK [") and task in line:
            hit.set()
    proc.wait(120)
    hit.set()
    text = "".join(out)
    assert any(line.startswith("TASK [") and task in line for line in out), f"never reached {task!r}:\n{text[-3000:]}"
    assert proc.returncode != 0, text[-3000:]
    return text


def proc_of(pid: str) -> tuple[list[str], dict[str, str]]:
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    env = dict(e.split(b"=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in e)
    return [a.decode() for a in cmdline if a], {k.decode(): v.decode() for k, v in env.items()}


def unit_build(host) -> str:
    text = (host.home / ".config/systemd/user" / SIDECAR_UNIT).read_text()
    return re.search(r"^Environment=RUNNER_METER_BUILD=(\S+)$", text, re.M).group(1)
