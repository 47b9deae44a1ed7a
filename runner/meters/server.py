"""Server-reported device memory, scraped from the server's own /metrics.

Two kinds of gauge are known, and they mean different things:
- `refserver_device_memory_bytes` (the reference server) and `runner_card_allocated_bytes` (the accounted card of
  the vLLM-Omni test stand, stand/): device memory in use *now*; polled, and a window's peak is the largest
  sample in it, a quiet window's least sample the level between requests. Where a page has one of these and
  vLLM-Omni's peak gauge too (the stand), the current figure is read.
- `vllm_omni:peak_memory_mb{model_name,stage}` (vLLM-Omni 0.30, exported with `--log-stats`): the *last
  finished request's* peak per stage, in MiB of PyTorch's reserved memory, set only when a request produced
  output. Polling it during a request shows the previous request's figure, so a window's peak is read once,
  right after the response, and compared with the value before the request. 0.30.0 declares the family on
  every /metrics page but gives it a sample only with `--log-stats`, after a request that measured a peak
  above 0 (measured): declared without a sample is "no reading yet", never "no gauge", and is asked again.
  Between requests it is polled once a second (LAST_PEAK_POLL_S), not at the run's rate: it changes only when a
  request ends, and every poll is a request the server under test answers on its own event loop.
A server with neither gauge is recorded as such (the Dec-2025 snapshot exports none).
"""

from __future__ import annotations

from bisect import bisect_right

from prometheus_client.parser import text_string_to_metric_families

from runner.backends.base import RunningServer
from runner.core.records import Level, Peak
from runner.core.units import MIB
from runner.meters.base import (
    Meter,
    PolledMeter,
    SourceUnavailable,
    UnavailableMeter,
    fetch_text,
    floor_level,
    run_at_rate,
)
from runner.observe import bounded
from runner.observe.reading import to_bytes
from runner.plan.matrix import Card

DEVICE_GAUGES = ("refserver_device_memory_bytes", "runner_card_allocated_bytes")
PEAK_GAUGES = ("vllm_omni:peak_memory_mb",)  # MiB per stage, last request's reserved peak
LAST_PEAK_POLL_S = 1.0  # the poll period of a last-request peak gauge (read after each response besides)


def _families(text: str, names: tuple[str, ...]) -> dict[str, list[float]]:
    """The sample values of each named family the page declares (an empty list: declared, no sample)."""
    return {f.name: [s.value for s in f.samples] for f in text_string_to_metric_families(text) if f.name in names}


def _largest(values: list[float]) -> float:
    return next((v for v in values if v != v), max(values))  # a NaN is not lost to max(): it is refused


def read_page(text: str) -> tuple[str, int | None] | None:
    """("current", bytes) from the reference server's gauge, ("last-peak", bytes) from vLLM-Omni's,
    ("last-peak", None) when vLLM-Omni's is declared without a sample yet, None when the page has neither; a
    value that is no memory figure (NaN, negative, beyond any memory) raises BadReading. One parse."""
    found = _families(text, DEVICE_GAUGES + PEAK_GAUGES)
    for name in DEVICE_GAUGES:
        if values := found.get(name):
            return "current", to_bytes(_largest(values), name)
    if PEAK_GAUGES[0] in found:
        values = found[PEAK_GAUGES[0]]
        return "last-peak", to_bytes(_largest(values), f"{PEAK_GAUGES[0]} (MiB)", MIB) if values else None
    return None


def read_gauges(text: str) -> tuple[str, int] | None:
    """A reading of the page (read_page), or None when it holds none."""
    got = read_page(text)
    return None if got is None or got[1] is None else (got[0], got[1])


class ServerMetricsMeter(PolledMeter):
    def __init__(self, server: RunningServer, hz: float) -> None:
        super().__init__("server", "device", hz)
        self.server = server
        self.client = bounded.client(timeout=2.0)
        self.absent: str | None = None  # set once the server answered without any memory gauge
        self.kind: str | None = None  # "current" or "last-peak", once seen

    def _loop(self) -> None:
        run_at_rate(self._stop, self.hz, self._poll)

    def _poll(self) -> None:
        last = self._answered  # the polling thread's own previous read: ticks run one after the other
        if self.kind == "last-peak" and last is not None and self.clock() - last < LAST_PEAK_POLL_S:
            return
        self.sample_once()

    @property
    def url(self) -> str:
        return self.server.base_url + "/metrics"  # read late: a container's port is known only once started

    def read(self) -> int:
        if self.absent:  # a server that answers without the gauge will not grow one: stop asking it
            raise SourceUnavailable(self.absent)
        try:
            got = read_page(fetch_text(self.client, self.url))
        except ValueError as exc:  # unparsable exposition or a bad figure (BadReading)
            raise SourceUnavailable(f"{self.url}: {exc}") from None
        if got is None:
            self.absent = (f"{self.url} exports no device-memory gauge ({', '.join(DEVICE_GAUGES + PEAK_GAUGES)}"
                           "; vLLM-Omni 0.30 exports vllm_omni:peak_memory_mb only with --log-stats)")
            raise SourceUnavailable(self.absent)
        self.kind = got[0]
        if got[1] is None:  # declared, not set: a later request may set it, so it is asked again
            raise SourceUnavailable(f"{self.url} has no device-memory reading: {PEAK_GAUGES[0]} is declared "
                                    "without a sample (vLLM-Omni sets it only with --log-stats, after a request "
                                    "that measured a peak above 0)")
        return got[1]

    def window_peak(self, t0: float, t1: float) -> Peak:
        # After stop (the session's own peaks) there is no request to read after: the samples polled are it.
        if self.kind != "last-peak" or self.client.is_closed:
            return super().window_peak(t0, t1)
        asked = self.clock()
        try:
            after = self.read()  # the gauge was set before the response went out
        except Exception as exc:  # a meter never takes the run down
            return Peak(source=self.source, metric=self.metric, bytes=None, samples=0, rate_hz=None, available=False,
                        reason=f"no reading after the request: {exc}")
        with self._lock:
            i = bisect_right(self._t, t0)
            before = self._v[i - 1] if i else None
        # a sample like a poll's: the gauge changes only when a request ends, so this is its value until the next
        # one ends (the next request's "before", the session's peak)
        self.keep(asked, (after,))
        if after == 0:  # vLLM-Omni sets it from `peak or 0.0`: a worker that measured nothing reports 0
            return Peak(source=self.source, metric=self.metric, bytes=None, samples=1, rate_hz=None, available=False,
                        reason="unavailable: the server reported 0.0 (not measured)")
        what = "vllm_omni:peak_memory_mb (reserved, this request, read after the response)"
        if before is not None and before == after:
            what += "; equal to the value before the request: it is set only on success, so it may be the " \
                    "previous request's"
        return Peak(source=self.source, metric=self.metric, bytes=after, samples=1, rate_hz=None, available=True,
                    reason=what)

    def window_floor(self, t0: float, t1: float) -> Level:
        if self.kind == "last-peak":  # the gauge holds a finished request's peak: no level between requests
            return floor_level(self, (), t1 - t0, f"{PEAK_GAUGES[0]} is the last request's peak, not the level "
                                                  "between requests")
        return super().window_floor(t0, t1)

    def level_pending(self, t0: float) -> bool:
        return self.kind != "last-peak" and super().level_pending(t0)  # a peak gauge never gives a level

    def stop(self) -> None:
        super().stop()
        self.client.close()


def build(card: Card, server: RunningServer | None, hz: float) -> Meter:
    """The registry's factory: the server's own /metrics, at most 20 Hz."""
    if server is None:
        return UnavailableMeter("server", "device", "no server to scrape")
    return ServerMetricsMeter(server, hz)
