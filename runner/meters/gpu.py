"""What a GPU memory source yields, and the sources that need no GPU (replay, manual) for tests and demos.

The NVML source (runner.meters.nvml) and these fakes share one small protocol, so the sidecar and the
NVML meter can be exercised end to end on a machine without a driver.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pydantic import ConfigDict, TypeAdapter
from pydantic.dataclasses import dataclass as record

# What a GPU host tells (the sidecar's /idle): declared once, validated as it is read (runner.meters.idle); a newer
# sidecar's extra keys are ignored, a wrong type is refused.
WIRE = ConfigDict(populate_by_name=True, extra="ignore")


@record(frozen=True, config=WIRE)
class GpuInfo:
    index: int | None
    uuid: str | None
    name: str | None
    driver: str | None
    total_bytes: int | None
    requested: str | None  # card.gpu as written (index or UUID)

    def to_json(self) -> dict[str, Any]:
        return GPU_INFO.dump_python(self, mode="json")


@dataclass(frozen=True)
class MemorySample:
    t: float  # epoch seconds on the sampling host
    used: int  # bytes; NVML v2 `used` (excludes driver-reserved memory)
    reserved: int | None  # bytes reserved by the driver (v2), None when the source has no such figure
    total: int | None


@record(frozen=True, config=WIRE)
class GpuProcess:
    pid: int  # host PID (the driver ignores PID namespaces)
    used_bytes: int | None  # None where the driver does not say (WDDM, some containers)
    kind: str  # "compute" or "graphics"
    name: str | None = None

    def to_json(self) -> dict[str, Any]:
        return GPU_PROCESS.dump_python(self, mode="json")


# Built once (an adapter compiles its validator): the serialisation of the two declarations above.
GPU_INFO: TypeAdapter[GpuInfo] = TypeAdapter(GpuInfo)
GPU_PROCESS: TypeAdapter[GpuProcess] = TypeAdapter(GpuProcess)


class SampleSource(Protocol):
    def info(self) -> GpuInfo: ...

    def sample(self) -> MemorySample:
        """Raise runner.meters.base.SourceUnavailable when there is no reading."""
        ...

    def processes(self) -> tuple[GpuProcess, ...]: ...


class ManualSource:
    """A source whose value the caller sets: deterministic tests of peak semantics."""

    def __init__(self, used: int = 0, reserved: int | None = 0, total: int = 80 << 30) -> None:
        self._lock = threading.Lock()
        self._used, self._reserved, self._total = used, reserved, total
        self.reads = 0
        self.procs: tuple[GpuProcess, ...] = ()

    def set(self, used: int) -> None:
        with self._lock:
            self._used = used

    def info(self) -> GpuInfo:
        return GpuInfo(0, "GPU-00000000-0000-0000-0000-000000000000", "manual", None, self._total, "0")

    def sample(self) -> MemorySample:
        with self._lock:
            self.reads += 1
            return MemorySample(time.time(), self._used, self._reserved, self._total)

    def processes(self) -> tuple[GpuProcess, ...]:
        return self.procs


class ReplaySource:
    """Replays a recorded series: lines `offset_s used_bytes [reserved_bytes]` ('#' starts a comment).

    The value at elapsed time e is the last line with offset <= e; after the last line it holds (or, with
    loop=True, starts over)."""

    def __init__(self, path: Path, *, loop: bool = False, total: int | None = None) -> None:
        offsets, used, reserved = [], [], []
        for line in Path(path).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.replace(",", " ").split()
            offsets.append(float(parts[0]))
            used.append(int(float(parts[1])))
            reserved.append(int(float(parts[2])) if len(parts) > 2 else None)
        if not offsets:
            raise ValueError(f"{path}: no samples")
        self.path, self.loop, self._total = Path(path), loop, total
        self._off, self._used, self._reserved = offsets, used, reserved
        self._t0 = time.monotonic()

    def info(self) -> GpuInfo:
        return GpuInfo(0, "GPU-REPLAY-" + self.path.stem, f"replay:{self.path.name}", None, self._total, "0")

    def sample(self) -> MemorySample:
        elapsed = time.monotonic() - self._t0
        if self.loop and self._off[-1] > 0:
            elapsed %= self._off[-1]
        i = max(0, bisect_right(self._off, elapsed) - 1)
        return MemorySample(time.time(), self._used[i], self._reserved[i], self._total)

    def processes(self) -> tuple[GpuProcess, ...]:
        return ()
