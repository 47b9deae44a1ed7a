"""A profiler's Chrome trace (`trace_rank0.json.gz`, torch.profiler's export) → its memory events (pure: bytes in,
facts out).

Where no allocator snapshot can be had — vLLM-Omni's profiler records the allocator history only on CUDA-like
devices, so on a CPU it writes the trace and no `memory_snapshot_rank*.pickle` — the trace's `[memory]` instant
events are a reading of their own: each allocation or free the profiler saw, with the allocator's running total
(`Total Allocated`) on its device. That reading has no sites and sees only the thread that started the profiler
and what was allocated after it started; it is labelled as such wherever it is shown.

Untrusted input, bounded like a snapshot: the file's size, its inflated size, and the events walked.
"""

from __future__ import annotations

import gzip
import io
import json
import math
from dataclasses import dataclass
from typing import Any

MAX_FILE_BYTES = 64 * 2**20
MAX_INFLATED_BYTES = 512 * 2**20  # the stand's trace of one request: 3.9 MB gzipped, 178,459 events
MAX_EVENTS = 5_000_000
MAX_BYTES_FIGURE = 2**50  # 1 PiB: past it a figure is not one (as every memory figure of the runner)
DEVICE_TYPES = {0: "CPU", 1: "CUDA"}  # c10::DeviceType


class TraceError(ValueError):
    """A trace that cannot be read: one line saying why."""


@dataclass(frozen=True)
class TraceMemory:
    events: int  # the [memory] events read
    peak_allocated: int | None  # the highest `Total Allocated` among them (bytes); None: no event had one
    device: str  # the device their allocator is on ("CPU", "CUDA", or "device type N")


def _inflate(data: bytes) -> bytes:
    if len(data) > MAX_FILE_BYTES:
        raise TraceError(f"too large: more than {MAX_FILE_BYTES} bytes")
    if not data.startswith(b"\x1f\x8b"):
        return data
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as z:
            out = z.read(MAX_INFLATED_BYTES + 1)
    except (OSError, EOFError) as exc:
        raise TraceError(f"broken gzip: {exc}") from None
    if len(out) > MAX_INFLATED_BYTES:
        raise TraceError(f"too large: inflates past {MAX_INFLATED_BYTES} bytes")
    return out


def _figure(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or not 0 <= value < MAX_BYTES_FIGURE:
        return None
    return int(value)


def read_bytes(data: bytes) -> TraceMemory:
    """A Chrome trace's bytes (gzipped or not) → its memory events; TraceError naming why not."""
    try:
        doc = json.loads(_inflate(data))
    except (ValueError, RecursionError) as exc:
        raise TraceError(f"not JSON: {str(exc)[:80]}") from None
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        raise TraceError("not a Chrome trace: no traceEvents list")
    count, peak, types = 0, None, set()
    for event in events[:MAX_EVENTS]:
        if not isinstance(event, dict) or event.get("name") != "[memory]":
            continue
        args = event.get("args")
        if not isinstance(args, dict):
            continue
        count += 1
        total = _figure(args.get("Total Allocated"))
        if total is not None:
            peak = total if peak is None else max(peak, total)
        kind = args.get("Device Type")
        if isinstance(kind, int) and not isinstance(kind, bool):
            types.add(kind)
    device = ("unknown" if not types else
              " and ".join(DEVICE_TYPES.get(t, f"device type {t}") for t in sorted(types)[:3]))
    return TraceMemory(events=count, peak_allocated=peak, device=device)
