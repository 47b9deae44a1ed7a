"""Reconciliation table and the PolledMeter's compaction."""

from __future__ import annotations

from array import array

from runner.meters.base import compact
from runner.reconcile import reconcile, render
from runner.records import Peak

MIB = 1 << 20


def test_reconcile_picks_fastest_whole_device_source() -> None:
    peaks = [
        Peak("server", "device", 30_000 * MIB, 40, 20.0, True),
        Peak("prometheus", "device", 40_000 * MIB, 12, 1.0, True),
        Peak("nvml", "device", 41_000 * MIB, 12_000, 1000.0, True),
        Peak("dcgm", "device", None, 0, None, False, "GET http://127.0.0.1:9400/metrics: ConnectError"),
        Peak("host", "host", 8_000 * MIB, 100, 10.0, True),
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
    assert reconcile([Peak("nvml", "device", None, 0, None, False, "x")])[0].best is False


def test_compact_keeps_step_edges() -> None:
    t = array("d", [0, 1, 2, 3, 4, 5, 6])
    v = array("q", [1, 1, 1, 5, 5, 1, 1])
    ct, cv = compact(t, v)
    assert cv == (1, 1, 5, 5, 1, 1) and ct == (0, 2, 3, 4, 5, 6)
