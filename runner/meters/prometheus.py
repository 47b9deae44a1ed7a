"""Prometheus as a meter: a window's peak is asked of Prometheus instead of sampled locally.

peak = max_over_time(DCGM_FI_DEV_FB_USED{UUID="…"}[R]) at time = t1 + settle, R = t1 + settle − t0, and
samples = count_over_time of the same. `settle` waits for the scrape that holds the window's last moments
(a diffusion request often peaks at VAE decode, just before the response), so the window reaches up to
`settle` seconds past t1. The resolution is the slower of dcgm-exporter's collection interval and the
scrape interval; the sample count says which it was.
"""

from __future__ import annotations

import math
import time
from typing import Any

from runner.backends.base import RunningServer
from runner.core.records import Peak
from runner.core.registry import PrometheusOptions
from runner.core.units import MIB
from runner.meters.base import Meter, Series, SourceUnavailable, scrape
from runner.observe import bounded, quote
from runner.observe.reading import number, to_bytes
from runner.plan.matrix import Card

METRIC = "DCGM_FI_DEV_FB_USED"


def selector(gpu: str | None) -> str:
    """Label matchers for card.gpu: a GPU- UUID, an index, or either with `:GPU_I_ID` (MIG)."""
    spec, _, mig = (gpu or "").partition(":")
    parts = []
    if spec.startswith("GPU-"):
        parts.append(f'UUID="{spec}"')
    elif spec:
        parts.append(f'gpu="{spec}"')
    if mig:
        parts.append(f'GPU_I_ID="{mig}"')
    return "{" + ",".join(parts) + "}"


class QueryError(Exception):
    pass


class PrometheusMeter(Meter):
    source = "prometheus"
    metric = "device"

    def __init__(self, url: str, gpu: str | None, settle_s: float = 1.5, timeout_s: float = 5.0,
                 metric_name: str = METRIC) -> None:
        self.url = url.rstrip("/")
        self.gpu = gpu
        self.settle_s = settle_s
        self.expr = f"{metric_name}{selector(gpu)}"
        self.client = bounded.client(timeout=timeout_s)
        self._t_start: float | None = None
        self._t_stop: float | None = None
        self._queries = self._errors = 0
        self._last_error: str | None = None
        self._labels: dict[str, str] | None = None
        self._series: Series | None = None

    def _query(self, query: str, at: float) -> list[dict[str, Any]]:
        """One instant query under the scrape deadline; any answer not of Prometheus's shape is a QueryError."""
        self._queries += 1
        try:
            response = scrape(self.client, f"{self.url}/api/v1/query", params={"query": query, "time": f"{at:.3f}"})
            body = response.json()
        except SourceUnavailable as exc:
            raise QueryError(str(exc)) from None
        except ValueError as exc:
            raise QueryError(f"GET {self.url}/api/v1/query: {type(exc).__name__}") from None
        if not isinstance(body, dict) or response.status != 200 or body.get("status") != "success":
            error = body.get("error", "") if isinstance(body, dict) else "answer is not a JSON object"
            raise QueryError(f"{query}: HTTP {response.status} {quote.console(error)[:200]}".strip())
        result = body.get("data", {}).get("result") if isinstance(body.get("data"), dict) else None
        if not isinstance(result, list) or not all(isinstance(r, dict) for r in result):
            raise QueryError(f"{query}: answer has no list of series in data.result")
        return result

    def _one(self, result: list[dict[str, Any]], query: str) -> dict[str, Any]:
        if not result:
            raise QueryError(f"no samples for {query} (is dcgm-exporter scraped, and is the GPU label right?)")
        if len(result) > 1:
            raise QueryError(f"{self.expr} matches {len(result)} series; name the GPU by UUID (and a MIG "
                             f"instance as '<UUID>:<GPU_I_ID>')")
        labels = result[0].get("metric", {})
        self._labels = {str(k): quote.console(v)[:200] for k, v in labels.items()} if isinstance(labels, dict) else {}
        return result[0]

    @staticmethod
    def _value(sample: Any, what: str, scale: int = 1) -> tuple[float, int]:
        """(timestamp, validated figure) of a Prometheus sample `[t, "value"]` (values are strings: "NaN",
        "+Inf" are valid Prometheus values and no memory reading)."""
        if not isinstance(sample, (list, tuple)) or len(sample) != 2 or not isinstance(sample[1], str):
            raise QueryError(f"{what}: sample {str(sample)[:40]!r} is not [time, \"value\"]")
        try:
            t = number(float(sample[0]) if isinstance(sample[0], str) else sample[0], f"{what} time")
            return t, to_bytes(float(sample[1]), what, scale)
        except ValueError as exc:  # float() of a non-number, or BadReading
            raise QueryError(f"{what}: {exc}") from None

    def start(self) -> None:
        self._t_start = time.time()

    def stop(self) -> None:
        self._t_stop = time.time()

    def window_peak(self, t0: float, t1: float) -> Peak:
        at = t1 + self.settle_s
        wait = at - time.time()
        if wait > 0:
            time.sleep(wait)  # the scrape that holds the window's end has to exist first
        rng = f"{max(1, math.ceil((at - t0) * 1000))}ms"
        peak_q, count_q = f"max_over_time({self.expr}[{rng}])", f"count_over_time({self.expr}[{rng}])"
        try:
            peak = self._one(self._query(peak_q, at), peak_q)
            count = self._one(self._query(count_q, at), count_q)
            value = self._value(peak.get("value"), peak_q, MIB)[1]
            samples = self._value(count.get("value"), count_q)[1]
        except QueryError as exc:
            self._errors += 1
            self._last_error = str(exc)
            return Peak(source=self.source, metric=self.metric, bytes=None, samples=0, rate_hz=None, available=False,
                        reason=str(exc))
        return Peak(source=self.source, metric=self.metric, bytes=value, samples=samples,
                    rate_hz=round(samples / max(at - t0, 1e-9), 2), available=True)

    def series(self) -> Series:
        """The raw scraped samples of the session (a range-vector selector returns them with their
        timestamps, unlike query_range's step grid)."""
        if self._series is not None:
            return self._series
        empty = Series(self.source, self.metric, (), ())
        if self._t_start is None:
            return empty
        end = (self._t_stop or time.time()) + self.settle_s
        query = f"{self.expr}[{max(1, math.ceil((end - self._t_start) * 1000))}ms]"
        try:
            result = self._one(self._query(query, end), query)
            values = result.get("values", [])
            if not isinstance(values, list):
                raise QueryError(f"{query}: values is not a list")
        except QueryError as exc:
            self._errors += 1
            self._last_error = str(exc)
            return empty
        pts = []
        for sample in values:  # a bad sample is left out of the plot, the rest stays
            try:
                pts.append(self._value(sample, query, MIB))
            except QueryError as exc:
                self._errors += 1
                self._last_error = str(exc)
        s = Series(self.source, self.metric, tuple(p[0] for p in pts), tuple(p[1] for p in pts))
        if self._t_stop is not None:
            self._series = s
        return s

    def provenance(self) -> dict[str, Any]:
        s = self._series
        return {"source": self.source, "metric": self.metric, "url": self.url, "expr": self.expr,
                "available": self._labels is not None, "reason": None if self._labels else
                (self._last_error or "not queried yet"), "samples": len(s.t) if s else None,
                "settle_s": self.settle_s, "queries": self._queries, "errors": self._errors,
                "last_error": self._last_error, "series_labels": self._labels,
                "window": "[t0, t1 + settle_s]"}


def build(card: Card, server: RunningServer | None, hz: float) -> Meter:
    """The registry's factory: queries the card's Prometheus once per window (no polling rate)."""
    options = card.meter_options["prometheus"]
    assert isinstance(options, PrometheusOptions), "the registry pairs prometheus with PrometheusOptions"
    return PrometheusMeter(options.prometheus_url, card.gpu)
