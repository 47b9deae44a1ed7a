"""A profiler's Chrome trace (`trace_rank0.json.gz`, torch.profiler's export) → its memory events (pure: bytes in,
facts out).

Where no allocator snapshot can be had — vLLM-Omni's profiler records the allocator history only on CUDA-like
devices, so on a CPU it writes the trace and no `memory_snapshot_rank*.pickle` — the trace's `[memory]` instant
events are a reading of their own: each allocation or free the profiler saw, with the allocator's running total
(`Total Allocated`) on its device. That reading has no sites and sees only the thread that started the profiler
and what was allocated after it started; it is labelled as such wherever it is shown.

Untrusted input, bounded like a snapshot: the file opened as runner.observe.server_file opens one and read in
the bounded child of runner.observe.isolated (a JSON of nested arrays builds as much as a pickle does); its
size, its inflated size (the bounded gunzip), the events walked; each figure validated as every memory figure
is (observe/reading.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass

from runner.observe.reading import BadReading, to_bytes
from runner.observe.snapshot import gunzipped

MAX_FILE_BYTES = 64 * 2**20
MAX_INFLATED_BYTES = 512 * 2**20  # the stand's trace of one request: 3.9 MB gzipped, 178,459 events
MAX_EVENTS = 5_000_000
DEVICE_TYPES = {0: "CPU", 1: "CUDA"}  # c10::DeviceType


class TraceError(ValueError):
    """A trace that cannot be read: one line saying why."""


@dataclass(frozen=True)
class TraceMemory:
    events: int  # the [memory] events read
    peak_allocated: int | None  # the highest `Total Allocated` among them (bytes); None: no event had one
    device: str  # the device their allocator is on ("CPU", "CUDA", or "device type N")


def read_bytes(data: bytes) -> TraceMemory:
    """A Chrome trace's bytes (gzipped or not) → its memory events; TraceError naming why not."""
    if len(data) > MAX_FILE_BYTES:
        raise TraceError(f"too large: more than {MAX_FILE_BYTES} bytes")
    try:
        doc = json.loads(gunzipped(data, MAX_INFLATED_BYTES, TraceError))
    except TraceError:
        raise
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
        with contextlib.suppress(BadReading):  # a figure that is no reading (reading.py) is left out
            total = to_bytes(args.get("Total Allocated"), "Total Allocated")
            peak = total if peak is None else max(peak, total)
        kind = args.get("Device Type")
        if isinstance(kind, int) and not isinstance(kind, bool):
            types.add(kind)
    device = ("unknown" if not types else
              " and ".join(DEVICE_TYPES.get(t, f"device type {t}") for t in sorted(types)[:3]))
    return TraceMemory(events=count, peak_allocated=peak, device=device)


def read_json(data: bytes) -> dict[str, object]:
    """read_bytes for the isolated reader (runner.observe.isolated): bytes in, JSON out."""
    return dataclasses.asdict(read_bytes(data))
