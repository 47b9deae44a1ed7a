"""docker-py's shell-out ssh socket (use_ssh_client=True) closed after its ssh process exited: the SDK's own
close writes to a dead pipe and raises BrokenPipeError, which garbage collection printed after pytest's
summary ("Exception ignored in ..."). The runner's close tolerates it and closes the pipe once. Real
processes, no Docker Engine needed."""

from __future__ import annotations

import subprocess
import sys

import pytest
from docker.transport import sshconn

from runner.backends import docker as backend

CODE = """
import gc, subprocess, sys
from docker.transport import sshconn
if sys.argv[1] == "runner":
    from runner.backends import docker as backend
    backend._tolerate_closed_ssh()
s = sshconn.SSHSocket("user@host")
s.proc = subprocess.Popen(["true"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
s.proc.wait()
try:
    s.close()
except BrokenPipeError:
    print("close raised BrokenPipeError")
s.close()
print("done")
"""


def _dead_ssh_socket() -> sshconn.SSHSocket:
    sock = sshconn.SSHSocket("user@host")
    sock.proc = subprocess.Popen(["true"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    sock.proc.wait()
    return sock


def test_the_sdks_close_raises_on_a_dead_ssh_and_the_runners_does_not() -> None:
    sdk = subprocess.run([sys.executable, "-c", CODE, "sdk"], capture_output=True, text=True, timeout=60)
    assert "close raised BrokenPipeError" in sdk.stdout  # the upstream behaviour this works around
    ours = subprocess.run([sys.executable, "-c", CODE, "runner"], capture_output=True, text=True, timeout=60)
    assert ours.returncode == 0 and ours.stdout.split() == ["done"], ours.stdout + ours.stderr
    assert "BrokenPipeError" not in ours.stderr and "Exception ignored" not in ours.stderr


def test_close_is_once_and_stops_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    sock = _dead_ssh_socket()
    backend._ssh_close(sock)
    assert sock.proc.stdin.closed
    backend._ssh_close(sock)  # a second close (the pool's, then the collector's) does nothing
    live = sshconn.SSHSocket("user@host")
    live.proc = subprocess.Popen(["sleep", "30"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    backend._ssh_close(live)
    assert live.proc.wait(10) != 0  # terminated
