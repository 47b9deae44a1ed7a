"""The ssh:// path for real: an sshd on 127.0.0.1 with a throwaway key, through which the Docker SDK (shell-out
mode: the `ssh` binary running `docker system dial-stdio` there) drives the local engine.

The ssh client reads its config from the passwd home, not $HOME, so the test puts a wrapper named `ssh`
first on PATH that adds `-F <temporary config>`; the user's own ~/.ssh is never read or written.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from dockerkit import dead_owner_labels, labels, make_spec, new_run_id, refserver_argv

from runner.backends.docker import DockerServer, reap
from tests.ports import free_port

SSHD = "/usr/sbin/sshd"


@dataclass(frozen=True)
class Sshd:
    port: int
    log: Path

    @property
    def docker_host(self) -> str:
        return f"ssh://root@127.0.0.1:{self.port}"


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "runner-test", "-f", str(path)],
                   check=True)


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    if not os.access(SSHD, os.X_OK) or shutil.which("ssh") is None:
        pytest.skip("openssh-server/openssh-client not installed (apt-get install -y openssh-server)")
    if os.geteuid() != 0:
        pytest.skip("the test sshd logs in as root with a key; run as root")
    d = tmp_path_factory.mktemp("sshd")
    d.chmod(0o700)
    _keygen(d / "host_key")
    _keygen(d / "client_key")
    (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
    port = free_port()
    (d / "sshd_config").write_text(f"""\
Port {port}
ListenAddress 127.0.0.1
HostKey {d / "host_key"}
PidFile {d / "sshd.pid"}
AuthorizedKeysFile {d / "authorized_keys"}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
LogLevel VERBOSE
""")
    Path("/run/sshd").mkdir(exist_ok=True)  # privilege-separation directory sshd insists on
    log = d / "sshd.log"
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / "sshd_config"), "-E", str(log)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"test sshd did not start: {log.read_text() if log.exists() else ''}")
                time.sleep(0.1)
        # The client side: known host pinned to the throwaway host key, key auth only, no prompts.
        host_pub = (d / "host_key.pub").read_text().split()
        (d / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_pub[0]} {host_pub[1]}\n")
        (d / "ssh_config").write_text(f"""\
Host 127.0.0.1
  Port {port}
  User root
  IdentityFile {d / "client_key"}
  IdentitiesOnly yes
  UserKnownHostsFile {d / "known_hosts"}
  GlobalKnownHostsFile /dev/null
  StrictHostKeyChecking yes
  BatchMode yes
""")
        bin_dir = d / "bin"
        bin_dir.mkdir()
        wrapper = bin_dir / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {d / "ssh_config"} "$@"\n')
        wrapper.chmod(0o755)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
            mp.delenv("DOCKER_HOST", raising=False)
            yield Sshd(port, log)
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.docker
def test_refserver_over_ssh(docker_client, refserver_image, sshd, tmp_path):
    spec = make_spec(tmp_path, refserver_argv(), docker_host=sshd.docker_host)
    server = DockerServer(*spec)
    try:
        server.start()
        assert server.base_url.startswith("http://127.0.0.1:")
        server.wait_ready(90)
        assert server.info()["docker_host"] == sshd.docker_host
        assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
        # The container exists on the engine behind the tunnel (the local one, seen directly).
        assert docker_client.containers.get(spec.name).labels["runner.run"] == spec.labels["runner.run"]
        assert "Uvicorn running" in server.read_log()  # log streamed over the ssh connection too
    finally:
        server.stop()
    assert not docker_client.containers.list(all=True, filters={"name": f"^/{spec.name}$"}, ignore_removed=True)
    # Really through sshd, with the throwaway key (not silently the local socket).
    assert "Accepted publickey for root" in sshd.log.read_text()


@pytest.mark.docker
def test_reap_over_ssh(docker_client, base_image, sshd):
    stale = docker_client.containers.run(base_image, "sleep 60", labels={**labels(new_run_id()),
                                                                          **dead_owner_labels()},
                                         detach=True, init=True)
    try:
        assert (stale.name, True) in [(n, removed) for n, removed, _ in reap(sshd.docker_host)]
    finally:
        if docker_client.containers.list(all=True, filters={"id": stale.id}, ignore_removed=True):
            stale.remove(force=True)
