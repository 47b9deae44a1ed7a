"""The soak, run: after a lane's sessions, each soaked flag set of its cards (runner.plan.soak) on one fresh server
start, its requests sent one at a time until the first failure, `[soak] requests` or `[soak] minutes`.

Recorded apart, under <card>/<flags>/soak/: soak.json (runner.core.records.SoakRecord: what was asked, each
server start, why it stopped; written at every start, checkpoint and stop) and requests.jsonl (one
SoakRequest per request, appended and synced the moment it is done), with the server logs and memory.csv
beside them. Nothing here is a timed sample or a peak of a matrix cell. Each request is sent and classified as a
matrix send is (runner.run.sending), its device peak read from the meters' window over it, the level it leaves
read in the quiet window after it (SessionRunner.settle) while its image is checked to decode. A Ctrl-C
abandons the request in flight (no record: a resume sends that number again on a fresh start); a request
stopped from outside is no measurement either.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from runner.backends.base import Attempt
from runner.core.records import SEND_AGAIN, FailureClass, SessionRecord, SoakRecord, SoakRequest, Status
from runner.core.registry import METERS
from runner.core.units import slug
from runner.judge import scoring
from runner.observe import bounded
from runner.plan import soak as soak_plan
from runner.plan.lanes import Session, Step
from runner.run.execute import (
    Baselines,
    References,
    RunContext,
    SessionRunner,
    _Server,
    _SessionLog,
    start_failure_line,
)
from runner.run.pending import pending, soak_elapsed_s, soak_left
from runner.run.soak_state import chosen
from runner.run.step_records import soak_request


def soak_passes(ctx: RunContext, lane_name: str, refs: References, baselines: Baselines) -> None:
    """After a lane's sessions (and its top-ups and diagnosis passes): the soak of each of its cards whose steps
    are all done and that this invocation did not set aside (--skip-unreachable), one soaked flag set after
    another; a soak that ended is not sent again, one interrupted is continued."""
    if ctx.matrix.soak is None:
        return
    lane = next(x for x in ctx.plan.lanes if x.name == lane_name)
    sessions = {s.key: s for s in lane.sessions}
    for card in lane.cards:
        if ctx.stop.is_set():
            return
        if card not in soak_plan.soaked_cards(ctx.matrix) or ctx.set_aside(card) or _steps_left(ctx, card):
            continue
        for flags, why in chosen(ctx.matrix, ctx.store, card, ctx.recorded(card))[0]:
            if ctx.stop.is_set():
                return
            session = sessions[f"{card}/{flags}"]
            record, requests = ctx.store.load_soak(session.key), ctx.store.load_soak_requests(session.key)
            if soak_left(ctx.matrix.soak, record, requests):
                SoakRunner(ctx, session, refs, baselines, why).run_soak(record, requests)


def _steps_left(ctx: RunContext, card: str) -> bool:
    """The card's matrix steps are not all done (its soak waits for them: which flag sets it takes depends on
    them)."""
    recorded = [s for f in ctx.matrix.axes.flags if (s := ctx.store.load_session(f"{card}/{f}")) is not None]
    return any(s.card == card for s in pending(ctx.plan, ctx.recorded(card), recorded).sessions)


class SoakRunner(SessionRunner):
    """One soaked flag set: a SessionRunner (its server, meters, requests) whose files and record are the
    soak's own."""

    def __init__(self, ctx: RunContext, session: Session, refs: References, baselines: Baselines, why: str) -> None:
        super().__init__(ctx, session, refs, baselines)
        assert ctx.matrix.soak is not None
        self.soak = ctx.matrix.soak
        self.why_chosen = why
        self.stopped: str | None = None
        self.stop_line: str | None = None

    @property
    def record_key(self) -> str:
        return self.ctx.store.soak_key(self.session.key)

    def attempt(self, attempt: int) -> Attempt:
        s = self.session
        return Attempt(name=slug(f"runner-{self.ctx.run_id}-{s.card}-{s.flags}-soak-{attempt}").lower(),
                       log_path=self.ctx.store.session_dir(self.record_key) / f"server.{attempt}.log",
                       labels={"runner.run": self.ctx.run_id, "runner.attempt": str(attempt), "runner.soak": "true"})

    def _write(self, log: _SessionLog) -> SessionRecord:  # type: ignore[override]  # the soak's own record
        s = self.soak
        record = SoakRecord(key=self.session.key, card=self.card.name, flags=self.flags.name, role=self.flags.role,
                            requests=s.requests, minutes=s.minutes, references=s.counts, order=s.order,
                            chosen=self.why_chosen, starts=log.all_starts(), meters=tuple(log.meters),
                            stopped=self.stopped, why=self.stop_line, notes=tuple(log.notes))  # type: ignore[arg-type]
        self.ctx.store.write_soak(record)
        return record  # type: ignore[return-value]

    def _stop(self, log: _SessionLog, why: str, line: str | None = None) -> None:
        self.stopped, self.stop_line = why, line
        self._write(log)

    def run_soak(self, prior: SoakRecord | None, done: list[SoakRequest]) -> None:
        """Send what is left of this soak on one fresh server start (side effects: the server, the records)."""
        log = _SessionLog(starts=list(prior.starts) if prior else [], meters=list(prior.meters) if prior else [],
                          notes=list(prior.notes) if prior else [])
        if done:
            log.notes.append(f"resumed at request {done[-1].number + 1}")
        events = self.ctx.events
        events.soak_started(self.card.name, self.flags.name, len(done), self.soak.requests)
        on_gpu = self.card.gpu is not None or any(m in METERS and METERS.get(m).reads_gpu for m in self.card.meters)
        if on_gpu and (held := self._gpu_not_idle(log)) is not None:
            self._stop(log, "not idle", held)
            events.soak_finished(self.card.name, self.flags.name, self.stopped, self.stop_line, len(done))
            return
        server = _Server(self, len(log.starts), log)
        sent = len(done)
        try:
            failure = server.open()
            if failure is not None or server.ready_s is None:
                line = start_failure_line(server.failure) if server.failure is not None else "interrupted while loading"
                self._stop(log, "interrupted" if server.failure is None else
                           "oom at load" if failure == FailureClass.OOM_AT_LOAD else "start failed", line)
            else:
                sent = self._requests(server, log, done)
        finally:
            server.close()  # writes soak.json with its stop
        events.soak_finished(self.card.name, self.flags.name, self.stopped, self.stop_line, sent)

    def _requests(self, server: _Server, log: _SessionLog, done: list[SoakRequest]) -> int:
        """Send from the next request on until the soak stops; the requests recorded in all."""
        soak, key, card, flags = self.soak, self.session.key, self.card.name, self.flags.name
        spent = soak_elapsed_s(done)  # against [soak] minutes, over the earlier starts too
        number = done[-1].number + 1 if done else 1
        t_first: float | None = None
        with bounded.client() as client, ThreadPoolExecutor(max_workers=1, thread_name_prefix="soak-check") as check:
            sender = self.sender(client, server.server)
            while number <= soak.requests:
                if self.ctx.stop.is_set():
                    self._stop(log, "interrupted", f"interrupted before request {number}")
                    return number - 1
                if soak.minutes is not None and spent + (time.time() - (t_first or time.time())) >= soak.minutes * 60:
                    self._stop(log, "minutes", f"{soak.minutes:g} min reached after {number - 1} request(s)")
                    return number - 1
                at = soak_plan.step_at(self.ctx.matrix, card, flags, number)
                step = Step(card, flags, at.fixture, at.references, at.seed)
                t_first = t_first or time.time()
                got = self._sends(sender, server.meters, step, 1, label=lambda i: None)
                if isinstance(got, str):
                    if got == "run interrupted":
                        self._stop(log, "interrupted", f"interrupted during request {number} (a resume sends it "
                                                       "again)")
                        return number - 1
                    log.notes.append(f"request {number}: {got}; sent again")  # suspended: its time is the pause's
                    continue
                sends, peaks = got
                image = sends.first.image_bytes if sends.first else None
                decodes = check.submit(self._undecodable, image) if image is not None else None
                floors = self.settle(server.meters)  # the image is checked meanwhile, off the request's time
                record = soak_request(key, number, step, server.attempt, sends, peaks, floors,
                                      decodes.result() if decodes else None)
                if record.failure is not None and record.failure.kind in SEND_AGAIN:  # not a measurement
                    self._stop(log, "interrupted", f"request {number}: {record.failure.message}")
                    return number - 1
                self.ctx.store.append_soak_request(record)
                self.ctx.events.soak_request(record)
                server.checkpoint()
                if record.status == Status.FAILED:
                    kind = record.failure.kind if record.failure else "failed"
                    self._stop(log, "failure", f"request {number}: {kind}")
                    return number
                number += 1
        self._stop(log, "requests", f"{soak.requests} request(s) sent")
        return soak.requests

    def _undecodable(self, image: bytes) -> str | None:
        """Why a returned image does not decode (a bad response, as the matrix's scoring finds it), or None."""
        try:
            scoring.decode(image, bounded.pixel_cap(self.run.size))
        except Exception as exc:  # any undecodable payload is a bad response, with its reason
            return f"image does not decode: {type(exc).__name__}: {str(exc)[:200]}"
        return None
