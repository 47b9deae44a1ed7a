"""Soak records as a soak writes them (runner.core.records.SoakRecord, SoakRequest), built from a few parameters so
a test can compute what its findings and sentences must say. Pure: nothing runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from runner.core.records import (
    Failure,
    FailureClass,
    Level,
    OomReport,
    Peak,
    ServerStart,
    SoakRecord,
    SoakRequest,
    Status,
)

MIB = 2**20
SOURCE = "server"


def request(number: int, *, references: int = 1, attempt: int = 0, wall_s: float = 1.0, floor: int | None = None,
            peak: int | None = None, failure: Failure | None = None, source: str = SOURCE,
            bound: str = "exact") -> SoakRequest:
    """Request `number` of soak c/default: served unless `failure`; `floor` and `peak` in bytes (None: no reading)."""
    floor_after = None if floor is None else Level(source=source, bytes=floor, samples=5, window_s=0.25,
                                                   bound=bound, available=True)  # type: ignore[arg-type]
    peak_read = None if peak is None else Peak(source=source, metric="device", bytes=peak, samples=8, rate_hz=20.0,
                                               available=True)
    return SoakRequest(key="c/default", number=number, attempt=attempt, references=references, fixture="pair",
                       seed=1, started_at=1000.0 + 10 * number, wall_s=wall_s,
                       status=Status.FAILED if failure is not None else Status.OK, failure=failure,
                       peak=peak_read, floor_after=floor_after)


def series(numbers: Sequence[int], *, counts: Sequence[int] = (1,), attempt: Callable[[int], int] = lambda n: 0,
           floor: Callable[[int, int, int], int | None] = lambda n, refs, a: None,
           peak: Callable[[int, int, int], int | None] = lambda n, refs, a: None,
           wall: Callable[[int, int], float] = lambda n, refs: 1.0, bound: str = "exact") -> list[SoakRequest]:
    """Served requests `numbers`, their counts cycling ascending (the soak's `cycle`); `floor(n, refs, attempt)`,
    `peak(…)` and `wall(n, refs)` give each one's readings; `bound`: what the level's source is."""
    out = []
    for n in numbers:
        refs, a = counts[(n - 1) % len(counts)], attempt(n)
        out.append(request(n, references=refs, attempt=a, floor=floor(n, refs, a), peak=peak(n, refs, a),
                           wall_s=wall(n, refs), bound=bound))
    return out


def oom(site: str = "vllm_omni/diffusion/models/qwen_image/pipeline.py:737", function: str = "forward",
        said: str = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 MiB") -> Failure:
    return Failure(kind=FailureClass.OOM, message="out of memory during the request",
                   evidence=(f"ERROR 12-05 07:51:10 [diffusion_worker.py:1870] {said}",),
                   oom=OomReport(message=said, source="server log", site=site, function=function))


def start(attempt: int) -> ServerStart:
    return ServerStart(attempt=attempt, started_at=900.0 + attempt, ready_s=1.5, failure=None, stopped_at=990.0)


def soak_record(*, requests: int, stopped: str | None, starts: int = 1, minutes: float | None = None,
                references: tuple[int, ...] = (1,), why: str | None = None,
                chosen: str = "named in [soak] flags") -> SoakRecord:
    return SoakRecord(key="c/default", card="c", flags="default", role="default",  # type: ignore[arg-type]
                      requests=requests, minutes=minutes, references=references, order="cycle", chosen=chosen,
                      starts=tuple(start(a) for a in range(starts)), stopped=stopped, why=why)  # type: ignore[arg-type]
