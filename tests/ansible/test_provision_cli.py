"""`runner provision` drives the real playbook through ansible-runner; here against localhost only."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import threading
from collections.abc import Callable
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


def _check_diff_argv(tmp_path: Path) -> tuple[list[str], dict[str, str], Path]:
    inventory = local_inventory(tmp_path / "inventory.yml", group="monitor")
    prom = tmp_path / "prometheus.yml"
    argv = [sys.executable, "-m", "runner", "provision", "-i", str(inventory), "--tags", "monitoring",
            "--skip-tags", "monitoring_grafana", "--check", "--diff", "-K",
            "-e", f"monitoring_prometheus_config={prom}", "-e", "monitoring_become=false",
            "-e", "monitoring_manage_services=false"]
    env = {**os.environ, "ANSIBLE_PYTHON_INTERPRETER": sys.executable, "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp")}
    return argv, env, prom


def _assert_check_diff_ran(rc: int, out: str, prom: Path) -> None:
    # No config there yet: NOT READY, --check or not (a real run would write it), and a non-zero exit.
    assert rc != 0, out[-4000:]
    assert "+# BEGIN runner scrape jobs" in out and "+  - job_name: runner-sidecar" in out
    assert "Provision the Prometheus datasource" not in out  # skipped by --skip-tags
    assert "localhost NOT READY: monitoring: monitoring: --check:" in out
    assert not prom.exists()
    assert "not-a-real-password" not in out


def _controlling_terminal(slave_name: str) -> Callable[[], None]:
    # Run in the child after setsid (start_new_session): a session leader that opens a terminal without
    # O_NOCTTY makes it its controlling terminal, which is what getpass opens as /dev/tty.
    return lambda: os.close(os.open(slave_name, os.O_RDWR))


class _PtyReader(threading.Thread):
    """Drains the pty's master side (a full pty buffer would block the child) and keeps what it read."""

    def __init__(self, master: int) -> None:
        super().__init__(daemon=True)
        self.master, self.data, self.cond = master, b"", threading.Condition()

    def run(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: every slave side closed
                chunk = b""
            with self.cond:
                self.data += chunk
                self.cond.notify_all()
            if not chunk:
                return

    def wait_for(self, text: bytes, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: text in self.data, timeout)


def test_provision_check_diff_with_a_piped_password_under_a_terminal(tmp_path: Path) -> None:
    """`runner provision -K --check --diff --skip-tags`: ansible-playbook's BECOME prompt is answered (else
    this would hang until the timeout), the Grafana part is skipped, and the Prometheus change is shown as a diff
    without being made. The password comes on stdin while the command has a controlling terminal, as when a
    person runs scripts/test.sh: it must not wait for a keyboard on that terminal."""
    argv, env, prom = _check_diff_argv(tmp_path)
    master, slave = pty.openpty()
    try:
        proc = subprocess.run(argv, input="not-a-real-password\n", capture_output=True, text=True, timeout=300,
                              env=env, start_new_session=True, preexec_fn=_controlling_terminal(os.ttyname(slave)))
    finally:
        os.close(slave)
        os.close(master)
    _assert_check_diff_ran(proc.returncode, proc.stdout + proc.stderr, prom)


def test_provision_asks_a_person_for_the_password_on_the_terminal(tmp_path: Path) -> None:
    """A person at a terminal: `BECOME password:` is printed there, the typed password is not echoed, and it
    answers ansible-playbook's prompt (the run completes as above)."""
    argv, env, prom = _check_diff_argv(tmp_path)
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True,
                            preexec_fn=_controlling_terminal(os.ttyname(slave)))
    os.close(slave)
    reader = _PtyReader(master)
    reader.start()
    try:
        assert reader.wait_for(b"BECOME password: ", 60), reader.data[-2000:]
        os.write(master, b"not-a-real-password\n")
        rc = proc.wait(300)
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    _assert_check_diff_ran(rc, reader.data.decode(errors="replace"), prom)
