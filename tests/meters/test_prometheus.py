"""A real Prometheus scraping a replayed dcgm-exporter at 1 s; the runner's window peak is asked of it."""

from __future__ import annotations

import time

import pytest
from meters_support import GPU0_UUID, MIB, free_port, recorded_series

from runner.meters.prometheus import PrometheusMeter, selector

pytestmark = pytest.mark.prometheus


def test_window_peak_equals_replayed_maximum(replay, prometheus) -> None:
    values = recorded_series()
    exporter = replay(values, per_scrape=True)
    t0 = time.time()
    prom = prometheus([exporter.target], scrape_s=1.0)
    meter = PrometheusMeter(prom.url, GPU0_UUID, settle_s=1.2)
    meter.start()
    deadline = time.monotonic() + 20
    while len(exporter.served) < len(values) and time.monotonic() < deadline:
        time.sleep(0.1)
    t1 = time.time()
    assert len(exporter.served) >= len(values), "prometheus did not scrape the replay"
    peak = meter.window_peak(t0, t1)
    meter.stop()
    assert peak.available, peak.reason
    assert peak.bytes == max(v for _, v in exporter.served) * MIB == 57344 * MIB
    assert peak.samples >= len(values)
    # a window that holds only the load rows (before the request's peak) sees the load maximum
    load_end = exporter.served[4][0]
    load = meter.window_peak(t0, load_end - 0.2)
    assert load.available and load.bytes < peak.bytes
    series = meter.series()
    assert max(series.value) == 57344 * MIB and len(series.t) >= len(values)
    prov = meter.provenance()
    assert prov["available"] and prov["series_labels"]["UUID"] == GPU0_UUID
    assert prov["series_labels"]["Hostname"] == "gpu-node-1"


def test_prometheus_unreachable_is_unavailable_with_reason() -> None:
    meter = PrometheusMeter(f"http://127.0.0.1:{free_port()}", GPU0_UUID, settle_s=0.0, timeout_s=1.0)
    meter.start()
    now = time.time()
    peak = meter.window_peak(now - 1, now)
    meter.stop()
    assert not peak.available and peak.bytes is None and "ConnectError" in peak.reason
    assert meter.series().t == ()
    assert meter.provenance()["available"] is False


def test_selectors() -> None:
    assert selector("GPU-abc") == '{UUID="GPU-abc"}'
    assert selector("2") == '{gpu="2"}'
    assert selector("GPU-abc:5") == '{UUID="GPU-abc",GPU_I_ID="5"}'
    assert selector(None) == "{}"
