"""Reconcile one window's peaks from several sources into a small table the report can print.

Sampling can only miss a peak, never invent one, so among whole-device sources the one that samples
fastest is the reference ("best"); the others are shown as a delta against it. Server-reported figures
measure something else (PyTorch's allocator, without the CUDA context), so their delta is expected to be
negative and is labelled so rather than read as a miss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from runner.core.records import Peak
from runner.core.registry import METERS

MISS_TOLERANCE = 0.02  # a whole-device source this far below the best probably missed the peak


@dataclass(frozen=True)
class ReconRow:
    source: str
    bytes: int | None
    samples: int
    rate_hz: float | None
    available: bool
    reason: str | None
    delta_bytes: int | None  # bytes − best bytes (None when either is unknown)
    delta_pct: float | None
    best: bool
    note: str | None


def _whole_device(source: str) -> bool:
    return source in METERS and METERS.get(source).whole_device


def _rank(p: Peak) -> tuple[float, int]:
    """Faster first; among equally fast sources the registry's rank (closest to the GPU first)."""
    order = METERS.get(p.source).rank if p.source in METERS else len(METERS.names())
    return (-(p.rate_hz or 0.0), order)


def reconcile(peaks: Sequence[Peak], metric: str = "device", prefer: str | None = None) -> tuple[ReconRow, ...]:
    """One row per source of `metric`, best first, then the other available ones, then the unavailable.

    best = `prefer` when it is available, else the available whole-device source with the highest sample
    rate (ties: the registry's rank), else any available source."""
    mine = [p for p in peaks if p.metric == metric]
    avail = [p for p in mine if p.available and p.bytes is not None]
    best = next((p for p in avail if p.source == prefer), None)
    if best is None:
        whole = sorted((p for p in avail if _whole_device(p.source)), key=_rank)
        best = whole[0] if whole else (sorted(avail, key=_rank)[0] if avail else None)
    rows = []
    for p in sorted(mine, key=lambda p: (p is not best, not (p.available and p.bytes is not None), _rank(p))):
        delta = pct = note = None
        if best is not None and p.bytes is not None and p.available:
            delta = p.bytes - (best.bytes or 0)
            pct = round(100.0 * delta / best.bytes, 2) if best.bytes else None
            if p is not best:
                if not _whole_device(p.source):
                    note = "process-level figure: excludes the CUDA context and other processes"
                elif best.bytes and delta < -MISS_TOLERANCE * best.bytes:
                    note = f"below the best by {-delta / 2**20:.0f} MiB: likely missed the peak (samples too sparse)"
                elif delta > 0:
                    note = "above a faster source: it covered a wider window (edge slack or settle time)"
        if p.reason and p.available:
            note = f"{note}; {p.reason}" if note else p.reason
        rows.append(ReconRow(p.source, p.bytes, p.samples, p.rate_hz, p.available,
                             None if p.available else p.reason, delta, pct, p is best, note))
    return tuple(rows)


def render(rows: Sequence[ReconRow]) -> str:
    """A markdown table (MiB) for report.md."""
    out = ["| source | peak MiB | samples | rate Hz | Δ vs best MiB | note |", "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        mib = "—" if r.bytes is None else f"{r.bytes / 2**20:.0f}"
        delta = "best" if r.best else ("—" if r.delta_bytes is None else f"{r.delta_bytes / 2**20:+.0f}")
        note = r.note if r.available else f"unavailable: {r.reason}"
        rate = "—" if r.rate_hz is None else f"{r.rate_hz:g}"
        out.append(f"| {r.source} | {mib} | {r.samples} | {rate} | {delta} | {note or ''} |")
    return "\n".join(out)
