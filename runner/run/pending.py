"""What is left to do, as a pure function of the plan and the records.

A step is done when it was attempted (ok or failed) or decided without sending: skipped as implied by a
recorded OOM, or its session's server ran out of memory at load (not retried: an OOM at load stays one).
A request cut by a stop from outside (the server SIGTERMed, its engine gone, the scheduler ended it:
cancelled, preempted, time limit, node failure) and steps
skipped for a passing reason (run interrupted, restart budget used, GPU held by someone else, a
start failure that is not memory) are to do again. Resume, the banner and the progress totals all use this.

A soak (runner.plan.soak) is done when it reached `requests` or `minutes`, met its first failure, or its server
ran out of memory at load; one that was interrupted (a signal, a request stopped from outside), found the GPU
held, or whose start failed for a reason that is not memory is continued by a resume, at its next request.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from runner.core.records import FailureClass, SessionRecord, SoakRecord, SoakRequest, StepRecord, send_again
from runner.plan.lanes import Lane, Plan, Session
from runner.plan.matrix import Soak
from runner.run.policy import start_failed


@dataclass(frozen=True)
class Pending:
    lanes: tuple[Lane, ...]  # the plan's lanes with only the sessions and steps still to do
    planned_sessions: int
    planned_steps: int
    # Cards left out of this invocation (--skip-unreachable): nothing of theirs starts, not even what runs after
    # a lane's sessions (top-ups, diagnosis passes, the soak); a resume does it
    set_aside: frozenset[str] = frozenset()

    @property
    def sessions(self) -> tuple[Session, ...]:
        return tuple(s for lane in self.lanes for s in lane.sessions)

    @property
    def steps(self) -> int:
        return sum(len(s.steps) for s in self.sessions)


def step_done(record: StepRecord) -> bool:
    """Attempted, or decided without sending; a request cut by a stop from outside (a signal, its engine
    gone, the scheduler: runner.core.records.SEND_AGAIN) measured nothing and is to do again."""
    return not send_again(record)


LOAD_OOM_SKIP = start_failed(FailureClass.OOM_AT_LOAD)


def decided(record: StepRecord) -> bool:
    """Done, or skipped because its session's server ran out of memory at load: `pending` decides those by
    the session (an OOM at load is not retried), so the progress bars count them too."""
    return step_done(record) or record.skip_reason == LOAD_OOM_SKIP


def oom_at_load(session: SessionRecord | None) -> bool:
    failure = session.start_failure if session else None
    return failure is not None and failure.kind == FailureClass.OOM_AT_LOAD


def pending(plan: Plan, steps: Iterable[StepRecord], sessions: Iterable[SessionRecord]) -> Pending:
    done = {r.key for r in steps if step_done(r)}
    decided = {s.key for s in sessions if oom_at_load(s)}
    lanes = []
    for lane in plan.lanes:
        todo = tuple(replace(s, steps=left) for s in lane.sessions if s.key not in decided
                     if (left := tuple(st for st in s.steps if st.key not in done)))
        if todo:
            lanes.append(Lane(lane.name, tuple(dict.fromkeys(s.card for s in todo)), todo))
    return Pending(tuple(lanes), len(plan.sessions), len(plan.steps))


def without_cards(todo: Pending, cards: Iterable[str]) -> Pending:
    """What is left once these cards are set aside for this invocation (their steps, top-ups and soak stay for a
    resume)."""
    drop = frozenset(cards)
    lanes = []
    for lane in todo.lanes:
        kept = tuple(s for s in lane.sessions if s.card not in drop)
        if kept:
            lanes.append(Lane(lane.name, tuple(c for c in lane.cards if c not in drop), kept))
    return Pending(tuple(lanes), todo.planned_sessions, todo.planned_steps, todo.set_aside | drop)


SOAK_ENDS = frozenset({"requests", "minutes", "failure", "oom at load"})  # what a resume does not continue


def soak_elapsed_s(requests: Iterable[SoakRequest]) -> float:
    """A soak's time so far against `minutes`: per server start, its first request's send to its last one's end."""
    spans: dict[int, tuple[float, float]] = {}
    for r in requests:
        lo, hi = spans.get(r.attempt, (r.started_at, r.started_at + r.wall_s))
        spans[r.attempt] = (min(lo, r.started_at), max(hi, r.started_at + r.wall_s))
    return sum(hi - lo for lo, hi in spans.values())


def soak_left(soak: Soak, record: SoakRecord | None, requests: list[SoakRequest]) -> int:
    """Requests a soak still owes (0: done): none once it ended for good (SOAK_ENDS) or its minutes are spent."""
    if record is not None and record.stopped in SOAK_ENDS:
        return 0
    if soak.minutes is not None and soak_elapsed_s(requests) >= soak.minutes * 60:
        return 0
    return max(0, soak.requests - len(requests))
