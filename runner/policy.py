"""The session policy as a pure function: given what just happened, what happens next.

`next_action(state, outcome) -> (state, action)` holds every rule of a session — the idle-GPU gate before
each server start, no retry after a failed start, the restart budget after a lost server, OOM-implied skips
and the first-step determinism re-send — so they are tested with hand-built outcomes (tests/core/
test_policy.py) and the executor is a thin loop that performs actions and reports outcomes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from runner.plan import Step
from runner.records import FailureClass, Status, StepRecord


@dataclass(frozen=True)
class Rules:
    restarts: int  # server restarts allowed per session after it died or hung
    stop_after_oom: bool  # an OOM at n references implies the larger counts
    oom_implies_seeds: bool  # ... and the remaining seeds of the same fixture at n
    determinism_resend: bool  # send the first step once more (only when repeats are not compared instead)
    gpu_gate: bool  # check the device is idle before each server start


@dataclass(frozen=True)
class Oom:
    references: int
    fixture: str
    key: str  # the deciding step


@dataclass(frozen=True)
class State:
    rules: Rules
    pending: tuple[Step, ...]
    attempt: int  # number of the next server start (continues across resumes)
    restarts_used: int = 0
    server_up: bool = False
    ooms: tuple[Oom, ...] = ()
    determinism_done: bool = False


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
class Skipped:
    pass


@dataclass(frozen=True)
class Interrupted:
    pass


Outcome = Begin | IdleChecked | Started | Sent | Skipped | Interrupted


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
class Skip:
    steps: tuple[Step, ...]
    reason: str
    implied_by: str | None = None  # the deciding step's key when an OOM implies these


@dataclass(frozen=True)
class Finish:
    pass


Action = CheckIdle | Start | Send | Skip | Finish


def initial(rules: Rules, todo: Iterable[Step], recorded: Iterable[StepRecord], attempt: int) -> State:
    """The state a session (re)starts from: its steps still to do, and what its records already decided —
    an OOM recorded before a resume still implies, a determinism check already made is not repeated."""
    recorded = list(recorded)
    ooms = tuple(Oom(r.references, r.fixture, r.key) for r in recorded
                 if rules.stop_after_oom and r.failure is not None and r.failure.kind == FailureClass.OOM)
    checked = any(r.deterministic is not None for r in recorded if r.status == Status.OK)
    return State(rules, tuple(todo), attempt, ooms=ooms, determinism_done=checked)


def implied_by(state: State, step: Step) -> Oom | None:
    """The OOM that decides this step without sending it: one at fewer references, or (unless the matrix
    opts out) one at the same count and fixture with another seed — memory does not depend on the seed."""
    deciding = [o for o in state.ooms if step.references > o.references
                or (state.rules.oom_implies_seeds and step.references == o.references
                    and step.fixture == o.fixture)]
    return min(deciding, key=lambda o: o.references) if deciding else None


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
            return _skip_all(replace(state, attempt=state.attempt + 1), f"server did not start: {failure}")
        case Started():
            return _next_step(replace(state, server_up=True, attempt=state.attempt + 1))
        case Sent(step=step, failure=failure, lost=lost):
            if failure == FailureClass.OOM and state.rules.stop_after_oom:
                state = replace(state, ooms=(*state.ooms, Oom(step.references, step.fixture, _key(step))))
            if not lost:
                return _next_step(state)
            state = replace(state, server_up=False)
            if not state.pending:
                return state, Finish()
            if state.restarts_used >= state.rules.restarts:
                return _skip_all(state, f"server died and {state.rules.restarts} restart(s) were used")
            return _start(replace(state, restarts_used=state.restarts_used + 1))
        case Skipped():
            return _next_step(state) if state.server_up else _start(state)
    raise TypeError(f"not an outcome: {outcome!r}")


def _key(step: Step) -> str:
    return step.key


def _start(state: State) -> tuple[State, Action]:
    """A server is started only for a step that will be sent: steps already implied are skipped first."""
    if not state.pending:
        return state, Finish()
    if (implied := _implied_skip(state)) is not None:
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
    if not state.pending:
        return state, Finish()
    return replace(state, pending=()), Skip(state.pending, reason)


def _next_step(state: State) -> tuple[State, Action]:
    if not state.pending:
        return state, Finish()
    if (implied := _implied_skip(state)) is not None:
        return implied
    step, rest = state.pending[0], state.pending[1:]
    resend = state.rules.determinism_resend and not state.determinism_done
    return replace(state, pending=rest, determinism_done=True), Send(step, resend)
