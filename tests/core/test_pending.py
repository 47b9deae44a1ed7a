"""Pending work as a pure function of plan + records (runner.run.pending)."""

from __future__ import annotations

from runner.core.records import Failure, FailureClass, ServerStart, SessionRecord, Status, StepRecord
from runner.plan.lanes import Lane, Plan, Session, Step
from runner.run.pending import pending, without_cards


def plan() -> Plan:
    def session(card: str, flags: str) -> Session:
        return Session(card, flags, tuple(Step(card, flags, "f", n, 1) for n in (1, 2, 3)))

    return Plan((Lane("a", ("a",), (session("a", "default"), session("a", "offload"))),
                 Lane("b", ("b",), (session("b", "default"),))))


def record(key: str, status: Status, **kw) -> StepRecord:
    card, flags, refs, _ = key.split("/")
    return StepRecord(key=key, card=card, flags=flags, role="default", fixture="f", references=int(refs[5:]),
                      seed=1, status=status, **kw)


def test_no_records_everything_pending() -> None:
    p = pending(plan(), [], [])
    assert p.steps == 9 == p.planned_steps and len(p.sessions) == 3 == p.planned_sessions


def test_finished_run_nothing_pending_oom_and_implied_skips_count_as_done() -> None:
    steps = [record("a/default/refs-1/f-seed-1", Status.OK),
             record("a/default/refs-2/f-seed-1", Status.FAILED, failure=Failure(kind=FailureClass.OOM, message="oom")),
             record("a/default/refs-3/f-seed-1", Status.SKIPPED, skip_reason="implied",
                    implied_by="a/default/refs-2/f-seed-1")]
    steps += [record(f"a/offload/refs-{n}/f-seed-1", Status.OK) for n in (1, 2, 3)]
    # card b's server ran out of memory at load: its skipped steps are decided, not missing
    steps += [record(f"b/default/refs-{n}/f-seed-1", Status.SKIPPED, skip_reason="server did not start: oom_at_load")
              for n in (1, 2, 3)]
    load_oom = SessionRecord(key="b/default", card="b", flags="default", role="default", backend="local",
                             starts=(ServerStart(attempt=0, started_at=0.0, ready_s=None,
                                                 failure=Failure(kind=FailureClass.OOM_AT_LOAD,
                                                                 message="oom at load")),))
    p = pending(plan(), steps, [load_oom])
    assert p.steps == 0 and p.lanes == ()


def test_passing_skips_are_pending_again() -> None:
    steps = [record("a/default/refs-1/f-seed-1", Status.OK),
             record("a/default/refs-2/f-seed-1", Status.SKIPPED, skip_reason="run interrupted"),
             record("b/default/refs-1/f-seed-1", Status.SKIPPED, skip_reason="server did not start: load_exit")]
    not_oom = SessionRecord(key="b/default", card="b", flags="default", role="default", backend="local",
                            starts=(ServerStart(attempt=0, started_at=0.0, ready_s=None,
                                                failure=Failure(kind=FailureClass.LOAD_EXIT, message="exit 1")),))
    p = pending(plan(), steps, [not_oom])
    by_key = {s.key: [st.references for st in s.steps] for s in p.sessions}
    assert by_key == {"a/default": [2, 3], "a/offload": [1, 2, 3], "b/default": [1, 2, 3]}
    assert p.steps == 8


def test_a_step_the_scheduler_ended_is_to_do_again_for_resume_and_the_verdict() -> None:
    # issue 30 S-1: a step recorded `cancelled` / `preempted` / `time_limit` / `node_failure` with `lost`
    # measured nothing; resume (and the banner: the same Pending) sends it again, and the verdict says so.
    from runner.judge.verdict import VerdictRules, blocked

    ended = [FailureClass.CANCELLED, FailureClass.PREEMPTED, FailureClass.TIME_LIMIT, FailureClass.NODE_FAILURE,
             FailureClass.STOPPED]
    for kind in ended:
        lost = record("a/default/refs-2/f-seed-1", Status.FAILED, lost=True,
                      failure=Failure(kind=kind, message="server cancelled at step 4242.1"))
        steps = [record("a/default/refs-1/f-seed-1", Status.OK), lost, record("a/default/refs-3/f-seed-1", Status.OK)]
        steps += [record(f"a/offload/refs-{n}/f-seed-1", Status.OK) for n in (1, 2, 3)]
        steps += [record(f"b/default/refs-{n}/f-seed-1", Status.OK) for n in (1, 2, 3)]
        p = pending(plan(), steps, [])
        assert [(s.key, [st.references for st in s.steps]) for s in p.sessions] == [("a/default", [2])], kind
        why = blocked("default", "default", 2, steps, None, VerdictRules()).why
        assert why.endswith("not a measurement: a resume sends it again"), why
    # what the server itself did stays done: a crash, a timeout, an OOM with the server lost
    for kind in (FailureClass.CRASH, FailureClass.TIMEOUT, FailureClass.OOM):
        done = record("a/default/refs-1/f-seed-1", Status.FAILED, lost=True, failure=Failure(kind=kind, message="x"))
        assert "a/default" not in {s.key for s in pending(plan(), [done], []).sessions if len(s.steps) == 3}
        assert "resume" not in blocked("default", "default", 1, [done], None, VerdictRules()).why


def test_cards_set_aside_leave_their_steps_and_are_remembered_for_what_runs_after_the_sessions() -> None:
    """--skip-unreachable: a card set aside has no session in this invocation, and the executor keeps it out of the
    top-ups, diagnosis passes and soak that run after a lane's sessions (they read `set_aside`)."""
    todo = without_cards(pending(plan(), [], []), ["b"])
    assert todo.steps == 6 and [lane.name for lane in todo.lanes] == ["a"] and todo.set_aside == {"b"}
    both = without_cards(todo, ["a"])
    assert both.lanes == () and both.set_aside == {"a", "b"} and both.planned_steps == 9
