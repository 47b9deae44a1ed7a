"""Issue 18 item 3: a default flag set that says nothing about memory (a hang, a crash without OOM text, a
server stopped from outside) never lets the card be offload-works, and a request cut by a SIGTERM from
outside (`crash … code 143` before) is a `stopped` failure that a resume sends again."""

from __future__ import annotations

import pytest

from runner.core.records import (
    Failure,
    FailureClass,
    Peak,
    Sanity,
    Scores,
    ServerStart,
    SessionRecord,
    Status,
    StepRecord,
)
from runner.judge.decision import World
from runner.judge.verdict import decide
from runner.observe.failures import classify_request
from runner.plan.matrix import VerdictRules
from runner.run.pending import step_done

RULES = VerdictRules(target_references=2, max_latency_ratio=2.5, min_psnr_db=20, offload_roles=("offload",),
                     max_transparent_share=0.5, min_pixel_std=2.0)
GOOD = Sanity(width=64, height=64, mode="RGB", transparent_share=0.0, pixel_std=40.0, nan_or_black=False, broken=False)


def step(flags: str, role: str, n: int, kind: FailureClass | None = None, *, wall: float = 1.0) -> StepRecord:
    status = Status.FAILED if kind else Status.OK
    return StepRecord(key=f"c/{flags}/refs-{n}/f-seed-1", card="c", flags=flags, role=role, fixture="f",
                      references=n, seed=1, status=status, wall_s=wall, wall_samples_s=(wall, wall * 1.01),
                      failure=Failure(kind=kind, message="no response within the request deadline") if kind else None,
                      image_sha256=None if kind else f"{flags}{n}",
                      peaks=(Peak(source="nvml", metric="device", bytes=2**30, samples=100, rate_hz=100.0,
                                  available=True),),
                      scores=None if kind else Scores(baseline="b", psnr_db=30.0, ssim=0.9, size_match=True,
                                                      reason=None, sanity=GOOD))


def session(flags: str, role: str) -> SessionRecord:
    return SessionRecord(key=f"c/{flags}", card="c", flags=flags, role=role, backend="local",
                         starts=(ServerStart(attempt=0, started_at=0.0, ready_s=1.0, failure=None),))


@pytest.mark.parametrize("name", ["timeout", "crash", "stopped"])
def test_default_that_says_nothing_about_memory_makes_the_card_undecided(name: str) -> None:
    kind = FailureClass(name)
    steps = [step("default", "default", 1), step("default", "default", 2, kind),
             step("host", "offload", 1, wall=1.2), step("host", "offload", 2, wall=1.5)]
    v = decide("c", steps, [session("default", "default"), session("host", "offload")], RULES)
    assert v.world == World.UNDECIDED, v.reason
    assert v.to_json()["evidence"]["blocking"][0]["record"] == "c/default/refs-2/f-seed-1"
    assert any("offload 'host' serves 2 reference(s), which decides nothing" in n for n in v.notes), v.notes


def test_default_out_of_memory_still_gives_offload_works() -> None:
    steps = [step("default", "default", 1), step("default", "default", 2, FailureClass.OOM),
             step("host", "offload", 1, wall=1.2), step("host", "offload", 2, wall=1.5)]
    v = decide("c", steps, [session("default", "default"), session("host", "offload")], RULES)
    assert v.world == World.OFFLOAD_WORKS and v.flags == "host"


@pytest.mark.parametrize(("code", "signal"), [(143, "SIGTERM"), (-15, "SIGTERM"), (129, "SIGHUP"), (-2, "SIGINT")])
def test_a_server_stopped_from_outside_is_stopped_not_crash(code: int, signal: str) -> None:
    f = classify_request(http_status=None, body="", log_window="INFO: Shutting down\n", timed_out=False,
                         server_exit=code, parse_problem=None)
    assert f is not None and f.kind == FailureClass.STOPPED and signal in f.message and f.exit_code == code
    record = StepRecord(key="c/d/refs-1/f-seed-1", card="c", flags="d", role="default", fixture="f",
                        references=1, seed=1, status=Status.FAILED, failure=f, lost=True)
    assert not step_done(record)  # a resume sends it again


def test_a_crash_and_an_oom_exit_stay_what_they_are() -> None:
    crash = classify_request(http_status=None, body="", log_window="Segmentation fault\n", timed_out=False,
                             server_exit=139, parse_problem=None)
    assert crash is not None and crash.kind == FailureClass.CRASH
    oom = classify_request(http_status=None, body="", log_window="torch.OutOfMemoryError: CUDA out of memory\n",
                           timed_out=False, server_exit=143, parse_problem=None)
    assert oom is not None and oom.kind == FailureClass.OOM
    killed = classify_request(http_status=None, body="", log_window="", timed_out=False, server_exit=137,
                              parse_problem=None)
    assert killed is not None and killed.kind != FailureClass.STOPPED  # SIGKILL: the OOM killer sends it too
