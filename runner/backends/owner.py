"""Who owns a server: this runner process (host, PID, process start time), written into every container's
labels and into a record per local server, so that cleanup touches only what a dead runner left.

A PID alone is not an identity (PIDs are reused); a PID with its start time is. A runner on another host
cannot be checked from here, so its servers are never reaped.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from functools import cache

import psutil

HOST, PID, STARTED = "runner.owner.host", "runner.owner.pid", "runner.owner.started"


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    started: float  # psutil create_time of the runner process

    def labels(self) -> dict[str, str]:
        return {HOST: self.host, PID: str(self.pid), STARTED: f"{self.started:.3f}"}


@cache
def me() -> Owner:
    return Owner(socket.gethostname(), os.getpid(), psutil.Process().create_time())


def process_alive(pid: int, started: float) -> bool:
    """True when PID runs and is the process that started at `started` (not a reuse of its number)."""
    try:
        return abs(psutil.Process(pid).create_time() - started) < 0.01
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.Error:
        return True  # cannot tell: assume alive, never reap what might be live


def from_labels(labels: dict[str, str]) -> Owner | None:
    try:
        return Owner(labels[HOST], int(labels[PID]), float(labels[STARTED]))
    except (KeyError, ValueError):
        return None


def owner_state(labels: dict[str, str]) -> tuple[bool, str]:
    """(dead, why) for a managed container or server record: only a provably dead owner may be reaped."""
    owner = from_labels(labels)
    if owner is None:
        return False, "kept: no owner labels (an older runner's container; remove it by hand if it is stale)"
    if owner == me():
        return False, "kept: this run's own"
    if owner.host != me().host:
        return False, f"kept: owned by a runner on host {owner.host}, which cannot be checked from here"
    if process_alive(owner.pid, owner.started):
        return False, f"kept: its runner (PID {owner.pid}) is still running"
    return True, f"its runner (PID {owner.pid} on {owner.host}) is gone"
