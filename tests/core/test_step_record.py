"""Record building is pure: a step's sends (as the executor timed them) → its record, without a server."""

from __future__ import annotations

from runner.core.records import Failure, FailureClass, Peak, Status
from runner.plan.lanes import Step
from runner.run.dialects import ServerPeak
from runner.run.step_records import HttpResult, Observed, Sends, Served, step_record

STEP = Step("c", "f", "fx", 2, 7)
PEAKS = (Peak(source="nvml", metric="device", bytes=5 << 20, samples=10, rate_hz=100.0, available=True),)


def sent(t0: float, wall: float, exit_code: int | None = None) -> HttpResult:
    return HttpResult(200, b"", False, t0, t0 + wall, "", exit_code)


def test_two_answered_sends_make_a_served_step_with_both_walls() -> None:
    reported = ServerPeak(4.5, "metrics.peak_memory_mb", "reserved")
    seen = Observed(None, b"png", reported)
    sends = Sends((sent(10.0, 1.0), sent(11.0, 1.2)), seen, None, None, (reported,))
    out = step_record(STEP, "default", 1, sends, 2, PEAKS, {"sends": 2})
    assert isinstance(out, Served) and out.image_bytes == b"png" and out.repeat_image is None
    r = out.record
    assert (r.status, r.attempt, r.started_at, r.wall_s, r.wall_samples_s) == (Status.OK, 1, 10.0, 1.0, (1.0, 1.2))
    assert r.deterministic is True and r.image == "fx-seed-7.png" and r.server_peak_mib == 4.5 and r.peaks == PEAKS


def test_a_repeat_that_crashes_is_that_crash_and_keeps_the_first_image() -> None:
    first = Observed(None, b"png", None)
    crash = Failure(kind=FailureClass.CRASH, message="send 2 of 2 of the same request: server died")
    sends = Sends((sent(10.0, 1.0), sent(11.0, 0.5, exit_code=-9)), first, crash, None, ())
    out = step_record(STEP, "offload", 0, sends, 2, PEAKS, {})
    assert isinstance(out, Served) and out.record.status == Status.FAILED and out.record.lost
    assert out.record.wall_samples_s == (1.0,)  # the failed send's time is not a served time
    only = step_record(STEP, "offload", 0, Sends((sent(10.0, 0.5, exit_code=1),), None, crash, None, ()), 2,
                       PEAKS, {})
    assert not isinstance(only, Served) and only.failure == crash and only.image is None
