"""Formatting shared by console, report and plots: bytes readable from a tiny CPU emulation (MiB) to a real card
(GiB), seconds with one precision, text shortened without cutting a number from its unit, names made safe for
folders and containers."""

from __future__ import annotations

import re

MIB, GIB = 2**20, 2**30
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def slug(text: str) -> str:
    """A folder, run id or container name from any text: runs of other characters become one '-'."""
    return _UNSAFE.sub("-", text)


def unit_for(max_bytes: float) -> tuple[float, str]:
    return (GIB, "GiB") if max_bytes >= GIB else (MIB, "MiB")


def fmt_bytes(value: float | None) -> str:
    if value is None:
        return "?"
    div, name = unit_for(value)
    return f"{value / div:.2f} {name}"


def fmt_s(seconds: float | None) -> str:
    """Seconds with the same two decimals everywhere (console, report, plots)."""
    return "?" if seconds is None else f"{seconds:.2f}"


def refs_text(n: int | None) -> str:
    """A reference count in words, as every surface writes it: "1 ref", "3 refs"; None is a load (no request)."""
    return "load" if n is None else f"{n} ref" if n == 1 else f"{n} refs"


def clip(text: str, limit: int) -> str:
    """Shorten at a sentence end (else a word boundary), never mid-number: "capacity of 7.75 " is wrong."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    head = text[:limit]
    cut = head.rfind(". ") + 1  # keep whole sentences where one ends in the second half
    if cut < limit // 2:
        words = head[: head.rfind(" ")].split(" ") if " " in head else [head]
        while len(words) > 1 and re.fullmatch(r"[\d.,]+", words[-1]):  # a number without its unit misleads
            words.pop()
        return " ".join(words).rstrip() + " …"
    return head[:cut] + " …"
