"""Who owns a server: this runner process (host, boot, PID, process start), written into every container's
labels and into a record per local server, so that cleanup touches only what a dead runner left.

A PID alone is not an identity (PIDs are reused); a PID with its start is. The start is kept as seconds
after boot (the kernel's own tick count, /proc/PID/stat), not as a wall-clock time: psutil's create_time is
that count plus the boot time recomputed from the current clock, so any clock adjustment (NTP, a VM's
host) moves it, and one runner then took another's live servers for orphans and killed them. The boot id
tells a count from an earlier boot. A runner on another host cannot be checked from here, so its servers
are never reaped.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import psutil

# The start labels are new keys (not the wall-clock `runner.owner.started` of earlier runners): an older
# runner's labels read as no owner, so they are kept, never compared across the two clocks.
HOST, BOOT, PID, STARTED = "runner.owner.host", "runner.owner.boot", "runner.owner.pid", "runner.owner.since_boot"
_PROC = Path("/proc")
SAME_START_S = 0.015  # two readings of one process's start differ by less: a clock tick and the labels' rounding


@dataclass(frozen=True)
class Owner:
    host: str
    boot: str  # the kernel's boot id ("" where the platform has none)
    pid: int
    started: float  # seconds after boot that the runner process started (wall clock where no /proc)

    def labels(self) -> dict[str, str]:
        return {HOST: self.host, BOOT: self.boot, PID: str(self.pid), STARTED: f"{self.started:.2f}"}


@cache
def boot_id() -> str:
    try:
        return (_PROC / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@cache
def _has_proc() -> bool:
    return (_PROC / "self/stat").exists()


def started(pid: int) -> float:
    """When process PID started, in seconds after boot: fixed for the process's life, whatever the clock does.
    Without /proc, psutil's (wall-clock) create_time. Every failure is a psutil.Error, as psutil's own:
    NoSuchProcess when PID is gone, another kind when its start cannot be read."""
    if not _has_proc():
        return psutil.Process(pid).create_time()
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        raise psutil.NoSuchProcess(pid) from None
    except OSError as exc:
        raise psutil.AccessDenied(pid) from exc
    try:  # field 22 (starttime, in clock ticks); the fields after the command's closing parenthesis start at 3
        return int(stat.rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    except (IndexError, ValueError) as exc:
        raise psutil.Error(f"/proc/{pid}/stat has no start time") from exc


@cache
def me() -> Owner:
    return Owner(socket.gethostname(), boot_id(), os.getpid(), started(os.getpid()))


def process_alive(pid: int, since_boot: float) -> bool:
    """True when PID runs and is the process that started at `since_boot` (not a reuse of its number)."""
    try:
        return abs(started(pid) - since_boot) < SAME_START_S
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # cannot tell: assume alive, never reap what might be live


def from_labels(labels: dict[str, str]) -> Owner | None:
    try:
        return Owner(labels[HOST], labels[BOOT], int(labels[PID]), float(labels[STARTED]))
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
    if owner.boot != me().boot:
        if owner.boot and me().boot:
            return True, f"its runner (PID {owner.pid} on {owner.host}) is gone: the machine has restarted since"
        return False, "kept: the owner's boot cannot be compared with this one"
    if process_alive(owner.pid, owner.started):
        return False, f"kept: its runner (PID {owner.pid}) is still running"
    return True, f"its runner (PID {owner.pid} on {owner.host}) is gone"
