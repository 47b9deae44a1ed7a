"""One validation for every memory figure a meter or a server reports, before it is kept.

Prometheus answers `NaN` and `+Inf` as valid values, exporters send strings and wrong shapes, a broken
gauge says -5000 MiB or 2^64 bytes. A figure that is not a finite, non-negative number of bytes below
MAX_BYTES is not a reading: the meter records that sample as failed (with this reason) — it never becomes a
peak, and it never reaches the sample arrays (whose int64 columns would overflow at 2^63).
"""

from __future__ import annotations

import math

MAX_BYTES = 2**50  # 1 PiB: far above any device or host; larger is a broken exporter, never memory


class BadReading(ValueError):
    """The figure is not a memory reading; the message says why (quoted, short)."""


def _show(value: object) -> str:
    text = repr(value)  # repr escapes control characters: the reason is inert wherever it is shown
    return text if len(text) <= 40 else text[:37] + "..."


def number(value: object, what: str) -> float:
    """A finite, non-negative number (int or float, not bool, not a string), else BadReading."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadReading(f"{what}: {_show(value)} is not a number")
    if isinstance(value, float) and not math.isfinite(value):
        raise BadReading(f"{what}: {_show(value)} is not a finite number")
    if value < 0:
        raise BadReading(f"{what}: {_show(value)} is negative")
    return float(value) if isinstance(value, float) else value


def to_bytes(value: object, what: str, scale: int = 1) -> int:
    """A figure in units of `scale` bytes (1: bytes, 2**20: MiB) → bytes, validated (see module doc)."""
    v = number(value, what)
    if v * scale >= MAX_BYTES:
        raise BadReading(f"{what}: {_show(value)} × {scale} bytes is beyond any memory (≥ 1 PiB)")
    return round(v * scale)
