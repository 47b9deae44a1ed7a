"""The idle baseline taken before a server starts: device memory already in use and who holds it.

Whole-device figures (NVML, DCGM, the sidecar) include every process on the GPU, so a session's peaks
mean something only beside this baseline. A foreign holder is a reason to stop (with
`[run] require_idle_gpu`), never a process to kill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runner.meters.base import SourceUnavailable
from runner.meters.gpu import GpuInfo, GpuProcess, SampleSource


@dataclass(frozen=True)
class IdleBaseline:
    source: str  # "nvml", "sidecar", or "none"
    available: bool
    reason: str | None
    gpu: GpuInfo | None = None
    used_bytes: int | None = None
    reserved_bytes: int | None = None
    total_bytes: int | None = None
    processes: tuple[GpuProcess, ...] = ()  # every process on the GPU before the server: all foreign
    t: float | None = None

    @property
    def foreign(self) -> tuple[GpuProcess, ...]:
        return self.processes

    def stop_reason(self, require_idle: bool) -> str | None:
        """Why the session must not start, or None. Only asked for with `[run] require_idle_gpu`."""
        if not require_idle:
            return None
        if not self.available:
            return f"require_idle_gpu: cannot verify the GPU is idle ({self.reason})"
        if self.processes:
            held = ", ".join(f"pid {p.pid} ({p.name or '?'}, {p.kind}, "
                             f"{'?' if p.used_bytes is None else f'{p.used_bytes / 2**20:.0f} MiB'})"
                             for p in self.processes)
            return f"require_idle_gpu: the GPU is held by {len(self.processes)} other process(es): {held}"
        return None

    def to_json(self) -> dict[str, Any]:
        return {"source": f"idle-baseline:{self.source}", "available": self.available, "reason": self.reason,
                "gpu": self.gpu.to_json() if self.gpu else None, "used_bytes": self.used_bytes,
                "reserved_bytes": self.reserved_bytes, "total_bytes": self.total_bytes,
                "foreign_processes": [p.to_json() for p in self.processes], "t": self.t}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> IdleBaseline:
        gpu = GpuInfo(**d["gpu"]) if d.get("gpu") else None
        procs = tuple(GpuProcess(**p) for p in d.get("foreign_processes", ()))
        return cls(d["source"].removeprefix("idle-baseline:"), d["available"], d.get("reason"), gpu,
                   d.get("used_bytes"), d.get("reserved_bytes"), d.get("total_bytes"), procs, d.get("t"))


def measure_idle(source: SampleSource, name: str) -> IdleBaseline:
    """One reading of a source (NVML here, or the sidecar's own source on the GPU host)."""
    try:
        s = source.sample()
        procs = source.processes()
    except SourceUnavailable as exc:
        return IdleBaseline(name, False, str(exc), source.info())
    return IdleBaseline(name, True, None, source.info(), s.used, s.reserved, s.total, procs, s.t)


def idle_baseline(card: Any) -> IdleBaseline:
    """The baseline for a card, from the first of its meters (in the card's order) whose registry entry can
    see the whole device's processes (`idle`: NVML on this host, the sidecar on the GPU's host), else the
    first one's reason; unavailable with the reason when the card lists none."""
    from runner.core.registry import METERS, load

    tried = []
    for name in card.meters:
        entry = METERS.get(name) if name in METERS else None
        if entry is None or entry.idle is None or (entry.options is not None and name not in card.meter_options):
            continue
        baseline: IdleBaseline = load(entry.idle)(card)
        if baseline.available:
            return baseline
        tried.append(baseline)
    if tried:
        return tried[0]
    able = " or ".join(e.name for e in METERS.entries() if e.idle)
    return IdleBaseline("none", False, f"no meter that sees the device's processes ({able}) on this card")
