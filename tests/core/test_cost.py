"""What a run cost and what the next will (runner.present.cost): hand-built records with send times, no processes."""

from __future__ import annotations

from runner.core.records import (
    Failure,
    FailureClass,
    Peak,
    Sanity,
    Scores,
    SendTime,
    ServerStart,
    SessionRecord,
    Status,
    StepRecord,
)
from runner.plan.lanes import Lane, Plan, Session, Step
from runner.plan.matrix import VerdictRules
from runner.present.cost import card_costs, cost_lines, estimate, sends_of

RULES = VerdictRules(target_references=2, max_latency_ratio=2.5, min_psnr_db=20, offload_roles=("offload",),
                     max_transparent_share=0.5, min_pixel_std=2.0)
GOOD = Sanity(width=64, height=64, mode="RGB", transparent_share=0.0, pixel_std=40.0, nan_or_black=False, broken=False)
T0 = 1000.0


def ok(flags: str, n: int, at: float, walls: tuple[float, ...], resend: bool = False) -> StepRecord:
    sends, t = [], at
    for i, w in enumerate(walls):
        sends.append(SendTime(started_at=t, wall_s=w, timed=True))
        t += w
        if resend and i == 0:
            sends.append(SendTime(started_at=t, wall_s=w, timed=False))
            t += w
    return StepRecord(key=f"c/{flags}/refs-{n}/f-seed-1", card="c", flags=flags,
                      role="default" if flags == "default" else "offload",
                      fixture="f", references=n, seed=1, status=Status.OK, started_at=at, wall_s=walls[0],
                      wall_samples_s=walls, sends=tuple(sends),
                      image_sha256=f"{flags}{n}", peaks=(Peak(source="nvml", metric="device", bytes=2**30, samples=5,
                                                              rate_hz=100.0, available=True),),
                      scores=Scores(baseline="b", psnr_db=30.0, ssim=0.9, size_match=True, reason=None, sanity=GOOD))


def records() -> tuple[list[StepRecord], list[SessionRecord]]:
    # default: serves 1 at t=10 (re-sent once for determinism), OOMs at 2 (t=20): nothing served at the
    # target yet. offload: serves 1 and 2 from t=110; the verdict (offload-works) is known when its step at 2
    # is answered at t=115 with the default at 1 as its reference (ratio 2.5/2 = 1.25, its interval wide).
    default = [ok("default", 1, T0 + 10, (2.0, 2.1)),
               StepRecord(key="c/default/refs-2/f-seed-1", card="c", flags="default", role="default", fixture="f",
                          references=2, seed=1, status=Status.FAILED,
                          started_at=T0 + 20, wall_s=1.0, sends=(SendTime(started_at=T0 + 20, wall_s=1.0,
                                                                          timed=False),),
                          failure=Failure(kind=FailureClass.OOM, message="CUDA out of memory"))]
    offload = [ok("host", 1, T0 + 110, (2.5, 2.6)), ok("host", 2, T0 + 113, (2.0, 2.1))]
    sessions = [SessionRecord(key="c/default", card="c", flags="default", role="default", backend="local",
                              starts=(ServerStart(attempt=0, started_at=T0, ready_s=5.0, failure=None,
                                                  stopped_at=T0 + 30),)),
                SessionRecord(key="c/host", card="c", flags="host", role="offload", backend="local",
                              starts=(ServerStart(attempt=0, started_at=T0 + 100, ready_s=8.0, failure=None,
                                                  stopped_at=T0 + 130),))]
    return default + offload, sessions


def test_card_cost_counts_busy_time_sends_and_the_moment_the_verdict_was_known() -> None:
    steps, sessions = records()
    (c,) = card_costs(steps, sessions, RULES, T0, T0 + 200)
    assert c.world == "offload-works" and c.starts == 2
    assert c.gpu_busy_s == 30 + 30 and c.load_s == 13.0
    assert c.sends == 2 + 1 + 2 + 2 and abs(c.send_s - (2 + 2.1 + 1 + 2.5 + 2.6 + 2 + 2.1)) < 1e-9
    assert c.saved_vs_repeats_2 == (2 + 1 + 2 + 2) - 7  # fixed repeats = 2 makes the same here: 0
    assert c.known_at == T0 + 113 + 2.0  # the offload's first answer at the target
    text = "\n".join(cost_lines([c]))
    assert "## What the run cost" in text and "| c | 1:00 | 2 (13.00 s) | 7 " in text and "1:55 (offload-works)" in text


def test_a_card_whose_world_needs_every_flag_set_is_known_only_at_the_last_of_them() -> None:
    steps, sessions = records()
    oom = StepRecord(key="c/host/refs-2/f-seed-1", card="c", flags="host", role="offload", fixture="f", references=2,
                     seed=1, status=Status.FAILED, started_at=T0 + 110,
                     wall_s=1.0, sends=(SendTime(started_at=T0 + 110, wall_s=1.5, timed=False),),
                     failure=Failure(kind=FailureClass.OOM, message="CUDA out of memory"))
    steps = [*steps[:2], oom]
    (c,) = card_costs(steps, sessions, RULES, T0, None)
    assert c.world == "not-built" and c.known_at == T0 + 111.5  # not at the default's OOM (t=21)


def test_records_without_sends_are_priced_from_their_samples() -> None:
    old = StepRecord(key="c/d/refs-1/f-seed-1", card="c", flags="d", role="default", fixture="f", references=1, seed=1,
                     status=Status.OK, started_at=5.0, wall_s=2.0,
                     wall_samples_s=(2.0, 3.0), request={"sends": 2})
    assert [(s.started_at, s.wall_s, s.timed) for s in sends_of(old)] == [(5.0, 2.0, True), (7.0, 3.0, True)]


def test_estimate_prices_each_session_and_cell_from_the_earlier_run() -> None:
    steps, sessions = records()
    plan = Plan((Lane("gpu0", ("c",), (
        Session("c", "default", (Step("c", "default", "f", 1, 1), Step("c", "default", "f", 1, 2))),
        Session("c", "host", (Step("c", "host", "f", 2, 1),)),
        Session("c", "int8", (Step("c", "int8", "f", 1, 1),)))),))
    (e,) = estimate(plan, steps, sessions)
    assert e.guessed == 1 and e.starts == 3
    # default: 5 s load + 2 steps × 2 sends × 2.05 s; host: 8 s + 1 × 2 × 2.05 s; int8: mean load 6.5 s + 1 send
    # at the run's mean send time
    mean_send = (2 + 2.1 + 1 + 2.5 + 2.6 + 2 + 2.1) / 7
    assert abs(e.gpu_s - (5 + 2 * 2 * 2.05 + 8 + 2 * 2.05 + 6.5 + mean_send)) < 1e-6
    assert e.sends == 4 + 2 + 1


def test_a_pass_that_started_nothing_is_not_counted_as_one() -> None:
    """A load OOM of the real vLLM-Omni starts no pass (runner.run.diagnose): its row says why, the sum does not
    count it as a pass of 0 s."""
    from runner.core.records import NOT_RUN, DiagnosisRecord
    from runner.present.cost import diagnosis_lines

    ran = DiagnosisRecord(key="c/d", card="c", flags="d", at="oom", of="c/d/refs-3/f", references=3, started_at=0.0,
                          start_s=20.0, request_s=2.0, total_s=30.0, outcome="oom")
    skipped = ran.model_copy(update={"key": "t/d", "card": "t", "of": "t/d", "references": None, "start_s": None,
                                     "request_s": None, "total_s": 0.0, "outcome": NOT_RUN, "why_none": "its log says"})
    lines = diagnosis_lines([ran, skipped])
    assert "| t/d | oom (load) | – | – | – | not run | its log says |" in lines
    assert "1 diagnosis pass(es), 30.00 s in all (30.00 s per pass); 1 not run (the table says why)." in lines
    assert "No diagnosis pass was run; 1 not run (the table says why)." in diagnosis_lines([skipped])
