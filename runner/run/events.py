"""Run events: what the executor tells the outside world (progress bars, live metrics). Listeners import
this module, never the executor, so the dependency points one way: execute → events ← progress/exporter."""

from __future__ import annotations

from runner.core.records import DiagnosisRecord, SoakRequest, StepRecord
from runner.plan.lanes import Step


class Events:
    """No-ops by default; a listener overrides what it shows."""

    def lane_started(self, lane: str, cards: tuple[str, ...], total_steps: int) -> None: ...
    def session_started(self, card: str, flags: str, attempt: int) -> None: ...
    def waiting(self, card: str, text: str) -> None:
        """The card's lane waits for something outside the runner (a Slurm allocation): why, in words."""
    # ready_s None: the server did not start; `why` then says why (failure class and the server's own line)
    def session_ready(self, card: str, flags: str, ready_s: float | None, why: str | None = None) -> None: ...
    # the server does not serve the `model` the requests carry: the one line that says what to set, said once
    # per run before the first request to such a server (the requests are sent all the same)
    def served_model(self, card: str, flags: str, line: str) -> None: ...
    # a step's request is going out `sends` times (a real one can take minutes: what is in flight, not "ready")
    def sending(self, step: Step, sends: int) -> None: ...
    def step_done(self, record: StepRecord) -> None: ...
    def topup_done(self, record: StepRecord) -> None: ...  # a recorded step got more sends (repeats = auto)
    def memory(self, card: str, device_bytes: int | None) -> None: ...
    def lane_done(self, lane: str) -> None: ...
    # the diagnosis pass of a flag set decided by a device OOM (runner.run.diagnose): not a measurement
    def diagnosis_started(self, card: str, flags: str, at: str) -> None: ...
    def diagnosis_done(self, record: DiagnosisRecord) -> None: ...
    # the soak of a flag set (runner.run.soak): `done` of `planned` requests already recorded (a resume), each
    # request as it is recorded, and how it ended (soak.json's `stopped`, and its line) with `sent` recorded in all
    def soak_started(self, card: str, flags: str, done: int, planned: int) -> None: ...
    def soak_request(self, record: SoakRequest) -> None: ...
    def soak_finished(self, card: str, flags: str, stopped: str | None, line: str | None, sent: int) -> None: ...


class Fanout(Events):
    """Several listeners as one."""

    def __init__(self, *listeners: Events) -> None:
        self.listeners = listeners

    def lane_started(self, lane: str, cards: tuple[str, ...], total_steps: int) -> None:
        for x in self.listeners:
            x.lane_started(lane, cards, total_steps)

    def session_started(self, card: str, flags: str, attempt: int) -> None:
        for x in self.listeners:
            x.session_started(card, flags, attempt)

    def waiting(self, card: str, text: str) -> None:
        for x in self.listeners:
            x.waiting(card, text)

    def session_ready(self, card: str, flags: str, ready_s: float | None, why: str | None = None) -> None:
        for x in self.listeners:
            x.session_ready(card, flags, ready_s, why)

    def served_model(self, card: str, flags: str, line: str) -> None:
        for x in self.listeners:
            x.served_model(card, flags, line)

    def sending(self, step: Step, sends: int) -> None:
        for x in self.listeners:
            x.sending(step, sends)

    def step_done(self, record: StepRecord) -> None:
        for x in self.listeners:
            x.step_done(record)

    def topup_done(self, record: StepRecord) -> None:
        for x in self.listeners:
            x.topup_done(record)

    def memory(self, card: str, device_bytes: int | None) -> None:
        for x in self.listeners:
            x.memory(card, device_bytes)

    def lane_done(self, lane: str) -> None:
        for x in self.listeners:
            x.lane_done(lane)

    def diagnosis_started(self, card: str, flags: str, at: str) -> None:
        for x in self.listeners:
            x.diagnosis_started(card, flags, at)

    def diagnosis_done(self, record: DiagnosisRecord) -> None:
        for x in self.listeners:
            x.diagnosis_done(record)

    def soak_started(self, card: str, flags: str, done: int, planned: int) -> None:
        for x in self.listeners:
            x.soak_started(card, flags, done, planned)

    def soak_request(self, record: SoakRequest) -> None:
        for x in self.listeners:
            x.soak_request(record)

    def soak_finished(self, card: str, flags: str, stopped: str | None, line: str | None, sent: int) -> None:
        for x in self.listeners:
            x.soak_finished(card, flags, stopped, line, sent)
