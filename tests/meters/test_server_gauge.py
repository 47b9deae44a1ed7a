"""The server meter against a real Prometheus exposition over HTTP (prometheus_client's own server on
127.0.0.1): vLLM-Omni 0.30's `vllm_omni:peak_memory_mb` gauge, per stage, last request's reserved peak."""

from __future__ import annotations

import time
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from runner.meters.server import ServerMetricsMeter


def test_vllm_omni_peak_gauge_is_scraped_per_request() -> None:
    registry = CollectorRegistry()
    gauge = Gauge("vllm_omni:peak_memory_mb", "Peak GPU memory in MB observed during a stage's generation.",
                  ["model_name", "stage"], registry=registry)
    gauge.labels(model_name="qwen-image", stage="0").set(1000.0)  # the previous request's peak
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        port = server.server_address[1]
        meter = ServerMetricsMeter(SimpleNamespace(base_url=f"http://127.0.0.1:{port}"), hz=20)
        meter.start()
        time.sleep(0.3)
        t0 = time.time()
        time.sleep(0.2)  # "the request": the gauge still shows the previous request's figure meanwhile
        gauge.labels(model_name="qwen-image", stage="0").set(23522.0)  # set when this request finished
        t1 = time.time()
        peak = meter.window_peak(t0, t1)
        assert peak.available and peak.bytes == 23522 * 2**20 and peak.source == "server"
        assert "reserved" in peak.reason and "equal to the value before" not in peak.reason
        # a request that set nothing (a failure) shows the earlier figure: said so, not hidden
        time.sleep(0.2)
        t2 = time.time()
        time.sleep(0.1)
        stale = meter.window_peak(t2, time.time())
        assert stale.bytes == 23522 * 2**20 and "may be the previous request's" in stale.reason
        # a finished request's peak is no level between requests: a quiet window is not widened waiting for one
        assert not meter.window_floor(t2, time.time()).available and not meter.level_pending(t2)
        meter.stop()
        assert meter.kind == "last-peak" and meter.provenance()["available"]
        # the session's window, asked after stop: the highest sample polled, not a read on a closed client
        session = meter.window_peak(0, time.time())
        assert session.available and session.bytes == 23522 * 2**20, session.reason
    finally:
        server.shutdown()
        thread.join(timeout=5)


def test_a_server_without_any_gauge_is_recorded_as_such() -> None:
    registry = CollectorRegistry()
    Gauge("http_requests_in_flight", "x", registry=registry).set(1)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        meter = ServerMetricsMeter(SimpleNamespace(base_url=f"http://127.0.0.1:{server.server_address[1]}"), 20)
        meter.start()
        time.sleep(0.3)
        meter.stop()
        assert meter.absent and "--log-stats" in meter.absent
        assert not meter.window_peak(0, time.time()).available
    finally:
        server.shutdown()
        thread.join(timeout=5)


def test_a_declared_gauge_without_a_sample_is_asked_again_until_a_request_sets_it() -> None:
    """vLLM-Omni 0.30.0 declares vllm_omni:peak_memory_mb on every page and sets it only with --log-stats after a
    request that measured a peak above 0 (measured: tests/fixtures/vllm-omni-0.30/metrics.txt): before that the
    meter has no reading and says why, and it is not written off as a server without the gauge."""
    registry = CollectorRegistry()
    gauge = Gauge("vllm_omni:peak_memory_mb", "Peak GPU memory in MB observed during a stage's generation.",
                  ["model_name", "stage"], registry=registry)  # declared: no label set, so no sample
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        meter = ServerMetricsMeter(SimpleNamespace(base_url=f"http://127.0.0.1:{server.server_address[1]}"), 20)
        meter.start()
        time.sleep(0.3)
        t0 = time.time()
        unset = meter.window_peak(t0 - 0.3, t0)
        assert not unset.available and unset.bytes is None
        assert "vllm_omni:peak_memory_mb is declared without a sample" in (unset.reason or "")
        assert "--log-stats" in (unset.reason or "") and meter.absent is None
        gauge.labels(model_name="qwen-image", stage="0").set(287.33)  # the first request that measured one
        peak = meter.window_peak(t0, time.time())
        assert peak.available and peak.bytes == round(287.33 * 2**20)
        meter.stop()
    finally:
        server.shutdown()
        thread.join(timeout=5)


def test_a_last_request_peak_gauge_is_polled_once_a_second_and_read_after_each_response() -> None:
    """vLLM-Omni's peak gauge changes only when a request ends, and each answer's figure is read right after it:
    between requests it is polled once a second, not at the run's 20 Hz (each poll is a request the server under
    test answers on its own event loop). The read after a response is a sample: the next request's "before"
    and the session's peak, with no poll between them."""
    registry = CollectorRegistry()
    gauge = Gauge("vllm_omni:peak_memory_mb", "Peak GPU memory in MB observed during a stage's generation.",
                  ["model_name", "stage"], registry=registry)
    gauge.labels(model_name="m", stage="0").set(1000.0)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        meter = ServerMetricsMeter(SimpleNamespace(base_url=f"http://127.0.0.1:{server.server_address[1]}"), 20)
        meter.start()
        time.sleep(2.5)  # idle: the first poll finds the kind, then one a second
        assert meter.kind == "last-peak" and 1 <= meter.provenance()["samples"] <= 4, meter.provenance()  # not 50
        t0 = time.time()
        gauge.labels(model_name="m", stage="0").set(2000.0)  # a request ends
        first = meter.window_peak(t0, time.time())
        assert first.bytes == 2000 * 2**20 and "equal to the value before" not in (first.reason or "")
        t1 = time.time()  # a request that failed, within the second: the gauge keeps the previous request's figure
        again = meter.window_peak(t1, time.time())
        assert again.bytes == 2000 * 2**20 and "may be the previous request's" in (again.reason or ""), again
        meter.stop()
        assert meter.window_peak(0, time.time()).bytes == 2000 * 2**20  # the session's peak holds the last read
    finally:
        server.shutdown()
        thread.join(timeout=5)
