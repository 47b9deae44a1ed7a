"""Memory meters: each samples one source into a Series and answers window peaks with provenance.

A source that cannot be read is *unavailable with a reason*, never a zero (a silent 0 once hid a real
regression in vLLM-Omni's perf CI).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from array import array
from dataclasses import dataclass
from typing import Any

from runner.records import Peak


class SourceUnavailable(Exception):
    """read() could not get a figure; the message is the reason recorded."""


@dataclass(frozen=True)
class Series:
    source: str
    metric: str  # "device" or "host"
    t: tuple[float, ...]  # epoch seconds
    value: tuple[int, ...]  # bytes


class Meter(ABC):
    source: str = "?"
    metric: str = "device"

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def stop(self) -> None: ...

    @abstractmethod
    def series(self) -> Series: ...

    @abstractmethod
    def window_peak(self, t0: float, t1: float) -> Peak: ...

    @abstractmethod
    def provenance(self) -> dict[str, Any]: ...

    def latest(self) -> int | None:
        """The newest reading, for live display; None when there is none."""
        return None


def peak_of(series: Series, t0: float, t1: float, *, reason_if_empty: str) -> Peak:
    """The maximum of the samples taken in [t0, t1], with how many there were and at what rate."""
    values = [v for t, v in zip(series.t, series.value, strict=True) if t0 <= t <= t1]
    span = max(t1 - t0, 1e-9)
    if not values:
        return Peak(series.source, series.metric, None, 0, None, False, reason_if_empty)
    return Peak(series.source, series.metric, max(values), len(values), round(len(values) / span, 2), True)


class PolledMeter(Meter):
    """Calls read() every 1/hz seconds in a daemon thread; keeps (t, bytes) in compact arrays."""

    def __init__(self, source: str, metric: str, hz: float) -> None:
        self.source, self.metric, self.hz = source, metric, hz
        self._t: array[float] = array("d")
        self._v: array[int] = array("q")
        self._errors = 0
        self._last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started_at: float | None = None
        self._lock = threading.Lock()

    @abstractmethod
    def read(self) -> int:
        """Bytes now; raise SourceUnavailable(reason) when there is no reading."""

    def start(self) -> None:
        self._started_at = time.time()
        self._thread = threading.Thread(target=self._loop, name=f"meter-{self.source}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        period = 1.0 / self.hz
        next_t = time.monotonic()
        while not self._stop.is_set():
            try:
                value = self.read()
            except SourceUnavailable as exc:
                self._errors += 1
                self._last_error = str(exc)
            except Exception as exc:  # a meter must never take the run down
                self._errors += 1
                self._last_error = f"{type(exc).__name__}: {exc}"
            else:
                with self._lock:
                    self._t.append(time.time())
                    self._v.append(int(value))
            next_t += period
            self._stop.wait(max(0.0, next_t - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)

    def latest(self) -> int | None:
        with self._lock:
            return self._v[-1] if self._v else None

    def series(self) -> Series:
        with self._lock:
            return Series(self.source, self.metric, tuple(self._t), tuple(self._v))

    def window_peak(self, t0: float, t1: float) -> Peak:
        reason = f"no samples in window ({self._last_error or 'source silent'})"
        return peak_of(self.series(), t0, t1, reason_if_empty=reason)

    def provenance(self) -> dict[str, Any]:
        s = self.series()
        span = (time.time() - self._started_at) if self._started_at else 0.0
        return {"source": self.source, "metric": self.metric, "available": bool(s.t),
                "reason": None if s.t else (self._last_error or "no samples"), "samples": len(s.t),
                "errors": self._errors, "last_error": self._last_error, "target_hz": self.hz,
                "achieved_hz": round(len(s.t) / span, 2) if span > 0 else None}


class UnavailableMeter(Meter):
    """A meter that cannot run here at all (no NVML, no URL...): every figure says why."""

    def __init__(self, source: str, metric: str, reason: str) -> None:
        self.source, self.metric, self.reason = source, metric, reason

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def series(self) -> Series:
        return Series(self.source, self.metric, (), ())

    def window_peak(self, t0: float, t1: float) -> Peak:
        return Peak(self.source, self.metric, None, 0, None, False, self.reason)

    def provenance(self) -> dict[str, Any]:
        return {"source": self.source, "metric": self.metric, "available": False, "reason": self.reason,
                "samples": 0}
