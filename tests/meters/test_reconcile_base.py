"""Reconciliation table and the PolledMeter's compaction."""

from __future__ import annotations

from array import array

from runner.core.records import Peak
from runner.judge.reconcile import reconcile, render
from runner.meters.base import compact

MIB = 1 << 20


def test_reconcile_picks_fastest_whole_device_source() -> None:
    peaks = [
        Peak(source="server", metric="device", bytes=30_000 * MIB, samples=40, rate_hz=20.0, available=True),
        Peak(source="prometheus", metric="device", bytes=40_000 * MIB, samples=12, rate_hz=1.0, available=True),
        Peak(source="nvml", metric="device", bytes=41_000 * MIB, samples=12_000, rate_hz=1000.0, available=True),
        Peak(source="dcgm", metric="device", bytes=None, samples=0, rate_hz=None, available=False,
             reason="GET http://127.0.0.1:9400/metrics: ConnectError"),
        Peak(source="host", metric="host", bytes=8_000 * MIB, samples=100, rate_hz=10.0, available=True),
    ]
    rows = reconcile(peaks)
    assert [r.source for r in rows] == ["nvml", "server", "prometheus", "dcgm"]
    best = rows[0]
    assert best.best and best.delta_bytes == 0
    prom = next(r for r in rows if r.source == "prometheus")
    assert prom.delta_bytes == -1000 * MIB and "missed the peak" in prom.note
    assert "CUDA context" in next(r for r in rows if r.source == "server").note
    dcgm = rows[-1]
    assert not dcgm.available and dcgm.bytes is None and dcgm.delta_bytes is None and "ConnectError" in dcgm.reason
    table = render(rows)
    assert "| nvml | 41000 |" in table and "best" in table and "unavailable: GET" in table
    assert reconcile(peaks, prefer="prometheus")[0].source == "prometheus"
    assert reconcile([Peak(source="nvml", metric="device", bytes=None, samples=0, rate_hz=None, available=False,
                           reason="x")])[0].best is False


def test_compact_keeps_step_edges() -> None:
    t = array("d", [0, 1, 2, 3, 4, 5, 6])
    v = array("q", [1, 1, 1, 5, 5, 1, 1])
    ct, cv = compact(t, v)
    assert cv == (1, 1, 5, 5, 1, 1) and ct == (0, 2, 3, 4, 5, 6)
