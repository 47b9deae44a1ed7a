"""Ports for the servers the tests start: free, and kept free until the server binds them.

A port from bind(("127.0.0.1", 0)) lies in the kernel's ephemeral range, the range every outgoing connection of
the suite also takes its local port from. A server that imports for 15-100 s before it binds (vLLM-Omni, torch)
loses such a port now and then: CI's run of 2026-12-07 had the real server exit with `[Errno 98] Address already
in use`. So the tests pick below (or above) that range, where the kernel hands out nothing, each pytest-xdist
worker in a block of its own, and never the same port twice in one worker. The runner itself picks with bind(0)
and starts again on a lost port (runner.backends.base.PortLost); these helpers start servers without it.
"""

from __future__ import annotations

import itertools
import os
import socket
from pathlib import Path

from runner.backends.local import HOST, port_busy

LOWEST = 10_000  # above the well-known and registered services a test machine runs (Prometheus 9090, dcgm 9400)


def _outside_ephemeral() -> range:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32_768, 60_999  # Linux's default
    below, above = range(LOWEST, max(LOWEST, low)), range(max(LOWEST, high + 1), 65_536)
    return max(below, above, key=len)


def _worker_block() -> range:
    span = _outside_ephemeral()
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    size = len(span) // workers
    return span[worker * size:(worker + 1) * size]


_BLOCK = _worker_block()
_next = itertools.cycle(_BLOCK)


def free_port() -> int:
    """A port on 127.0.0.1 nothing listens on, outside the ephemeral range where the machine allows it."""
    for _ in range(len(_BLOCK)):
        port = next(_next)
        if port_busy(HOST, port) is None:
            return port
    with socket.socket() as s:  # no room outside the ephemeral range, or all of it taken: the kernel's pick
        s.bind((HOST, 0))
        return int(s.getsockname()[1])
