"""DcgmMeter against a dcgm-exporter replay on 127.0.0.1: peaks, interval warning, a source that goes away."""

from __future__ import annotations

import time

from meters_support import GPU0_UUID, MIB, recorded_series

from runner.meters.dcgm import DcgmMeter


def drive(meter: DcgmMeter, seconds: float) -> None:
    """Take the meter's samples here, one per 1/hz of real time (the replay moves on wall time), instead of
    its polling thread: the sample count is then exact, whatever else loads this machine's cores."""
    for _ in range(round(seconds * meter.hz)):
        meter.sample_once()
        time.sleep(1 / meter.hz)


def test_window_peak_and_fast_interval(replay) -> None:
    exporter = replay(recorded_series(), per_scrape=False, interval_s=0.1)
    meter = DcgmMeter(exporter.url.removesuffix("/metrics"), GPU0_UUID, hz=20)
    t0 = time.time()
    drive(meter, 1.3)
    t1 = time.time()
    meter.stop()
    peak = meter.window_peak(t0, t1)
    assert peak.available and peak.bytes == max(recorded_series()) * MIB
    assert peak.samples == 26
    prov = meter.provenance()
    assert prov["gpu"]["uuid"] == GPU0_UUID and prov["gpu"]["hostname"] == "gpu-node-1"
    assert prov["warning"] is None and 0.05 < prov["collection_interval_s"] < 0.2
    assert prov["reserved_bytes"] == {"min": 615 * MIB, "max": 615 * MIB}


def test_coarse_interval_is_warned(replay) -> None:
    exporter = replay([0, 100, 200, 300], per_scrape=False, interval_s=1.2)
    meter = DcgmMeter(exporter.url, "0", hz=10)
    drive(meter, 3.8)
    meter.stop()
    prov = meter.provenance()
    assert prov["collection_interval_s"] > 1.0 and "-c 100" in prov["warning"]


def test_exporter_gone_mid_session_is_unavailable_not_zero(replay) -> None:
    exporter = replay([1000, 3000, 2000], per_scrape=False, interval_s=0.2)
    meter = DcgmMeter(exporter.url, GPU0_UUID, hz=20)
    t0 = time.time()
    drive(meter, 0.7)
    t_gone = time.time()
    exporter.stop()
    drive(meter, 0.6)
    t1 = time.time()
    meter.stop()
    after = meter.window_peak(t_gone + 0.1, t1)
    assert not after.available and after.bytes is None and "GET" in after.reason
    whole = meter.window_peak(t0, t1)
    assert whole.available and whole.bytes == 3000 * MIB and whole.reason.startswith("partial")
    prov = meter.provenance()
    assert prov["outages"] and prov["errors"] > 0
