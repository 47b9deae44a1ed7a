"""The idle baseline taken before a server starts: device memory already in use and who holds it.

Whole-device figures (NVML, DCGM, the sidecar) include every process on the GPU, so a session's peaks
mean something only beside this baseline. A foreign holder is a reason to stop (with
`[run] require_idle_gpu`), never a process to kill.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, TypeAdapter, field_serializer, field_validator
from pydantic.dataclasses import dataclass as record

from runner.meters.base import SourceUnavailable
from runner.meters.gpu import WIRE, GpuInfo, GpuProcess, SampleSource

PREFIX = "idle-baseline:"  # the source as written in a session record and by the sidecar


@record(frozen=True, config=WIRE)
class IdleBaseline:
    """Declared once: built by the NVML meter, written into session.json and by the sidecar, read back
    (from_json) with the same declaration."""

    source: str  # "nvml", "sidecar", or "none"
    available: bool
    reason: str | None
    gpu: GpuInfo | None = None
    used_bytes: int | None = None
    reserved_bytes: int | None = None
    total_bytes: int | None = None
    # every process on the GPU before the server: all foreign
    processes: tuple[GpuProcess, ...] = Field(default=(), alias="foreign_processes")
    t: float | None = None

    @field_validator("source", mode="before")
    @classmethod
    def _unprefixed(cls, value: Any) -> Any:
        return value.removeprefix(PREFIX) if isinstance(value, str) else value

    @field_serializer("source")
    def _prefixed(self, value: str) -> str:
        return PREFIX + value

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
        return IDLE.dump_python(self, mode="json", by_alias=True)

    @classmethod
    def from_json(cls, data: str | bytes | dict[str, Any]) -> IdleBaseline:
        """A baseline as JSON (the sidecar's /idle, or a session record's idle_baseline): strict JSON types; a
        pydantic ValidationError (a ValueError) names the field otherwise."""
        return IDLE.validate_json(data if isinstance(data, (str, bytes)) else json.dumps(data), strict=True)


IDLE: TypeAdapter[IdleBaseline] = TypeAdapter(IdleBaseline)


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
