"""Fixtures: reference servers started as real subprocesses on free 127.0.0.1 ports.

All standard servers are spawned at once (the first time any is needed) so their start-up overlaps;
each fixture then waits for its own /health.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from refserver_helpers import Server

FLEET = {
    "device": ["--cond-cache", "device"],
    "host": ["--cond-cache", "host"],
    "off": ["--cond-cache", "off"],
    "int8": ["--quantization", "int8"],
    "faults": ["--fault", "malformed-json@1", "--fault", "no-image@2", "--fault", "wrong-size@3",
               "--fault", "transparent@4", "--fault", "grey@5", "--fault", "hang@6"],
    "exit": ["--fault", "exit@2"],
    "load_oom": ["--vram-gib", "0.001"],
    "load_fail": ["--fault", "load-fail"],
    "legacy": ["--api", "2025-12"],  # the Dec-2025 snapshot's behaviour
    "omni": ["qwen-image", "--omni", "--enforce-eager", "--log-stats", "--max-refs", "3"],  # vLLM-Omni's CLI
}


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("refserver-logs")


@pytest.fixture(scope="session")
def fleet(log_dir: Path) -> Iterator[dict[str, Server]]:
    servers = {name: Server(name, args, log_dir) for name, args in FLEET.items()}
    yield servers
    for s in servers.values():
        s.stop()


@pytest.fixture(scope="session")
def launch(log_dir: Path) -> Iterator[Any]:
    """Starts extra servers on demand; all are stopped at the end of the session."""
    started: list[Server] = []

    def start(name: str, *args: str) -> Server:
        s = Server(name, list(args), log_dir)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def device_server(fleet: dict[str, Server]) -> Server:
    return fleet["device"].ready()


