"""A throwaway GPU host over real SSH: a new user, an sshd on 127.0.0.1 that logs in only with a throwaway key,
and that user's own systemd manager (`systemd --user`), so the playbook's user unit is really started.

This machine's PID 1 is not systemd, so the user manager gets what a booted system would give it: a cgroup it
owns (under the cgroup hierarchies, removed afterwards) and, in a private mount namespace, the /run/systemd/system
marker that makes it start. Nothing else is shared with the machine: the user's home, /run/user/UID, the sshd
config and the keys are the test's, and everything is removed at the end. Only what needs a GPU is a stand-in:
nvidia-smi (a script) and the sidecar's NVML source (`runner meter --fake-replay`).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.ports import free_port

SIDECAR_UNIT = "runner-meter.service"  # the meters sidecar's systemd user unit (roles/meters_sidecar)
SSHD = "/usr/sbin/sshd"
SYSTEMD = "/lib/systemd/systemd"
CGROUP_ROOTS = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup/systemd"))


@dataclass(frozen=True)
class SshHost:
    user: str
    uid: int
    home: Path
    port: int
    key: Path
    ssh_config: Path
    sshd_log: Path

    def hostvars(self) -> dict:
        """Inventory variables that reach this host over SSH (and only with the throwaway key and host key)."""
        return {"ansible_host": "127.0.0.1", "ansible_port": self.port, "ansible_user": self.user,
                "ansible_ssh_common_args": f"-F {self.ssh_config}",
                "ansible_python_interpreter": "/usr/bin/python3"}

    def run(self, cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """A shell command as the user, with its systemd manager reachable."""
        return subprocess.run(["su", "-", self.user, "-c", f"export XDG_RUNTIME_DIR=/run/user/{self.uid}; {cmd}"],
                              capture_output=True, text=True, timeout=timeout)

    def unit_state(self) -> dict[str, str]:
        """The sidecar unit's state as systemd has it (ActiveState, MainPID, UnitFileState, NeedDaemonReload)."""
        p = self.run(f"systemctl --user show {SIDECAR_UNIT} --property=ActiveState --property=MainPID "
                     "--property=UnitFileState --property=NeedDaemonReload")
        return dict(line.split("=", 1) for line in p.stdout.split())


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (a throwaway user, sshd, cgroups)"
    for exe in (SSHD, SYSTEMD, "/usr/sbin/useradd", "/usr/bin/unshare"):
        if not os.access(exe, os.X_OK):
            return f"{exe} is missing"
    if shutil.which("ssh") is None:
        return "the ssh client is missing"
    if not all(r.is_dir() for r in CGROUP_ROOTS):
        return "no cgroup hierarchy for a user systemd manager here"
    return None


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start") from None
            time.sleep(0.1)


# useradd's exit codes: 9 the name (or its user group) is taken, 10 /etc/passwd is locked by another useradd.
USERADD_NAME_TAKEN, USERADD_LOCKED = 9, 10


def create_user(groups: tuple[str, ...] = ("docker",), attempts: int = 20) -> str:
    """A new user with a random name that no other test run (someone else's, started at the same time) holds.

    useradd itself is the arbiter: it takes /etc/passwd's lock and refuses a name that exists, so a clash is
    never shared, only retried with a new name (64 random bits: a clash is already unlikely)."""
    for _ in range(attempts):
        user = f"rtest-{uuid.uuid4().hex[:16]}"
        # Password "*": no password login, but not "locked" (sshd without PAM refuses locked accounts' keys too).
        p = subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", "--password", "*",
                            *(["--groups", ",".join(groups)] if groups else []), user],
                           capture_output=True, text=True)
        if p.returncode == 0:
            return user
        if p.returncode not in (USERADD_NAME_TAKEN, USERADD_LOCKED):
            raise RuntimeError(f"useradd {user}: {p.stderr.strip()}")
        time.sleep(0.2)
    raise RuntimeError(f"useradd: no free user name after {attempts} attempts")


@contextmanager
def ssh_host(workdir: Path) -> Iterator[SshHost]:
    workdir.mkdir(parents=True, exist_ok=True)
    user = create_user()
    pw = pwd.getpwnam(user)
    uid, home = pw.pw_uid, Path(pw.pw_dir)
    run_dir = Path(f"/run/user/{uid}")
    cgroups = [root / f"runner-test-{user}" for root in CGROUP_ROOTS]
    procs: list[subprocess.Popen] = []
    made: list[Path] = []  # cgroups this test created: only those are emptied and removed
    try:
        for key in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "runner-test", "-f",
                            str(workdir / key)], check=True)
        # sshd reads authorized_keys as the user: it lives in the user's home.
        ssh_dir = home / ".ssh"
        ssh_dir.mkdir(mode=0o700)
        (ssh_dir / "authorized_keys").write_text((workdir / "client_key.pub").read_text())
        for p in (ssh_dir, ssh_dir / "authorized_keys"):
            os.chown(p, uid, pw.pw_gid)
        port = free_port()
        (workdir / "sshd_config").write_text(f"""\
Port {port}
ListenAddress 127.0.0.1
HostKey {workdir / "host_key"}
PidFile {workdir / "sshd.pid"}
AuthorizedKeysFile .ssh/authorized_keys
AllowUsers {user}
PermitRootLogin no
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
LogLevel VERBOSE
""")
        Path("/run/sshd").mkdir(exist_ok=True)
        log = workdir / "sshd.log"
        sshd = subprocess.Popen([SSHD, "-D", "-e", "-f", str(workdir / "sshd_config"), "-E", str(log)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        procs.append(sshd)
        _wait_port(port, sshd, "the test sshd")
        host_pub = (workdir / "host_key.pub").read_text().split()
        (workdir / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_pub[0]} {host_pub[1]}\n")
        cfg = workdir / "ssh_config"
        cfg.write_text(f"""\
Host 127.0.0.1
  IdentityFile {workdir / "client_key"}
  IdentitiesOnly yes
  UserKnownHostsFile {workdir / "known_hosts"}
  GlobalKnownHostsFile /dev/null
  StrictHostKeyChecking yes
  BatchMode yes
""")
        # The user's systemd manager, in a cgroup it owns.
        run_dir.mkdir(mode=0o700, exist_ok=True)
        os.chown(run_dir, uid, pw.pw_gid)
        for cg in cgroups:
            cg.mkdir()  # the name is this test's user's: a leftover would be someone else's, never reused
            made.append(cg)
            for p in [cg, *cg.iterdir()]:
                os.chown(p, uid, pw.pw_gid)
        enter = " ".join(f"echo $$ > {cg}/cgroup.procs;" for cg in cgroups)
        manager = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             f"{enter} mount -t tmpfs tmpfs /run/systemd && mkdir /run/systemd/system && "
             f"exec su {user} -c 'XDG_RUNTIME_DIR={run_dir} exec {SYSTEMD} --user'"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(manager)
        host = SshHost(user, uid, home, port, workdir / "client_key", cfg, log)
        deadline = time.monotonic() + 20
        while host.run("systemctl --user show --property=Version").returncode != 0:
            if manager.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the user's systemd manager did not start")
            time.sleep(0.3)
        yield host
    finally:
        if procs[1:]:
            subprocess.run(["su", "-", user, "-c", f"XDG_RUNTIME_DIR={run_dir} systemctl --user exit"],
                           capture_output=True, timeout=30)
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        # Whatever is still in the manager's cgroups was started there by this test: end those PIDs.
        for cg in made:
            for procs_file in cg.rglob("cgroup.procs"):
                for pid in procs_file.read_text().split():
                    with suppress(ProcessLookupError):
                        os.kill(int(pid), 9)
        # SSH sessions still open (a client's ControlPersist) run as the user, who did not exist before this
        # test: end them by PID too, or userdel refuses.
        for proc_dir in Path("/proc").iterdir():
            try:
                if proc_dir.name.isdigit() and proc_dir.stat().st_uid == uid:
                    os.kill(int(proc_dir.name), 9)
            except (FileNotFoundError, ProcessLookupError):
                pass
        time.sleep(0.5)
        for cg in made:
            if cg.exists():
                for d in sorted((p for p in cg.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                    d.rmdir()
                cg.rmdir()
        gone = subprocess.run(["userdel", "--remove", user], capture_output=True, text=True)
        if gone.returncode not in (0, 12):  # 12: no mail spool to remove
            raise RuntimeError(f"userdel {user}: {gone.stderr.strip()}")
        shutil.rmtree(run_dir, ignore_errors=True)


# The inventory's GPU facts for the stand-in host, and the series its sidecar replays instead of NVML.
GPU = {"gpu_index": 0, "gpu_name": "NVIDIA GeForce RTX 3090", "gpu_arch": "sm_86", "gpu_vram_gib": 24}
REPLAY = "0 1000000000 1100000000\n0.5 3000000000 3100000000\n1 1000000000 1100000000\n"


@contextmanager
def gpu_host(workdir: Path) -> Iterator[SshHost]:
    """ssh_host as provision.yml's GPU host (the test skipped where this machine cannot be one, or lacks the
    workstation's promtool or a Docker Engine): `~/bin` for stand-ins, and `~/replay.txt`, the series the sidecar
    replays instead of NVML."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    if shutil.which("promtool") is None:
        pytest.skip("promtool is missing (Debian: apt-get install -y prometheus)")
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        pytest.skip("no Docker Engine answers here")
    with ssh_host(workdir) as host:
        (host.home / "bin").mkdir()
        (host.home / "replay.txt").write_text(REPLAY)
        for name in ("bin", "replay.txt"):
            shutil.chown(host.home / name, host.user, host.user)
        yield host


def executable(path: Path, text: str, owner: str | None = None) -> None:
    """A script at PATH (mode 755), owned by OWNER where given."""
    path.write_text(text)
    path.chmod(0o755)
    if owner:
        shutil.chown(path, owner, owner)
