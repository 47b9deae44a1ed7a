"""Memory meters: each samples one source into a Series and answers window peaks with provenance.

A source that cannot be read is *unavailable with a reason*, never a zero (a silent 0 once hid a real
regression in vLLM-Omni's perf CI). A source that stops answering mid-session keeps the peaks it had, and
every window that overlaps the outage says so.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from runner.core.records import Level, Peak
from runner.core.registry import METERS
from runner.observe import bounded, quote
from runner.observe.reading import BadReading, to_bytes

SCRAPE_S = 2.0  # a scrape's total deadline: a dripping or hanging exporter never stalls a step for longer
SCRAPE_BYTES = 8 * 2**20  # a metrics page over this is not one (dcgm-exporter's page for 8 GPUs: ~100 KB)


class SourceUnavailable(Exception):
    """read() could not get a figure; the message is the reason recorded."""


def scrape(client: httpx.Client, url: str, **kwargs: Any) -> bounded.Answer:
    """GET under the scrape deadline and size cap; any failure is SourceUnavailable with the reason."""
    try:
        return bounded.exchange(client, "GET", url, deadline_s=SCRAPE_S, max_bytes=SCRAPE_BYTES, connect_s=SCRAPE_S,
                                **kwargs)
    except (httpx.HTTPError, bounded.Overdue, bounded.TooLarge) as exc:
        raise SourceUnavailable(f"GET {url}: {type(exc).__name__}: {quote.console(exc)[:200]}") from None


def fetch_text(client: httpx.Client, url: str) -> str:
    """GET a metrics page; a connection error, a slow or huge answer or a non-200 answer is SourceUnavailable
    with the reason."""
    response = scrape(client, url)
    if response.status != 200:
        raise SourceUnavailable(f"GET {url}: HTTP {response.status}")
    return response.text


@dataclass(frozen=True)
class Series:
    source: str
    metric: str  # "device" or "host" (extra series: e.g. "device_reserved")
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

    @property
    def bound(self) -> Literal["exact", "upper-bound"]:
        """What a level of this source is: the server's own figure of its live tensors is exact; a whole-device
        source also counts the allocator's cache of freed blocks (and any other process): an upper bound."""
        return "upper-bound" if self.source not in METERS or METERS.get(self.source).whole_device else "exact"

    def window_floor(self, t0: float, t1: float) -> Level:
        """The settled level in a quiet window [t0, t1] between requests: the least sample in it."""
        s = self.series()
        values = [v for t, v in zip(s.t, s.value, strict=True) if t0 <= t <= t1]
        return floor_level(self, values, t1 - t0)

    def level_pending(self, t0: float) -> bool:
        """Whether a quiet window from t0 that has no level from this source yet is worth widening: the source
        has read before (a loaded host, a slow page can miss one window)."""
        return bool(self.provenance().get("samples"))

    def extra_series(self) -> tuple[Series, ...]:
        """Secondary series of the same source (NVML's driver-reserved bytes), for memory.csv and plots."""
        return ()


def floor_level(meter: Meter, values: Sequence[int], window_s: float, why_none: str | None = None) -> Level:
    """A quiet window's samples as a Level: the least one, or unavailable saying why there is none."""
    span = max(window_s, 0.0)
    if not values:
        return Level(source=meter.source, bytes=None, samples=0, window_s=round(span, 3), bound=meter.bound,
                     available=False, reason=why_none or f"no sample in the {span:.2f} s quiet window")
    return Level(source=meter.source, bytes=min(values), samples=len(values), window_s=round(span, 3),
                 bound=meter.bound, available=True)


def run_at_rate(stop: threading.Event, hz: float, tick: Callable[[], None]) -> None:
    """Call `tick` every 1/hz seconds until `stop` is set: the one fixed-rate loop of every sampler. A tick
    that ran late (GIL, slow source) does not make the next ones burst to catch up."""
    period = 1.0 / hz
    next_t = time.monotonic()
    while not stop.is_set():
        tick()
        next_t += period
        delay = next_t - time.monotonic()
        if delay < -period:
            next_t = time.monotonic()
        stop.wait(max(0.0, delay))


def compact(t: array, v: array) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """Drop samples that repeat both neighbours' value: lossless for a step signal such as device memory,
    and it turns a 1 kHz series of mostly flat memory into a few thousand rows for memory.csv."""
    n = len(v)
    if n <= 2:
        return tuple(t), tuple(v)
    keep_t, keep_v = [t[0]], [v[0]]
    for i in range(1, n - 1):
        if v[i] != v[i - 1] or v[i] != v[i + 1]:
            keep_t.append(t[i])
            keep_v.append(v[i])
    keep_t.append(t[n - 1])
    keep_v.append(v[n - 1])
    return tuple(keep_t), tuple(keep_v)


class PolledMeter(Meter):
    """Calls read() every 1/hz seconds in a daemon thread; keeps (t, bytes) in compact arrays.

    Subclasses with more than one figure per reading name them in `extra_metrics` and override
    read_many(); the first figure is the meter's metric. Outages (read failing after it had worked, or
    before it ever did) are kept as intervals so a window that overlaps one is reported as partial.
    """

    extra_metrics: tuple[str, ...] = ()
    compact_series = False  # True for fast step-like sources: series() drops repeated samples
    clock: Callable[[], float] = staticmethod(time.time)  # epoch seconds; tests drive a fake one

    def __init__(self, source: str, metric: str, hz: float) -> None:
        self.source, self.metric, self.hz = source, metric, hz
        self._t: array[float] = array("d")
        self._v: array[int] = array("q")
        self._x: tuple[array[int], ...] = tuple(array("q") for _ in self.extra_metrics)
        self._errors = 0
        self._last_error: str | None = None
        self._answered: float | None = None  # when the newest read that came back (a figure or an error) was asked
        self._outages: list[list[float]] = []  # [start, end] (end = start while it lasts)
        self._in_outage = False
        self._max_gap = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started_at: float | None = None
        self._stopped_at: float | None = None
        self._lock = threading.Lock()

    @abstractmethod
    def read(self) -> int:
        """Bytes now; raise SourceUnavailable(reason) when there is no reading."""

    def read_many(self) -> tuple[int, ...]:
        """The metric's figure followed by one per extra metric."""
        return (self.read(),)

    def start(self) -> None:
        self._started_at = self.clock()
        self._thread = threading.Thread(target=self._loop, name=f"meter-{self.source}", daemon=True)
        self._thread.start()

    def _failed(self, reason: str, now: float) -> None:
        self._errors += 1
        self._last_error = quote.console(reason)[:300]  # exporter text: inert and short in every record
        with self._lock:
            if self._in_outage:
                self._outages[-1][1] = now
            else:
                self._outages.append([now, now])
                self._in_outage = True

    def sample_once(self) -> None:
        """One reading (the polling thread calls this every 1/hz s; tests call it with a fake clock)."""
        # A reading is stamped when it was asked for: the source took it at or after that moment. Stamped when it
        # came back, a scrape the server answered before a short request and that came back after it (a loaded
        # host) read as the level the request left: a soak's floor lagged one request behind (2026-12-06).
        asked = self.clock()
        if self._started_at is None:
            self._started_at = asked
        try:  # every figure is checked before any is kept: the columns stay the same length
            values = tuple(to_bytes(v, f"{self.source} reading") for v in self.read_many())
            if len(values) != 1 + len(self._x):
                raise BadReading(f"{self.source} reading: {len(values)} figures, expected {1 + len(self._x)}")
        except (SourceUnavailable, BadReading) as exc:
            self._failed(str(exc), self.clock())
        except Exception as exc:  # a meter must never take the run down
            self._failed(f"{type(exc).__name__}: {exc}", self.clock())
        else:
            self.keep(asked, values)
            self._in_outage = False
        self._answered = asked

    def keep(self, asked: float, values: tuple[int, ...]) -> None:
        """Add a reading stamped when it was asked, in time order: one taken outside the polling thread (a read
        right after a response) may come back after a later poll's."""
        with self._lock:
            i = bisect_right(self._t, asked)
            if i == len(self._t) and self._t:
                self._max_gap = max(self._max_gap, asked - self._t[-1])
            self._t.insert(i, asked)
            self._v.insert(i, values[0])
            for column, value in zip(self._x, values[1:], strict=True):
                column.insert(i, value)

    def _loop(self) -> None:
        run_at_rate(self._stop, self.hz, self.sample_once)

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        self._stopped_at = self._stopped_at or self.clock()

    def latest(self) -> int | None:
        with self._lock:
            return self._v[-1] if self._v else None

    def series(self) -> Series:
        with self._lock:
            if self.compact_series:
                t, v = compact(self._t, self._v)
                return Series(self.source, self.metric, t, v)
            return Series(self.source, self.metric, tuple(self._t), tuple(self._v))

    def extra_series(self) -> tuple[Series, ...]:
        with self._lock:
            out = []
            for name, column in zip(self.extra_metrics, self._x, strict=True):
                t, v = compact(self._t, column) if self.compact_series else (tuple(self._t), tuple(column))
                out.append(Series(self.source, name, t, v))
            return tuple(out)

    def _outage_in(self, t0: float, t1: float) -> float:
        """Seconds of [t0, t1] during which the source did not answer."""
        with self._lock:
            return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in self._outages)

    def window_peak(self, t0: float, t1: float) -> Peak:
        with self._lock:
            lo, hi = bisect_left(self._t, t0), bisect_right(self._t, t1)
            values = self._v[lo:hi]
        outage = self._outage_in(t0, t1)
        if not values:
            return Peak(source=self.source, metric=self.metric, bytes=None, samples=0, rate_hz=None, available=False,
                        reason=f"no samples in window ({self._last_error or 'source silent'})")
        span = max(t1 - t0, 1e-9)
        reason = None
        if outage > 0:
            reason = f"partial: source unavailable for {outage:.2f} s of {span:.2f} s ({self._last_error})"
        return Peak(source=self.source, metric=self.metric, bytes=max(values), samples=len(values),
                    rate_hz=round(len(values) / span, 2), available=True,
                    reason=reason)

    def window_floor(self, t0: float, t1: float) -> Level:
        with self._lock:
            lo, hi = bisect_left(self._t, t0), bisect_right(self._t, t1)
            values = self._v[lo:hi]
        return floor_level(self, values, t1 - t0, None if values else
                           f"no sample in the {t1 - t0:.2f} s quiet window ({self._last_error or 'source silent'})")

    def level_pending(self, t0: float) -> bool:
        # Also a poller that has not answered since t0: the first read after a server is ready may still be on
        # its way on a starved host; the level after the load was lost that way (2026-12-07). One that answered
        # with an error in the window has none to give.
        running = self._thread is not None and not self._stop.is_set()
        return super().level_pending(t0) or (running and (self._answered is None or self._answered < t0))

    def provenance(self) -> dict[str, Any]:
        with self._lock:
            n = len(self._t)
            outages = [(round(a, 3), round(b, 3)) for a, b in self._outages]
            max_gap = self._max_gap
        end = self._stopped_at or self.clock()
        span = (end - self._started_at) if self._started_at else 0.0
        return {"source": self.source, "metric": self.metric, "available": n > 0,
                "reason": None if n else (self._last_error or "no samples"), "samples": n,
                "errors": self._errors, "last_error": self._last_error, "target_hz": self.hz,
                "achieved_hz": round(n / span, 2) if span > 0 else None,
                "max_gap_s": round(max_gap, 4) if n > 1 else None, "outages": outages}


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
        return Peak(source=self.source, metric=self.metric, bytes=None, samples=0, rate_hz=None, available=False,
                    reason=self.reason)

    def window_floor(self, t0: float, t1: float) -> Level:
        return floor_level(self, (), t1 - t0, self.reason)

    def provenance(self) -> dict[str, Any]:
        return {"source": self.source, "metric": self.metric, "available": False, "reason": self.reason,
                "samples": 0}
