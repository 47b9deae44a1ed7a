"""The suite's port helper (tests/ports.py): what keeps a slow server's port from being taken before it binds."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests import ports


def ephemeral() -> range:
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return range(low, high + 1)


def test_a_picked_port_is_outside_the_range_the_kernel_hands_out() -> None:
    # bind(0) and every outgoing connection draw from that range; a port there can be gone before the server binds
    picked = [ports.free_port() for _ in range(20)]
    assert not set(picked) & set(ephemeral()), picked
    assert len(set(picked)) == 20  # never the same port twice in one worker


@pytest.mark.parametrize("workers", [1, 2, 3, 8, 25])
def test_each_worker_has_a_block_of_its_own(monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    blocks = []
    for n in range(workers):
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(workers))
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{n}")
        blocks.append(set(ports._worker_block()))
    assert all(len(b) >= 100 for b in blocks)
    assert sum(len(b) for b in blocks) == len(set().union(*blocks))  # disjoint


def test_a_port_someone_holds_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_next", iter(range(20_000, 20_010)))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 20_000))
        holder.listen()
        assert ports.free_port() == 20_001
