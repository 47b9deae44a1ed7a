"""NVML on a machine without a driver (this CI machine): unavailable with a reason, never 0; and the NVML
meter's logic with a fake source."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import pytest

from runner.meters import build_meter, idle_baseline
from runner.meters.base import SourceUnavailable, UnavailableMeter
from runner.meters.gpu import GpuProcess, ManualSource
from runner.meters.idle import IdleBaseline, measure_idle
from runner.meters.nvml import NvmlMeter, open_source


@dataclass(frozen=True)
class FakeCard:
    gpu: str | None = "0"
    meters: tuple[str, ...] = ("nvml",)
    meter_options: dict = field(default_factory=dict)  # no meter URLs


def nvml_works() -> bool:
    try:
        open_source(None)
        return True
    except SourceUnavailable:
        return False


@pytest.mark.skipif(nvml_works(), reason="NVML works here: this test is for hosts without a driver")
def test_nvml_unavailable_with_reason() -> None:
    meter = build_meter("nvml", FakeCard(), None, 20)
    assert isinstance(meter, UnavailableMeter)
    assert "NVML" in meter.reason
    meter.start()
    peak = meter.window_peak(time.time() - 1, time.time())
    meter.stop()
    assert (peak.available, peak.bytes, peak.samples) == (False, None, 0) and "NVML" in peak.reason
    prov = meter.provenance()
    assert prov["available"] is False and prov["reason"] == meter.reason
    base = idle_baseline(FakeCard())
    assert not base.available and "NVML" in base.reason
    assert base.stop_reason(require_idle=False) is None
    assert "cannot verify" in base.stop_reason(require_idle=True)


def test_missing_urls_are_unavailable() -> None:
    for name in ("sidecar", "dcgm", "prometheus"):
        m = build_meter(name, FakeCard(meters=(name,)), None, 20)
        assert isinstance(m, UnavailableMeter) and f"no {name}_url" in m.reason
    assert idle_baseline(FakeCard(meters=("server",))).available is False


class FakeNvml(ManualSource):
    memory_api = "v2"


class FakeServer:
    def info(self) -> dict:
        return {"pid": os.getpid() + 10_000_000}  # no such process: only its own PID counts as the server


class FakeClock:
    """Epoch seconds that move only when the test says: rates and gaps are exact, not a busy machine's."""

    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def tick(self, seconds: float) -> None:
        self.t += seconds


def test_nvml_meter_logic_with_fake_source() -> None:
    src = FakeNvml(used=1 << 30, reserved=615 << 20)
    src.procs = (GpuProcess(os.getpid() + 10_000_000, 1 << 30, "compute", "server"),
                 GpuProcess(1, 2 << 30, "compute", "stranger"))
    meter = NvmlMeter(src, hz=500, server=FakeServer())  # type: ignore[arg-type]
    clock = meter.clock = FakeClock()
    t0 = clock()
    for i in range(100):  # 0.2 s at 500 Hz; a 20 ms spike in the middle
        src.set(3 << 30 if 50 <= i < 60 else 1 << 30)
        meter.sample_once()
        clock.tick(0.002)
    meter.poll_processes()
    t1 = clock()
    meter.stop()
    peak = meter.window_peak(t0, t1)
    assert peak.available and peak.bytes == 3 << 30 and peak.samples == 100 and peak.rate_hz == 500.0
    prov = meter.provenance()
    assert prov["reserved_bytes"] == {"min": 615 << 20, "max": 615 << 20}
    assert [p["role"] for p in prov["processes"]] == ["other", "server"]
    assert prov["foreign_processes"][0]["name"] == "stranger" and prov["meter_holds_cuda_context"] is False
    assert prov["achieved_hz"] == 500.0 and prov["max_gap_s"] == 0.002
    s = meter.series()  # compacted: a step signal keeps its edges, not every flat sample
    assert max(s.value) == 3 << 30 and len(s.t) < prov["samples"]
    (reserved,) = meter.extra_series()
    assert reserved.metric == "device_reserved" and set(reserved.value) == {615 << 20}


def test_idle_baseline_stop_reason_lists_holders() -> None:
    src = ManualSource(used=5 << 30)
    src.procs = (GpuProcess(777, 5 << 30, "compute", "python3"),)
    base = measure_idle(src, "nvml")
    assert base.available and base.used_bytes == 5 << 30
    reason = base.stop_reason(require_idle=True)
    assert "pid 777 (python3, compute, 5120 MiB)" in reason
    assert base.stop_reason(require_idle=False) is None
    assert IdleBaseline.from_json(base.to_json()) == base
    # read by the same declaration it is written from (a sidecar's /idle is untrusted): wrong types are refused
    for bad in ({"available": "yes"}, {"used_bytes": "5368709120"}, {"foreign_processes": [{"pid": "777"}]},
                {"gpu": {"index": [0]}}):
        with pytest.raises(ValueError):
            IdleBaseline.from_json({**base.to_json(), **bad})
    assert measure_idle(ManualSource(), "nvml").stop_reason(require_idle=True) is None
