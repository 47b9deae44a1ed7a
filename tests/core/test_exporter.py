"""The run's live exporter over real HTTP on 127.0.0.1: what monitoring/prometheus.yml scrapes."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from runner.backends.local import free_port
from runner.core.records import Failure, FailureClass, Peak, Status, StepRecord
from runner.present.exporter import RunExporter


def test_exporter_serves_step_outcomes_and_live_memory() -> None:
    port = free_port()
    exporter = RunExporter("run-1", port)
    try:
        exporter.lane_started("gpu0", ("c",), 4)
        exporter.session_started("c", "default", 0)
        exporter.memory("c", 5 * 2**30)
        ok = StepRecord(key="c/default/refs-1/f-seed-1", card="c", flags="default", role="default", fixture="f",
                        references=1, seed=1, status=Status.OK, wall_s=2.5,
                        peaks=(Peak(source="nvml", metric="device", bytes=7 * 2**30, samples=500, rate_hz=1000.0,
                                    available=True),))
        exporter.step_done(ok)
        exporter.step_done(StepRecord(key="c/default/refs-2/f-seed-1", card="c", flags="default", role="default",
                                      fixture="f", references=2, seed=1, status=Status.FAILED,
                                      failure=Failure(kind=FailureClass.OOM, message="oom")))
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        exporter.close()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("runner_device_memory_bytes", (("card", "c"), ("run", "run-1")))] == 5 * 2**30
    assert samples[("runner_steps_total", (("card", "c"), ("failure", "oom"), ("flags", "default"),
                                          ("run", "run-1"), ("status", "failed")))] == 1
    assert samples[("runner_step_peak_bytes", (("card", "c"), ("flags", "default"), ("references", "1"),
                                               ("run", "run-1"), ("source", "nvml")))] == 7 * 2**30
    assert samples[("runner_lane_steps_planned", (("lane", "gpu0"), ("run", "run-1")))] == 4
    assert samples[("runner_step_seconds_count", (("card", "c"), ("flags", "default"), ("run", "run-1")))] == 1
