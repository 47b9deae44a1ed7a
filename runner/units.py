"""Byte formatting that stays readable from a tiny CPU emulation (MiB) to a real card (GiB)."""

from __future__ import annotations

MIB, GIB = 2**20, 2**30


def unit_for(max_bytes: float) -> tuple[float, str]:
    return (GIB, "GiB") if max_bytes >= GIB else (MIB, "MiB")


def fmt_bytes(value: float | None) -> str:
    if value is None:
        return "?"
    div, name = unit_for(value)
    return f"{value / div:.2f} {name}"
