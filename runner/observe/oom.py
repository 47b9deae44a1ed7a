"""PyTorch's CUDA out-of-memory message → numbers (pure).

The wordings this reads (each field is looked for on its own, so a shortened or older message yields the
fields it has and leaves the others absent):
- torch ≥ 2.2: "CUDA out of memory. Tried to allocate 480.00 MiB. GPU 0 has a total capacity of 139.80 GiB
  of which 134.92 GiB is free. Including non-PyTorch memory, this process has 4.87 GiB memory in use.
  [4.49 GiB allowed; ]Of the allocated memory 3.96 GiB is allocated by PyTorch, and 246.14 MiB is reserved
  by PyTorch but unallocated. If reserved but unallocated memory is large try setting
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True …" ("allowed" appears under a memory-fraction cap);
- torch 2.1: the same with "total capacty" and "Process 1234 has … memory in use" (one such clause per
  process on the GPU: which one is this process is not said, so in-use stays absent unless "this process"
  is named);
- torch < 2.1: "CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total capacity; 130.35 MiB
  already allocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch)": reserved-but-unallocated is
  derived as reserved in total minus already allocated;
- vLLM-Omni's HTTP 500 bodies ("Image generation failed: CUDA out of memory. Tried to allocate …"), the
  message cut or split over several log lines (a worker-process prefix on each).
"""

from __future__ import annotations

import math
import re

from runner.core.records import OomReport
from runner.observe.reading import MAX_BYTES
from runner.observe.traceback import SERVER_PACKAGES, last_chain, oom_traceback, site_of, strip_prefix

# A figure with its sign and exponent (a hostile or broken message may write "-2.00 GiB" or "1e30 GiB": read
# as 2 or 30 GiB they would be figures the message never gave), never the tail of a longer token.
SIZE = r"(?<![\w.])([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)\s*(bytes|KiB|MiB|GiB|TiB|B|KB|MB|GB|TB)\b"
UNITS = {"bytes": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
         "kb": 2**10, "mb": 2**20, "gb": 2**30, "tb": 2**40}  # torch's "MB" (< 1.10) meant MiB too
START = re.compile(r"CUDA out of memory|OutOfMemoryError|out of memory", re.IGNORECASE)
MESSAGE_LIMIT = 1000

FIELDS: dict[str, tuple[re.Pattern[str], ...]] = {
    "tried_bytes": (re.compile(r"Tried to allocate " + SIZE, re.I),),
    "capacity_bytes": (re.compile(r"total capac(?:i)?ty of " + SIZE, re.I),
                       re.compile(SIZE + r" total capacity", re.I)),
    "free_bytes": (re.compile(r"of which " + SIZE + r" is free", re.I), re.compile(r";\s*" + SIZE + r" free\b", re.I)),
    "in_use_bytes": (re.compile(r"this process has " + SIZE + r" memory in use", re.I),),
    "allowed_bytes": (re.compile(SIZE + r" allowed\s*;", re.I),),
    "allocated_bytes": (re.compile(SIZE + r" is allocated by PyTorch", re.I),
                        re.compile(SIZE + r" already allocated", re.I)),
    "reserved_unallocated_bytes": (re.compile(SIZE + r" is reserved by PyTorch but unallocated", re.I),),
}
RESERVED_TOTAL = re.compile(SIZE + r" reserved in total by PyTorch", re.I)


def to_bytes(number: str, unit: str) -> int | None:
    """A figure of the message in bytes; None (absent, like a field the message lacks) for one no device can
    have: negative, not finite (a 400-digit number is infinite as a float), or at or beyond 1 PiB."""
    value = float(number) * UNITS[unit.lower()]
    if not math.isfinite(value) or value < 0 or value >= MAX_BYTES:
        return None
    return round(value)


def _first(patterns: tuple[re.Pattern[str], ...], text: str) -> int | None:
    for pattern in patterns:
        if m := pattern.search(text):
            return to_bytes(m.group(1), m.group(2))
    return None


def _valid(found: dict[str, int | None]) -> dict[str, int | None]:
    """A capacity or a cap of 0 bytes is none a device has: absent (it would make every peak a shortfall)."""
    return {k: None if k in ("capacity_bytes", "allowed_bytes") and v == 0 else v for k, v in found.items()}


def last_message(text: str) -> str | None:
    """The last OOM message in a text, its lines joined without worker prefixes (vLLM splits the message
    over lines), from its start up to the next OOM message or MESSAGE_LIMIT characters."""
    lines = [strip_prefix(line).strip() for line in text.splitlines()]
    joined = " ".join(line for line in lines if line)
    starts = [m.start() for m in START.finditer(joined)]
    if not starts:
        return None
    # "torch.OutOfMemoryError: CUDA out of memory": one message, two matches; start at the last message's
    # first match (a match within 40 characters of the one before belongs to it)
    begin = starts[-1]
    for s in reversed(starts[:-1]):
        if begin - s > 40:
            break
        begin = s
    while begin > 0 and (joined[begin - 1].isalnum() or joined[begin - 1] in "._"):  # torch.OutOfMemoryError
        begin -= 1
    return joined[begin:begin + MESSAGE_LIMIT]


def parse_message(message: str) -> dict[str, int | None]:
    """The numbers in one OOM message; None for each one it does not carry."""
    found = {name: _first(patterns, message) for name, patterns in FIELDS.items()}
    allocated = found["allocated_bytes"]
    m = RESERVED_TOTAL.search(message)  # torch < 2.1: reserved in total, not its unallocated part
    total = to_bytes(m.group(1), m.group(2)) if m else None
    if found["reserved_unallocated_bytes"] is None and allocated is not None and total is not None:
        found["reserved_unallocated_bytes"] = max(total - allocated, 0)
    return _valid(found)


def read_oom(*, body: str = "", log: str = "", own: tuple[str, ...] = SERVER_PACKAGES, ended: bool = False
             ) -> OomReport | None:
    """An OOM's numbers and site from what the runner saw: the server log of the window (the full message and
    the traceback) and the response body (often a shortened message). Each field comes from the log where it
    has it, else from the body. None when neither has an OOM message.

    `ended`: the log is of a process that ended (a failed start). An OOM a library swallowed has no traceback
    of its own (safetensors turned vLLM-Omni's load OOM into `OSError: Unable to load weights…`): its site is
    then read from the chain the process ended with, from its root — the first link with a server frame —
    since those frames lead to where the swallowed OOM was raised."""
    from_log, from_body = last_message(log), last_message(body)
    if from_log is None and from_body is None:
        return None
    fields: dict[str, int | None] = {k: None for k in FIELDS}
    for message in (from_body, from_log):  # the log wins where both carry a field
        if message is not None:
            fields.update({k: v for k, v in parse_message(message).items() if v is not None})
    found = oom_traceback(log)
    if found is not None:
        site, function, frames, no_site = site_of(found[0], own)
    else:
        sited = [x for link in (last_chain(log) if ended else []) if (x := site_of(link[0], own))[0] is not None]
        site, function, frames, no_site = sited[0] if sited else (
            None, None, (), "no traceback in the server log of the window")
    return OomReport(message=from_log or from_body or "", source="server log" if from_log else "response body",
                     site=site, function=function, frames=frames, no_site=no_site, **fields)
