"""The session policy as a pure function: given what just happened, what happens next.

`next_action(state, outcome) -> (state, action)` holds every rule of a session — the idle-GPU gate before
each server start, no retry after a failed start, the restart budget after a lost server, OOM-implied skips,
the first-step determinism re-send and, under `repeats = "auto"`, the look at the records after the last
step and the top-up sends it asks for — so they are tested with hand-built outcomes (tests/core/
test_policy.py) and the executor is a thin loop that performs actions and reports outcomes.

`topups` is the auto rule itself: which recorded steps of a session get how many more timed sends, given the
latency ratios that are still open (runner.judge.verdict.open_latencies) and the levels of runner.plan.sequential.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from runner.core.records import FailureClass, Status, StepRecord
from runner.plan import sequential
from runner.plan.lanes import Step


@dataclass(frozen=True)
class Rules:
    restarts: int  # server restarts allowed per session after it died or hung
    stop_after_oom: bool  # an OOM at n references implies the larger counts
    oom_implies_seeds: bool  # ... and the remaining seeds of the same fixture at n
    determinism_resend: bool  # send the first step once more (only when repeats are not compared instead)
    gpu_gate: bool  # check the device is idle before each server start
    auto_repeats: bool = False  # after the last step, look at the records for top-up sends


@dataclass(frozen=True)
class Oom:
    references: int
    fixture: str
    key: str  # the deciding step


@dataclass(frozen=True)
class TopUp:
    key: str  # a recorded step, sent again
    sends: int  # timed sends to add


@dataclass(frozen=True)
class State:
    rules: Rules
    pending: tuple[Step, ...]
    attempt: int  # number of the next server start (continues across resumes)
    restarts_used: int = 0
    server_up: bool = False
    ooms: tuple[Oom, ...] = ()
    determinism_done: bool = False
    topups: tuple[TopUp, ...] = ()  # top-up sends still to make


# -- outcomes (what the I/O loop observed) ----------------------------------------------------------------
@dataclass(frozen=True)
class Begin:
    pass


@dataclass(frozen=True)
class IdleChecked:
    stop_reason: str | None  # why the device is not usable (held by someone else, cannot be verified)


@dataclass(frozen=True)
class Started:
    failure: FailureClass | None  # None: the server is ready


@dataclass(frozen=True)
class Sent:
    step: Step
    failure: FailureClass | None  # None: served (whatever its scores)
    lost: bool  # the server died or hung: it must not serve the next step


@dataclass(frozen=True)
class Looked:
    topups: tuple[TopUp, ...]  # what the records ask for now; () when nothing is open


@dataclass(frozen=True)
class SentMore:
    topup: TopUp
    failure: FailureClass | None
    lost: bool


@dataclass(frozen=True)
class Skipped:
    pass


@dataclass(frozen=True)
class Interrupted:
    pass


Outcome = Begin | IdleChecked | Started | Sent | Looked | SentMore | Skipped | Interrupted


# -- actions (what the I/O loop does next) ----------------------------------------------------------------
@dataclass(frozen=True)
class CheckIdle:
    pass


@dataclass(frozen=True)
class Start:
    attempt: int  # a server already running is stopped first


@dataclass(frozen=True)
class Send:
    step: Step
    determinism_resend: bool  # send it once more, untimed, and compare the image bytes


@dataclass(frozen=True)
class Look:
    """Wait for every record of this session to be written, then ask `topups` what is still open."""


@dataclass(frozen=True)
class SendMore:
    topup: TopUp


@dataclass(frozen=True)
class Skip:
    steps: tuple[Step, ...]
    reason: str
    implied_by: str | None = None  # the deciding step's key when an OOM implies these


@dataclass(frozen=True)
class Finish:
    pass


Action = CheckIdle | Start | Send | Look | SendMore | Skip | Finish


def initial(rules: Rules, todo: Iterable[Step], recorded: Iterable[StepRecord], attempt: int,
            topups: Iterable[TopUp] = ()) -> State:
    """The state a session (re)starts from: its steps still to do, and what its records already decided —
    an OOM recorded before a resume still implies, a determinism check already made is not repeated."""
    recorded = list(recorded)
    ooms = tuple(Oom(r.references, r.fixture, r.key) for r in recorded
                 if rules.stop_after_oom and r.failure is not None and r.failure.kind == FailureClass.OOM)
    checked = any(r.deterministic is not None for r in recorded if r.status == Status.OK)
    return State(rules, tuple(todo), attempt, ooms=ooms, determinism_done=checked, topups=tuple(topups))


def implied_by(state: State, step: Step) -> Oom | None:
    """The OOM that decides this step without sending it: one at fewer references, or (unless the matrix
    opts out) one at the same count and fixture with another seed — memory does not depend on the seed."""
    deciding = [o for o in state.ooms if step.references > o.references
                or (state.rules.oom_implies_seeds and step.references == o.references
                    and step.fixture == o.fixture)]
    return min(deciding, key=lambda o: o.references) if deciding else None


def start_failed(failure: FailureClass) -> str:
    """The skip reason of a session's steps when its server did not start."""
    return f"server did not start: {failure}"


def next_action(state: State, outcome: Outcome) -> tuple[State, Action]:
    match outcome:
        case Interrupted():
            return _skip_all(replace(state, server_up=False), "run interrupted")
        case Begin():
            return _start(state)
        case IdleChecked(stop_reason=reason) if reason is not None:
            return _skip_all(state, reason)
        case IdleChecked():
            return state, Start(state.attempt)
        case Started(failure=failure) if failure is not None:
            # Load failures are not retried: an OOM at load stays an OOM, a bad command stays bad.
            return _skip_all(replace(state, attempt=state.attempt + 1), start_failed(failure))
        case Started():
            return _next_step(replace(state, server_up=True, attempt=state.attempt + 1))
        case Sent(step=step, failure=failure, lost=lost):
            if failure == FailureClass.OOM and state.rules.stop_after_oom:
                state = replace(state, ooms=(*state.ooms, Oom(step.references, step.fixture, _key(step))))
            return _after_send(state, lost)
        case SentMore(lost=lost):
            return _after_send(state, lost)
        case Looked(topups=topups):
            return _next_step(replace(state, topups=topups)) if topups else (state, Finish())
        case Skipped():
            return _next_step(state) if state.server_up else _start(state)
    raise TypeError(f"not an outcome: {outcome!r}")


def _after_send(state: State, lost: bool) -> tuple[State, Action]:
    if not lost:
        return _next_step(state)
    state = replace(state, server_up=False)
    if not state.pending and not state.topups:
        return state, Finish()
    if state.restarts_used >= state.rules.restarts:
        return _skip_all(state, f"server died and {state.rules.restarts} restart(s) were used")
    return _start(replace(state, restarts_used=state.restarts_used + 1))


def _key(step: Step) -> str:
    return step.key


def _start(state: State) -> tuple[State, Action]:
    """A server is started only for a step that will be sent: steps already implied are skipped first."""
    if not state.pending and not state.topups:
        return state, Finish()
    if state.pending and (implied := _implied_skip(state)) is not None:
        return implied
    return state, (CheckIdle() if state.rules.gpu_gate else Start(state.attempt))


def _implied_skip(state: State) -> tuple[State, Action] | None:
    step = state.pending[0]
    if (oom := implied_by(state, step)) is None:
        return None
    return replace(state, pending=state.pending[1:]), Skip(
        (step,), f"implied by an out-of-memory at {oom.references} reference(s) in this session ({oom.key})",
        implied_by=oom.key)


def _skip_all(state: State, reason: str) -> tuple[State, Action]:
    state = replace(state, topups=())  # top-ups are never recorded as skipped: their steps are recorded
    if not state.pending:
        return state, Finish()
    return replace(state, pending=()), Skip(state.pending, reason)


def _next_step(state: State) -> tuple[State, Action]:
    if not state.pending:
        if state.topups:
            return replace(state, topups=state.topups[1:]), SendMore(state.topups[0])
        return (state, Look()) if state.rules.auto_repeats and state.server_up else (state, Finish())
    if (implied := _implied_skip(state)) is not None:
        return implied
    step, rest = state.pending[0], state.pending[1:]
    resend = state.rules.determinism_resend and not state.determinism_done
    return replace(state, pending=rest, determinism_done=True), Send(step, resend)


def level(cell: Iterable[StepRecord]) -> int:
    """Timed sends per step a cell has reached: the fewest among its steps."""
    return min((len(r.wall_samples_s) or 1 for r in cell), default=0)


def topups(open_sides: Iterable[tuple[tuple[str, int], tuple[str, int] | None]], records: Iterable[StepRecord],
           card: str, flags: str, max_repeats: int) -> tuple[TopUp, ...]:
    """The top-up sends the session card/flags makes now, for the open latency ratios given by their two sides
    ((flags, references) of the offload cell and of its reference; None: a recorded baseline time). A side
    climbs runner.plan.sequential.levels one level at a time and only while it is not ahead of the other side, so
    the side whose server is up goes first and every ratio is looked at in at most sequential.looks states."""
    mine = [r for r in records if r.card == card and r.status == Status.OK]

    def cell(side: tuple[str, int]) -> list[StepRecord]:
        return [r for r in mine if (r.flags, r.references) == side]

    want: dict[str, int] = {}
    for off, ref in open_sides:
        for own, other in ((off, ref), (ref, off)):
            if own is None or own[0] != flags or not (steps := cell(own)):
                continue
            if other is not None and level(cell(other)) < level(steps):
                continue  # the other side catches up first (at its own session)
            target = sequential.next_level(level(steps), max_repeats)
            if target is None:
                continue  # this side is at max_repeats
            for r in steps:
                want[r.key] = max(want.get(r.key, 0), target - (len(r.wall_samples_s) or 1))
    return tuple(TopUp(k, n) for k, n in want.items() if n > 0)
