"""The session policy as a pure function (runner.run.policy): hand-built outcomes, no processes."""

from __future__ import annotations

from runner.core.records import Failure, FailureClass, Status, StepRecord
from runner.plan.lanes import Step
from runner.run import policy
from runner.run.policy import Begin, CheckIdle, Finish, IdleChecked, Rules, Send, Sent, Skip, Skipped, Start, Started

RULES = Rules(restarts=1, stop_after_oom=True, oom_implies_seeds=True, determinism_resend=True, gpu_gate=False)


def steps(refs=(1, 2, 3, 4), seeds=(1, 2), fixtures=("f",)) -> tuple[Step, ...]:
    return tuple(Step("c", "default", fx, n, s) for n in refs for fx in fixtures for s in seeds)


def drive(state: policy.State, answer) -> list:
    """Run the policy to Finish; `answer(action)` plays the I/O loop. Returns the actions taken."""
    actions, outcome = [], Begin()
    for _ in range(1000):
        state, action = policy.next_action(state, outcome)
        actions.append(action)
        if isinstance(action, Finish):
            return actions
        outcome = answer(action)
    raise AssertionError("no Finish")


def serve_all(action):
    match action:
        case CheckIdle():
            return IdleChecked(None)
        case Start():
            return Started(None)
        case Send(step=step):
            return Sent(step, None, False)
        case Skip():
            return Skipped()


def sent(actions) -> list[Step]:
    return [a.step for a in actions if isinstance(a, Send)]


def skipped(actions) -> list[tuple[Step, Skip]]:
    return [(s, a) for a in actions if isinstance(a, Skip) for s in a.steps]


def test_everything_served_one_start_and_the_first_step_resent_once() -> None:
    actions = drive(policy.initial(RULES, steps(), [], attempt=0), serve_all)
    assert [a for a in actions if isinstance(a, Start)] == [Start(0)]
    assert sent(actions) == list(steps())
    assert [a.determinism_resend for a in actions if isinstance(a, Send)] == [True] + [False] * 7


def test_determinism_already_checked_before_a_resume_is_not_resent() -> None:
    first = steps()[0]
    record = StepRecord(key=first.key, card="c", flags="default", role="default", fixture="f", references=1, seed=1,
                        status=Status.OK, deterministic=True)
    actions = drive(policy.initial(RULES, steps()[1:], [record], attempt=1), serve_all)
    assert not any(a.determinism_resend for a in actions if isinstance(a, Send))
    assert [a for a in actions if isinstance(a, Start)] == [Start(1)]  # numbering continues


def test_oom_implies_larger_counts_and_the_other_seeds_at_that_count() -> None:
    def oom_at_2(action):
        if isinstance(action, Send) and action.step.references == 2:
            return Sent(action.step, FailureClass.OOM, False)
        return serve_all(action)

    actions = drive(policy.initial(RULES, steps(), [], attempt=0), oom_at_2)
    assert [(s.references, s.seed) for s in sent(actions)] == [(1, 1), (1, 2), (2, 1)]
    implied = skipped(actions)
    assert [(s.references, s.seed) for s, _ in implied] == [(2, 2), (3, 1), (3, 2), (4, 1), (4, 2)]
    deciding = "c/default/refs-2/f-seed-1"
    assert all(a.implied_by == deciding and deciding in a.reason for _, a in implied)
    assert "out-of-memory at 2" in implied[0][1].reason


def test_opting_out_sends_the_other_seeds_at_the_oom_count() -> None:
    rules = Rules(restarts=1, stop_after_oom=True, oom_implies_seeds=False, determinism_resend=False,
                  gpu_gate=False)

    def oom_at_2(action):
        if isinstance(action, Send) and action.step.references == 2:
            return Sent(action.step, FailureClass.OOM, False)
        return serve_all(action)

    actions = drive(policy.initial(rules, steps(), [], attempt=0), oom_at_2)
    assert [(s.references, s.seed) for s in sent(actions)] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert [(s.references, s.seed) for s, _ in skipped(actions)] == [(3, 1), (3, 2), (4, 1), (4, 2)]


def test_oom_implies_other_seeds_only_of_the_same_fixture() -> None:
    all_steps = steps(refs=(1, 2), seeds=(1, 2), fixtures=("a", "b"))

    def oom_a2(action):
        if isinstance(action, Send) and (action.step.references, action.step.fixture) == (2, "a"):
            return Sent(action.step, FailureClass.OOM, False)
        return serve_all(action)

    actions = drive(policy.initial(RULES, all_steps, [], attempt=0), oom_a2)
    assert [(s.references, s.fixture, s.seed) for s, _ in skipped(actions)] == [(2, "a", 2)]
    assert (2, "b", 1) in [(s.references, s.fixture, s.seed) for s in sent(actions)]


def test_recorded_oom_still_implies_after_resume() -> None:
    oom = StepRecord(key="c/default/refs-2/f-seed-1", card="c", flags="default", role="default", fixture="f",
                     references=2, seed=1, status=Status.FAILED, failure=Failure(kind=FailureClass.OOM, message="oom"))
    actions = drive(policy.initial(RULES, steps()[3:], [oom], attempt=1), serve_all)
    assert sent(actions) == []
    assert [a for a in actions if isinstance(a, Start)] == []  # nothing to send: no server is started
    assert all(a.implied_by == oom.key for _, a in skipped(actions))


def test_restart_budget_after_lost_servers() -> None:
    lost = []

    def crash_every_second_send(action):
        if isinstance(action, Send):
            lost.append(action.step)
            return Sent(action.step, FailureClass.CRASH if len(lost) % 2 == 0 else None, len(lost) % 2 == 0)
        return serve_all(action)

    actions = drive(policy.initial(RULES, steps(refs=(0, 1, 2), seeds=(1, 2)), [], attempt=0), crash_every_second_send)
    assert [a for a in actions if isinstance(a, Start)] == [Start(0), Start(1)]  # one restart allowed
    assert len(sent(actions)) == 4
    rest = skipped(actions)
    assert len(rest) == 2 and all("1 restart(s) were used" in a.reason and a.implied_by is None for _, a in rest)


def test_a_lost_server_on_the_last_step_is_not_restarted() -> None:
    def lose_last(action):
        if isinstance(action, Send) and action.step == steps()[-1]:
            return Sent(action.step, FailureClass.TIMEOUT, True)
        return serve_all(action)

    actions = drive(policy.initial(RULES, steps(), [], attempt=0), lose_last)
    assert [a for a in actions if isinstance(a, Start)] == [Start(0)]


def test_a_failed_start_is_not_retried_and_skips_everything() -> None:
    def oom_at_load(action):
        return Started(FailureClass.OOM_AT_LOAD) if isinstance(action, Start) else serve_all(action)

    actions = drive(policy.initial(RULES, steps(), [], attempt=0), oom_at_load)
    assert sent(actions) == [] and len([a for a in actions if isinstance(a, Start)]) == 1
    assert len(skipped(actions)) == 8 and skipped(actions)[0][1].reason == "server did not start: oom_at_load"


def test_idle_gpu_gate_before_every_start() -> None:
    gated = Rules(restarts=1, stop_after_oom=True, oom_implies_seeds=True, determinism_resend=False, gpu_gate=True)
    checks = []

    def busy_on_second_check(action):
        if isinstance(action, CheckIdle):
            checks.append(action)
            return IdleChecked("GPU 0 is held by pid 42 (python, 3.0 GiB)" if len(checks) == 2 else None)
        if isinstance(action, Send) and action.step.references == 2:
            return Sent(action.step, FailureClass.CRASH, True)
        return serve_all(action)

    actions = drive(policy.initial(gated, steps(), [], attempt=0), busy_on_second_check)
    assert len(checks) == 2 and [a for a in actions if isinstance(a, Start)] == [Start(0)]
    assert all("held by pid 42" in a.reason for _, a in skipped(actions)) and len(skipped(actions)) == 5


def test_interrupt_skips_what_is_left_and_finishes() -> None:
    state = policy.initial(RULES, steps(), [], attempt=0)
    state, action = policy.next_action(state, Begin())
    state, action = policy.next_action(state, Started(None))
    assert isinstance(action, Send)
    state, action = policy.next_action(state, policy.Interrupted())
    assert isinstance(action, Skip) and action.reason == "run interrupted" and len(action.steps) == 7
    assert policy.next_action(state, Skipped())[1] == Finish()


def test_nothing_pending_finishes_without_a_start() -> None:
    assert policy.next_action(policy.initial(RULES, (), [], attempt=3), Begin())[1] == Finish()


# --- repeats = "auto": the look after the last step and its top-up sends ---------------------------------
AUTO = Rules(restarts=1, stop_after_oom=True, oom_implies_seeds=True, determinism_resend=True, gpu_gate=False,
             auto_repeats=True)
TOPUP = policy.TopUp("c/default/refs-1/f-seed-1", 3)


def test_auto_looks_after_the_last_step_and_sends_what_the_look_asks_for() -> None:
    looks = []

    def answer(action):
        match action:
            case policy.Look():
                looks.append(action)
                return policy.Looked((TOPUP,) if len(looks) == 1 else ())
            case policy.SendMore(topup=t):
                return policy.SentMore(t, None, False)
        return serve_all(action)

    actions = drive(policy.initial(AUTO, steps(refs=(1,)), [], attempt=0), answer)
    kinds = [type(a).__name__ for a in actions]
    assert kinds == ["Start", "Send", "Send", "Look", "SendMore", "Look", "Finish"]
    assert actions[4].topup == TOPUP and len(looks) == 2


def test_fixed_repeats_never_look() -> None:
    actions = drive(policy.initial(RULES, steps(refs=(1,)), [], attempt=0), serve_all)
    assert not any(isinstance(a, policy.Look) for a in actions)


def test_a_topup_pass_starts_the_server_for_its_sends_only_and_restarts_after_a_lost_one() -> None:
    second = policy.TopUp("c/default/refs-1/f-seed-2", 1)

    def answer(action):
        match action:
            case policy.Look():
                return policy.Looked(())
            case policy.SendMore(topup=t):
                return policy.SentMore(t, FailureClass.CRASH if t == TOPUP else None, t == TOPUP)
        return serve_all(action)

    actions = drive(policy.initial(AUTO, (), [], attempt=3, topups=(TOPUP, second)), answer)
    kinds = [type(a).__name__ for a in actions]
    assert kinds == ["Start", "SendMore", "Start", "SendMore", "Look", "Finish"]
    assert [a.attempt for a in actions if isinstance(a, Start)] == [3, 4]


def test_nothing_to_send_and_no_topups_starts_nothing() -> None:
    _, action = policy.next_action(policy.initial(AUTO, (), [], attempt=0), Begin())
    assert isinstance(action, Finish)
