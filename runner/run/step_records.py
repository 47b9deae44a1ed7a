"""A step's record from what was sent (pure): the sends as runner.run.sending timed them in, the record out; no
server, no file, no clock. runner.run.execute decides and writes; this module says what the sends and the meters'
windows amount to.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from runner.core.records import Failure, FailureClass, Level, Peak, SendTime, SoakRequest, Status, StepRecord
from runner.core.registry import METERS
from runner.core.vocab import MemoryMetric, Role
from runner.observe.failures import CLUSTER_CLASS
from runner.plan.lanes import Step
from runner.run import dialects

# A failure after which the server is restarted before the next step (the step's server is gone or stuck)
RESTART_AFTER = {FailureClass.CRASH, FailureClass.TIMEOUT, FailureClass.STOPPED}
RESPONSE_SOURCE = "server-response"  # the registry's entry for a peak the server reports in its response


@dataclass(frozen=True)
class HttpResult:
    """One send of a request: what came back, when, and what the server wrote to its log meanwhile."""

    status: int | None  # HTTP status; None when no response came
    content: bytes
    timed_out: bool
    t0: float  # epoch seconds at send
    t1: float  # epoch seconds at response (or failure)
    log_window: str  # server log written between send and response (+ a short grace), quoted
    exit_code: int | None  # the server's exit code when it died meanwhile
    oom_killed: bool = False  # ... killed by the kernel's OOM killer (host memory)
    problem: str | None = None  # the answer was refused unread (body over the cap)

    @property
    def wall_s(self) -> float:
        return round(self.t1 - self.t0, 4)


@dataclass(frozen=True)
class Observed:
    """A send classified: a failure, or the image's bytes (decoded later, off the request path)."""

    failure: Failure | None
    image_bytes: bytes | None
    server_peak: dialects.ServerPeak | None  # the response's own peak_memory_mb, where and what
    peak_unread: str | None = None  # the response named a peak that is no reading (0.0: not measured)
    stage_durations: dict[str, float] | None = None  # the response's metrics.stage_durations


@dataclass(frozen=True)
class Sends:
    """One step's request sent back to back: each send (timed ones first), and what came of them."""

    sends: tuple[HttpResult, ...]
    first: Observed | None  # the first answered send
    failure: Failure | None  # the send that ended it, when one failed
    different: bytes | None  # the first send whose image bytes differ from the step's image
    reported: tuple[dialects.ServerPeak, ...]  # the server's own peaks, as the responses gave them
    unread: tuple[str, ...] = ()  # why a response's named peak was no reading, per such response

    @property
    def t0(self) -> float:
        return self.sends[0].t0

    @property
    def t1(self) -> float:
        return self.sends[-1].t1


@dataclass(frozen=True)
class Served:
    """A step whose request was answered with an image: scored and written off the request path."""

    record: StepRecord  # without scores yet
    image_bytes: bytes  # the first send's image, not decoded yet
    repeat_image: bytes | None  # the first repeat whose bytes differ from the first image


def skipped(step: Step, role: str, reason: str, implied_by: str | None = None) -> StepRecord:
    return StepRecord(key=step.key, card=step.card, flags=step.flags, role=Role(role), fixture=step.fixture,
                      references=step.references, seed=step.seed, status=Status.SKIPPED, skip_reason=reason,
                      implied_by=implied_by)


def _failed(record: StepRecord, failure: Failure, last: HttpResult) -> StepRecord:
    """The record ended by a failing send; `lost` when the server died, is stuck, or the scheduler ended it
    (its exit may not be seen yet when the request fails)."""
    lost = failure.kind in RESTART_AFTER or failure.kind in CLUSTER_CLASS.values() or last.exit_code is not None
    return record.model_copy(update={"status": Status.FAILED, "failure": failure, "lost": lost})


def _send_times(sends: Sends, timed: int) -> tuple[tuple[float, ...], tuple[SendTime, ...]]:
    """The timed wall times (a failed send's time is not a served time) and every send's timing."""
    last = sends.sends[-1]
    samples = tuple(s.wall_s for s in sends.sends[:timed] if s is not last or sends.failure is None)
    return samples, tuple(SendTime(started_at=s.t0, wall_s=s.wall_s, timed=i < len(samples))
                          for i, s in enumerate(sends.sends))


def step_record(step: Step, role: str, attempt: int, sends: Sends, timed: int, peaks: tuple[Peak, ...],
                request: dict[str, object]) -> StepRecord | Served:
    """The step's record from its sends: a failure (with the first send's image kept when it was served),
    or a served step whose image is scored off the request path."""
    failure, first, reported = sends.failure, sends.first, sends.reported
    samples, times = _send_times(sends, timed)
    base = StepRecord(
        key=step.key, card=step.card, flags=step.flags, role=Role(role), fixture=step.fixture,
        references=step.references, seed=step.seed, status=Status.OK, attempt=attempt, started_at=sends.t0,
        wall_s=sends.sends[0].wall_s, wall_samples_s=samples, sends=times, peaks=peaks, request=dict(request),
        server_peak_mib=reported[0].mib if reported else None,
        server_peak_source=reported[0].source if reported else None,
        server_peak_measures=reported[0].measures if reported else None,
        server_stage_durations_s=(first.stage_durations or {}) if first else {})
    image = Path(step.key).name + ".png"
    if failure is not None:
        record = _failed(base, failure, sends.sends[-1])
        if first is None or first.image_bytes is None:
            return record
        # The first send was served: keep its image beside the failure (scored like any other).
        return Served(record.model_copy(update={"image": image,
                                                "image_sha256": hashlib.sha256(first.image_bytes).hexdigest()}),
                      first.image_bytes, None)
    assert first is not None and first.image_bytes is not None
    compared = len(sends.sends) > 1
    return Served(base.model_copy(update={"image": image,
                                          "image_sha256": hashlib.sha256(first.image_bytes).hexdigest(),
                                          "deterministic": (sends.different is None) if compared else None}),
                  first.image_bytes, sends.different)


def soak_request(key: str, number: int, step: Step, attempt: int, sends: Sends, peaks: tuple[Peak, ...],
                 floors: tuple[Level, ...], undecodable: str | None = None) -> SoakRequest:
    """A soak request's light record from its one send: failed as the matrix classifies a send (an image that does
    not decode is a bad response, as the matrix's scoring finds it), its device peak and the level it left: the
    first source with a figure in the card's meter order, else the first saying why it has none."""
    failure = sends.failure
    if failure is None and undecodable is not None:
        failure = Failure(kind=FailureClass.BAD_RESPONSE, message=undecodable, evidence=())
    device = [p for p in peaks if p.metric == MemoryMetric.DEVICE]
    return SoakRequest(key=key, number=number, attempt=attempt, references=step.references, fixture=step.fixture,
                       seed=step.seed, started_at=sends.t0, wall_s=sends.sends[0].wall_s,
                       status=Status.OK if failure is None else Status.FAILED, failure=failure,
                       peak=next((p for p in device if p.available), device[0] if device else None),
                       floor_after=_best(floors))


def _best(levels: tuple[Level, ...]) -> Level | None:
    """The level a soak request keeps: the server's exact figure where it has one, else the first available
    (meter order), else the first, saying why it is not there."""
    read = [lv for lv in levels if lv.available]
    return next((lv for lv in read if lv.bound == "exact"), read[0] if read else levels[0] if levels else None)


def topped_up(old: StepRecord, sends: Sends, peaks: tuple[Peak, ...], repeat_psnr_db: float | None) -> StepRecord:
    """A recorded, served step after `repeats = "auto"` sent its request again: the new timed samples, sends,
    peaks and determinism added; a failing send ends the step as that failure (it did not reliably serve)."""
    samples, times = _send_times(sends, len(sends.sends))
    earlier = old.wall_samples_s or ((old.wall_s,) if old.wall_s else ())
    record = old.model_copy(update={
        "wall_samples_s": (*earlier, *samples), "sends": (*old.sends, *times), "peaks": merge_peaks(old.peaks, peaks),
        "request": {**old.request, "sends": int(old.request.get("sends", 1)) + len(times)},
        "deterministic": (old.deterministic is not False) and sends.different is None,
        "repeat_psnr_db": old.repeat_psnr_db if old.repeat_psnr_db is not None else repeat_psnr_db})
    return record if sends.failure is None else _failed(record, sends.failure, sends.sends[-1])


def with_response_peak(peaks: list[Peak], peak_mb: float | None, unread: str | None = None) -> tuple[Peak, ...]:
    """A `peak_memory_mb` in the response is the server's own exact peak for this request: it goes right
    before the polled server meter (which can miss a transient between polls), or last if none is listed.
    A named peak that is no reading (`unread`: vLLM-Omni's 0.0, "not measured") is listed as unavailable
    there, so the step's figure falls back to the next source."""
    if peak_mb is None and unread is None:
        return tuple(peaks)
    reported = Peak(source=RESPONSE_SOURCE, metric=MemoryMetric.DEVICE, bytes=int(peak_mb * 2**20), samples=1,
                    rate_hz=None, available=True) if peak_mb is not None else \
        Peak(source=RESPONSE_SOURCE, metric=MemoryMetric.DEVICE, bytes=None, samples=0, rate_hz=None,
             available=False, reason=f"unavailable: {unread}")
    refines = METERS.get(RESPONSE_SOURCE).refines
    at = next((i for i, p in enumerate(peaks) if p.source == refines), len(peaks))
    return (*peaks[:at], reported, *peaks[at:])


def merge_peaks(old: tuple[Peak, ...], new: tuple[Peak, ...]) -> tuple[Peak, ...]:
    """A step's peaks after more sends of its request: per source and metric the higher available figure
    (the same request may peak higher on a later send), in the order the step listed them."""
    fresh = {(p.source, p.metric): p for p in new}
    out = []
    for p in old:
        q = fresh.pop((p.source, p.metric), None)
        better = q is not None and q.available and (not p.available or (q.bytes or 0) > (p.bytes or 0))
        out.append(q.model_copy(update={"samples": q.samples + p.samples}) if better and q is not None else p)
    return (*out, *fresh.values())


def max_by_source(peaks: list[Peak]) -> tuple[Peak, ...]:
    """One session peak per (source, metric) over all server starts."""
    best: dict[tuple[str, str], Peak] = {}
    for p in peaks:
        k = (p.source, p.metric)
        old = best.get(k)
        if old is None or (p.available and (not old.available or (p.bytes or 0) > (old.bytes or 0))):
            best[k] = p if old is None or not old.available else p.model_copy(
                update={"samples": p.samples + old.samples})
    return tuple(best.values())
