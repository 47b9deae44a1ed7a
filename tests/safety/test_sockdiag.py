"""The kernel's list of TCP listeners (runner/backends/sockdiag.py), which the local backend asks before every
readiness probe: listeners of IPv4 and IPv6, and nothing that only binds; where the kernel cannot be asked, the
full scan answers the same."""

from __future__ import annotations

import socket

import pytest

from runner.backends import sockdiag
from runner.backends.local import _anyone_listens


def _bound(family: int, host: str, listen: bool) -> socket.socket:
    s = socket.socket(family)
    s.bind((host, 0))
    if listen:
        s.listen()
    return s


def test_listeners_of_both_families_are_seen_and_a_bound_socket_is_not() -> None:
    if sockdiag.tcp_listening_ports() is None:
        pytest.skip("this kernel answers no sock_diag dump")
    v4, v6 = _bound(socket.AF_INET, "127.0.0.1", True), _bound(socket.AF_INET6, "::1", True)
    quiet = _bound(socket.AF_INET, "127.0.0.1", False)  # bound, never listening: a closed door, not a server
    try:
        ports = sockdiag.tcp_listening_ports()
        assert ports is not None
        listening = {s.getsockname()[1] for s in (v4, v6)}
        assert listening <= ports and quiet.getsockname()[1] not in ports
        assert all(_anyone_listens(p) for p in listening) and not _anyone_listens(quiet.getsockname()[1])
    finally:
        for s in (v4, v6, quiet):
            s.close()
    assert not any(_anyone_listens(p) for p in listening)  # closed: gone from the kernel's list at once


def test_without_sock_diag_the_full_scan_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sockdiag, "tcp_listening_ports", lambda: None)
    server, quiet = _bound(socket.AF_INET, "127.0.0.1", True), _bound(socket.AF_INET, "127.0.0.1", False)
    try:
        assert _anyone_listens(server.getsockname()[1]) and not _anyone_listens(quiet.getsockname()[1])
    finally:
        server.close()
        quiet.close()
