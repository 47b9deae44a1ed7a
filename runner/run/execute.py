"""Execute the pending part of a Plan: lanes in parallel, sessions one after another, one request at a time.

This module holds the run's side effects (servers, HTTP, meters, files); everything it decides is asked of
pure functions: what to do next of policy.next_action, what a response means of failures.classify_request,
how good an image is of scoring. Failures become records, never exceptions that end the run; each record is
written the moment it exists. Scoring and writing a served step runs on one worker per lane, in order, while
the next request is in flight.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
from PIL import Image

from runner import backends
from runner.backends.base import Attempt, RunningServer, StartFailed, StartInterrupted, port_loss_notes
from runner.core.records import (
    Failure,
    FailureClass,
    Level,
    Peak,
    RetentionProbe,
    ServedModel,
    ServerStart,
    SessionRecord,
    Status,
    StepRecord,
)
from runner.core.registry import BACKENDS, DIALECTS, METERS, load
from runner.core.units import slug
from runner.core.vocab import MemoryMetric
from runner.judge import scoring, verdict
from runner.judge.findings.retention import probe_step
from runner.meters import Meter, build_meters, idle_baseline
from runner.observe import bounded
from runner.observe.failures import error_lines, without_addresses, without_stamp
from runner.plan import baseline, sequential
from runner.plan.lanes import Plan, Session, Step
from runner.plan.matrix import Matrix
from runner.run import dialects, policy
from runner.run.events import Events
from runner.run.interrupts import Abandoned
from runner.run.pauses import PauseWatch
from runner.run.pending import Pending, pending
from runner.run.sending import Sender, repeat_label
from runner.run.step_records import Sends, Served, max_by_source, skipped, step_record, topped_up, with_response_peak
from runner.run.store import RunStore

MEMORY_FLUSH_S = 10.0  # a running start's memory samples reach memory.csv at least this often
QUIET_WIDEN = 4  # a quiet window with no sample from a working sampler is widened by quiet_s at most this often


@dataclass
class RunContext:
    matrix: Matrix
    plan: Plan
    store: RunStore
    run_id: str
    events: Events = field(default_factory=Events)
    stop: threading.Event = field(default_factory=threading.Event)
    # Every step recorded so far (by earlier runs of a resume, and by this one as records are written), by key
    records: dict[str, StepRecord] = field(default_factory=dict)
    todo: Pending | None = None  # what is left to do; None: all of the plan
    live: set[RunningServer] = field(default_factory=set)  # servers up now (a second Ctrl-C kills them)
    pauses: PauseWatch | None = None  # notices the runner itself being stopped (SIGSTOP / Ctrl-Z)
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards `records` and `said` across lanes
    said: set[str] = field(default_factory=set)  # served-model lines already on the console (one per table)

    def first_time(self, line: str) -> bool:
        """Whether a line is new to this run (then it is remembered): said once, not once per session."""
        with self.lock:
            new = line not in self.said
            self.said.add(line)
            return new

    def __post_init__(self) -> None:
        if self.todo is None:
            self.todo = pending(self.plan, self.records.values(), ())

    def set_aside(self, card: str) -> bool:
        """Left out of this invocation (--skip-unreachable): nothing of the card starts, a resume does it."""
        return self.todo is not None and card in self.todo.set_aside

    def recorded(self, card: str) -> list[StepRecord]:
        with self.lock:
            return [r for r in self.records.values() if r.card == card]

    def record(self, record: StepRecord) -> None:
        with self.lock:
            self.records[record.key] = record

    def topups(self, session: Session) -> tuple[policy.TopUp, ...]:
        """What `repeats = "auto"` asks of this session now: top-up sends for the open latency ratios of its
        card, as the records stand (a pure function of them: resume continues where a run stopped)."""
        if not self.matrix.run.auto_repeats:
            return ()
        steps = self.recorded(session.card)
        sessions = [s for f in self.matrix.axes.flags
                    if (s := self.store.load_session(f"{session.card}/{f}")) is not None]
        try:
            wall = baseline.wall_s(self.matrix)
        except Exception:  # an unreadable baseline only loses the baseline's latency, as in the verdict
            wall = None
        open_ = verdict.open_latencies(session.card, steps, sessions, self.matrix.verdict, wall)
        return policy.topups([lat.sides for lat in open_ if lat.sides], steps, session.card, session.flags,
                             self.matrix.run.max_repeats)


def attempt_of(ctx: RunContext, session: Session, attempt: int) -> Attempt:
    """What one start of a session's planned server adds to the plan: its name, log file and labels."""
    return Attempt(name=slug(f"runner-{ctx.run_id}-{session.card}-{session.flags}-{attempt}").lower(),
                   log_path=ctx.store.session_dir(session.key) / ("server.log" if attempt == 0
                                                                   else f"server.{attempt}.log"),
                   labels={"runner.run": ctx.run_id, "runner.attempt": str(attempt)})


def _mime(data: bytes) -> str:
    fmt = Image.open(io.BytesIO(data)).format or "PNG"
    return f"image/{fmt.lower()}"


class References:
    """Reference images read once per run, in order, with their digests for the record."""

    def __init__(self) -> None:
        self._cache: dict[Path, tuple[str, bytes, str]] = {}
        self._lock = threading.Lock()

    def _load(self, path: Path) -> tuple[str, bytes, str]:
        with self._lock:
            if path not in self._cache:
                data = path.read_bytes()
                self._cache[path] = (_mime(data), data, hashlib.sha256(data).hexdigest()[:16])
            return self._cache[path]

    def get(self, path: Path) -> tuple[str, bytes]:
        mime, data, _ = self._load(path)
        return mime, data

    def digest(self, path: Path) -> str:
        return self._load(path)[2]


class Baselines:
    def __init__(self, matrix: Matrix, store: RunStore) -> None:
        self.matrix, self.store = matrix, store
        b = matrix.baseline
        self.samples = baseline.load_samples(b.directory) if b and b.directory else []

    def image(self, step: Step | StepRecord) -> tuple[str | None, Image.Image | None]:
        """The directory baseline for a step now; a cell baseline is scored after the run (rescore)."""
        sample = baseline.find(self.samples, step.fixture, step.references, step.seed)
        if sample is None:
            return None, None
        return str(sample.file), scoring.decode(sample.file.read_bytes())


class SessionRunner:
    def __init__(self, ctx: RunContext, session: Session, refs: References, baselines: Baselines,
                 scorer: ThreadPoolExecutor | None = None, topups: tuple[policy.TopUp, ...] = ()) -> None:
        self.ctx, self.session, self.refs, self.baselines = ctx, session, refs, baselines
        self.first_topups = topups  # a top-up pass: a session restarted only for these sends
        self._topped_up: set[str] = set()
        self.card = ctx.matrix.cards[session.card]
        self.flags = ctx.matrix.flags[session.flags]
        self.profile = ctx.matrix.servers[self.card.server]
        self.run = ctx.matrix.run
        self.scorer = scorer  # one worker, so records are written in order; None: score inline
        self._scoring: list[Future[StepRecord]] = []

    # -- where its server's files go: the session's folder (a soak's: its own, runner.run.soak) -------------
    @property
    def record_key(self) -> str:
        """The folder (relative to the run's) of its server logs and memory.csv."""
        return self.session.key

    def attempt(self, attempt: int) -> Attempt:
        return attempt_of(self.ctx, self.session, attempt)

    # -- records -------------------------------------------------------------------------------------
    def _emit(self, record: StepRecord, png: bytes | None = None) -> StepRecord:
        self.ctx.store.write_step(record, png)
        self.ctx.record(record)
        if record.key in self._topped_up:
            self.ctx.events.topup_done(record)
        else:
            self.ctx.events.step_done(record)
        return record

    def _submit(self, work: StepRecord | Served) -> None:
        """Write a record, in order: a served step is scored first, on the worker when there is one."""
        if self.scorer is None:
            self._finish(work)
        else:
            self._scoring.append(self.scorer.submit(self._finish, work))

    def _finish(self, work: StepRecord | Served) -> StepRecord:
        if isinstance(work, StepRecord):
            return self._emit(work)
        return self._emit(*self.score(work))

    def drain(self) -> None:
        """Wait until every submitted record is written (raises what the worker raised)."""
        while self._scoring:
            self._scoring.pop(0).result()

    # -- one request -----------------------------------------------------------------------------------
    def sender(self, client: httpx.Client, server: RunningServer) -> Sender:
        return Sender(client, server, self.profile.dialect, self.run.request_timeout_s, self.run.size,
                      self.ctx.stop, server.own_packages)

    def _request(self, step: Step, references: tuple[tuple[str, bytes], ...] | None = None) -> dialects.HttpCall:
        """A step's request; `references` (mime, bytes) in place of its fixture's, where given."""
        fixture = self.ctx.matrix.fixtures[step.fixture]
        refs = references if references is not None else \
            tuple(self.refs.get(p) for p in fixture.references[: step.references])
        req = dialects.ImageRequest(model=self.profile.model, prompt=fixture.prompt, references=refs,
                                    seed=step.seed, steps=self.run.steps, size=self.run.size,
                                    true_cfg_scale=self.run.true_cfg_scale,
                                    negative_prompt=self.run.negative_prompt)
        return dialects.build(self.profile.dialect, req)

    def _sends(self, sender: Sender, meters: list[Meter], step: Step, total: int, *,
               label: Callable[[int], str | None], against_sha256: str | None = None,
               ) -> tuple[Sends, tuple[Peak, ...]] | str:
        """Send a step's request `total` times and read the meters' window over the sends; or why nothing
        was measured (interrupted, or the runner itself was suspended: the wall times are the pause's)."""
        self.ctx.events.sending(step, total)
        try:
            sends = sender.repeats(self._request(step), step.references, total, label=label,
                                   against_sha256=against_sha256)
        except Abandoned:  # interrupted mid-request: nothing measured, a resume sends it again
            return "run interrupted"
        paused = self.ctx.pauses.paused_s(sends.t0, sends.t1) if self.ctx.pauses else 0.0
        if paused > 0 and (sends.failure is None or sends.failure.kind == FailureClass.TIMEOUT):
            return f"runner suspended for {paused:.1f} s during the request (SIGSTOP / Ctrl-Z): not a measurement"
        return sends, with_response_peak([m.window_peak(sends.t0, sends.t1) for m in meters],
                                         max(p.mib for p in sends.reported) if sends.reported else None,
                                         sends.unread[0] if sends.unread else None)

    def execute(self, sender: Sender, meters: list[Meter], step: Step, attempt: int,
                determinism_resend: bool, floor_before: tuple[Level, ...] = ()) -> StepRecord | Served:
        """Send a step's request `repeats` times (timed), plus once untimed for the determinism re-send, and
        build its record from the sends, the meters' window over them and the level they left behind."""
        timed = self.run.repeats
        total = timed + (1 if determinism_resend and timed == 1 else 0)
        got = self._sends(sender, meters, step, total, label=repeat_label(total))
        if isinstance(got, str):  # discarded: a resume sends it again
            return skipped(step, self.flags.role, got)
        sends, peaks = got
        floor_after = self.settle(meters)
        refs = self.ctx.matrix.fixtures[step.fixture].references[: step.references]
        request = {"dialect": self.profile.dialect, "path": self._request(step).path, "steps": self.run.steps,
                   "size": list(self.run.size) if self.run.size else None, "seed": step.seed,
                   "sends": len(sends.sends), "references": [self.refs.digest(p) for p in refs]}
        work = step_record(step, self.flags.role, attempt, sends, timed, peaks, request)
        floors = {"floor_before": floor_before, "floor_after": floor_after}
        if isinstance(work, Served):
            return replace(work, record=work.record.model_copy(update=floors))
        return work.model_copy(update=floors)

    def settle(self, meters: list[Meter]) -> tuple[Level, ...]:
        """Wait the quiet window (a stop cuts it short) and read each device meter's level in it: what the
        server holds between requests."""
        if self.run.quiet_s <= 0:
            return ()
        device = [m for m in meters if m.metric == MemoryMetric.DEVICE]
        t0 = time.time()
        self.ctx.stop.wait(self.run.quiet_s)
        # A sampler whose level may still come (Meter.level_pending: a loaded host, a slow /metrics) gets the
        # window widened, up to QUIET_WIDEN times: one missed sample must not cost a finding its load level
        for _ in range(QUIET_WIDEN):
            levels = [m.window_floor(t0, time.time()) for m in device]
            if self.ctx.stop.is_set() or all(lv.available or not m.level_pending(t0)
                                             for m, lv in zip(device, levels, strict=True)):
                break
            self.ctx.stop.wait(self.run.quiet_s)
        t1 = time.time()
        return tuple(m.window_floor(t0, t1) for m in device)

    def top_up(self, sender: Sender, meters: list[Meter], topup: policy.TopUp) -> StepRecord:
        """`repeats = "auto"`: send a recorded, served step's request `topup.sends` more times, timed, and
        return its record with the new samples (and sends, peaks, determinism) added; unchanged when the
        sends measured nothing (interrupted, suspended)."""
        old = self.ctx.records[topup.key]
        step = Step(old.card, old.flags, old.fixture, old.references, old.seed)
        done = len(old.sends or old.wall_samples_s or (1,))
        got = self._sends(sender, meters, step, topup.sends, against_sha256=old.image_sha256,
                          label=lambda i: f"send {done + i + 1} of the same request (an auto top-up)")
        if isinstance(got, str):
            return old
        sends, peaks = got
        repeat_psnr = None
        if sends.different is not None and old.repeat_psnr_db is None and (png := self.ctx.store.read_png(old.key)):
            with contextlib.suppress(Exception):  # an undecodable repeat is simply not comparable
                repeat_psnr = scoring.score(scoring.decode(sends.different), scoring.decode(png), None).psnr_db
        return topped_up(old, sends, peaks, repeat_psnr)

    def retention_probe(self, client: httpx.Client, server: _Server) -> RetentionProbe | None:
        """Where the session's levels cannot tell a cache of every distinct reference from the last request's
        references kept until the next, send its first request once more (untimed: never a sample or a peak) and
        read the level after it. None where the records already tell, or the send was interrupted."""
        self.drain()  # the decision reads this session's records
        mine = [r for r in self.ctx.recorded(self.card.name) if r.flags == self.flags.name]
        first = probe_step(mine, None)
        if first is None or self.run.quiet_s <= 0:
            return None
        step = Step(first.card, first.flags, first.fixture, first.references, first.seed)
        sender = self.sender(client, server.server)
        try:
            sends = sender.repeats(self._request(step), step.references, 1, label=lambda i: "the retention probe")
        except Abandoned:
            return None
        return RetentionProbe(key=first.key, references=first.references, attempt=server.attempt,
                              started_at=sends.t0, wall_s=sends.sends[0].wall_s,
                              served=sends.failure is None and sends.first is not None,
                              floor_after=self.settle(server.meters))

    def score(self, served: Served) -> tuple[StepRecord, bytes | None]:
        """Decode, PSNR/SSIM against the baseline and the sanity checks (off the request path). Returns the
        record and the PNG to keep beside it (none when the image does not decode: a bad response)."""
        step = served.record
        try:
            image = scoring.decode(served.image_bytes, bounded.pixel_cap(self.run.size))
        except Exception as exc:  # any undecodable payload is a bad response, with its reason
            problem = without_addresses(f"image does not decode: {type(exc).__name__}: {exc}")
            failure = step.failure or Failure(kind=FailureClass.BAD_RESPONSE, message=problem, evidence=())
            return step.model_copy(update={"status": Status.FAILED, "failure": failure, "image": None,
                                           "image_sha256": None, "deterministic": None}), None
        name, base_image = self.baselines.image(step)
        rules = self.ctx.matrix.verdict
        scores = scoring.score(image, base_image, name, max_transparent_share=rules.max_transparent_share,
                               min_pixel_std=rules.min_pixel_std, expected_size=self.run.size)
        repeat_psnr = None
        if served.repeat_image is not None:
            # How far apart: numerical noise (high dB) or an ignored seed (low dB)?
            try:
                repeat = scoring.decode(served.repeat_image, bounded.pixel_cap(self.run.size))
                repeat_psnr = scoring.score(repeat, image, None).psnr_db
            except Exception:  # an undecodable repeat is simply not comparable
                repeat_psnr = None
        return step.model_copy(update={"scores": scores, "repeat_psnr_db": repeat_psnr}), served.image_bytes

    # -- the session: a thin loop around policy.next_action -------------------------------------------
    def run_session(self) -> SessionRecord:
        log = _SessionLog.resume(self.ctx.store.load_session(self.session.key), len(self.session.steps),
                                 sum(t.sends for t in self.first_topups))
        on_gpu = self.card.gpu is not None or any(m in METERS and METERS.get(m).reads_gpu for m in self.card.meters)
        rules = policy.Rules(restarts=self.run.restarts, stop_after_oom=self.run.stop_after_oom,
                             oom_implies_seeds=self.run.oom_implies_seeds,
                             determinism_resend=self.run.determinism_check and self.run.repeats == 1,
                             gpu_gate=on_gpu, auto_repeats=self.run.auto_repeats)
        recorded = [r for r in self.ctx.recorded(self.card.name) if r.flags == self.flags.name]
        state = policy.initial(rules, self.session.steps, recorded, attempt=len(log.starts), topups=self.first_topups)
        outcome: policy.Outcome = policy.Begin()
        server: _Server | None = None
        try:
            with bounded.client() as client:
                while True:
                    if self.ctx.stop.is_set() and state.pending:
                        outcome = policy.Interrupted()
                    state, action = policy.next_action(state, outcome)
                    match action:
                        case policy.CheckIdle():
                            outcome = policy.IdleChecked(self._gpu_not_idle(log))
                        case policy.Start(attempt=attempt):
                            if server is not None:
                                server.close()
                            server = _Server(self, attempt, log)
                            outcome = policy.Started(server.open())
                        case policy.Send(step=step, determinism_resend=resend):
                            assert server is not None
                            if server.floor is None:  # after the load: the level before the first request
                                server.floor = self.settle(server.meters)
                            work = self.execute(self.sender(client, server.server), server.meters, step, server.attempt,
                                                resend, server.floor)
                            record = work.record if isinstance(work, Served) else work
                            server.floor = record.floor_after if record.status != Status.SKIPPED else None
                            lost = record.lost or server.server.exited() is not None
                            if lost:
                                log.notes.append(f"server lost during {step.key} "
                                                 f"({record.failure.kind if record.failure else 'exit'})")
                            self._submit(work)
                            server.checkpoint()
                            outcome = policy.Sent(step, record.failure.kind if record.failure else None, lost)
                        case policy.Look():
                            self.drain()  # the look needs every record of this session written
                            outcome = policy.Looked(self.ctx.topups(self.session))
                        case policy.SendMore(topup=topup):
                            assert server is not None
                            record = self.top_up(self.sender(client, server.server), server.meters, topup)
                            lost = record.lost or server.server.exited() is not None
                            if lost:
                                log.notes.append(f"server lost during a top-up of {topup.key} "
                                                 f"({record.failure.kind if record.failure else 'exit'})")
                            server.floor = None  # read again before the next request
                            self._topped_up.add(record.key)
                            self._submit(record)
                            server.checkpoint()
                            outcome = policy.SentMore(topup, record.failure.kind if record.failure else None, lost)
                        case policy.Skip(steps=steps, reason=reason, implied_by=implied):
                            for step in steps:
                                self._submit(skipped(step, self.flags.role, reason, implied))
                            if reason != "run interrupted" and implied is None:
                                log.notes.append(reason)
                            outcome = policy.Skipped()
                        case policy.Finish():
                            if server is not None and server.server.exited() is None and not self.ctx.stop.is_set():
                                log.probe = self.retention_probe(client, server) or log.probe
                            break
        finally:
            if server is not None:
                server.close()
            self.drain()
        return self._write(log)

    def _gpu_not_idle(self, log: _SessionLog) -> str | None:
        """Whole-device meters include every process on the GPU: the baseline is taken before our server
        exists. A foreign holder stops the session under require_idle_gpu; nothing is ever killed."""
        baseline = idle_baseline(self.card)
        log.idle = log.idle or baseline.to_json()
        return baseline.stop_reason(self.run.require_idle_gpu)

    def _write(self, log: _SessionLog) -> SessionRecord:
        record = SessionRecord(key=self.session.key, card=self.card.name, flags=self.flags.name,
                               role=self.flags.role, backend=self.card.backend, starts=log.all_starts(),
                               session_peaks=max_by_source(log.all_peaks()), meters=tuple(log.meters),
                               idle_baseline=log.idle, log="server.log", notes=tuple(log.notes),
                               served_model=log.served_model, retention_probe=log.probe)
        self.ctx.store.write_session(record)
        return record


class _Server:
    """One server start with its meters and live ticker. While it runs, session.json holds it as an open
    start and memory.csv its samples so far (a kill keeps both); `close` stops it and records it."""

    def __init__(self, runner: SessionRunner, attempt: int, log: _SessionLog) -> None:
        self.runner, self.attempt, self.log = runner, attempt, log
        assert runner.session.server is not None, "make_plan renders every session's server"
        self.server = backends.create(runner.session.server, runner.attempt(attempt))
        self.meters = build_meters(runner.card, self.server, runner.run.sample_hz)
        self.ticker = _MemoryTicker(runner.ctx.events, runner.card.name, self.meters)
        self.t_start = self.t_ready = time.time()
        self.ready_s: float | None = None
        self.failure: Failure | None = None
        self.floor: tuple[Level, ...] | None = None  # the level the last request left (None: read it again)
        self.flushed = 0.0
        self.closed = False

    def open(self) -> FailureClass | None:
        r = self.runner
        r.ctx.events.session_started(r.card.name, r.flags.name, self.attempt)
        self.t_start = time.time()
        for m in self.meters:
            m.start()
        self.ticker.start()
        self.checkpoint(force=True)
        r.ctx.live.add(self.server)
        try:
            self.ready_s = self.server.launch(r.run.ready_timeout_s, stop=r.ctx.stop)
        except StartInterrupted:  # stopped while loading: not a start failure; the session's steps are skipped
            pass
        except StartFailed as exc:
            self.failure = self.server.quote_failure(exc.failure)
        except Exception as exc:  # the backend itself failed (engine unreachable, bad image...)
            self.failure = self.server.quote_failure(
                Failure(kind=FailureClass.LOAD_EXIT, message=f"{type(exc).__name__}: {exc}"[:500]))
            self.server.stop()
        self.t_ready = time.time()
        self.log.notes.extend(port_loss_notes(self.attempt, self.server.port_losses))
        why = None if self.failure is None else start_failure_line(self.failure)
        r.ctx.events.session_ready(r.card.name, r.flags.name, self.ready_s, why)
        if self.failure is None and self.ready_s is not None:
            self.log.served_model = self.ask_model()
            line = self.log.served_model.note
            if self.log.served_model.matches is False and line and r.ctx.first_time(line):
                r.ctx.events.served_model(r.card.name, r.flags.name, line)  # before the first request
        self.checkpoint(force=True)
        return None if self.failure is None else self.failure.kind

    def ask_model(self) -> ServedModel:
        """What the ready server says it serves (GET /v1/models, bounded) against the `model` every request
        carries. Never fails the start: a server that does not answer is a note in the record."""
        r = self.runner
        try:
            with bounded.client() as client:
                answer = bounded.exchange(client, "GET", self.server.base_url + dialects.MODELS_PATH,
                                          deadline_s=dialects.MODELS_DEADLINE_S, max_bytes=dialects.MODELS_BYTES)
            ids = dialects.served_ids(answer.status, answer.content)
        except (httpx.HTTPError, bounded.Overdue, bounded.TooLarge) as exc:
            ids = f"{type(exc).__name__}: {exc}"
        return dialects.served_model(r.card.server, r.profile.model, ids, DIALECTS.get(r.profile.dialect).checks_model,
                                     self.server.secrets)

    def _start_record(self, stopped_at: float | None) -> ServerStart:
        return ServerStart(attempt=self.attempt, started_at=self.t_start,
                           ready_s=None if self.ready_s is None else round(self.ready_s, 3),
                           failure=self.failure, stopped_at=stopped_at,
                           load_peaks=tuple(m.window_peak(self.t_start, self.t_ready) for m in self.meters),
                           info={**self.server.info(), "log": self.server.log_path.name,
                                 **({"ports_lost": list(self.server.port_losses)} if self.server.port_losses
                                    else {})})

    def _series(self) -> list:
        return [x for m in self.meters for x in (m.series(), *m.extra_series())]

    def checkpoint(self, force: bool = False) -> None:
        """The open start into session.json, its samples into memory.csv (at most every MEMORY_FLUSH_S)."""
        now = time.time()
        if not force and now - self.flushed < MEMORY_FLUSH_S:
            return
        self.flushed = now
        self.log.current = self._start_record(None)
        self.log.current_peaks = [m.window_peak(self.t_start, now) for m in self.meters]
        self.runner.ctx.store.write_memory(self.runner.record_key, self._series(), self.attempt)
        self.runner._write(self.log)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.ticker.stop()
        self.server.stop()
        self.server.seal_log()  # no secret or raw escape stays in server.log
        self.runner.ctx.live.discard(self.server)
        t_end = time.time()
        for m in self.meters:
            m.stop()
        self.log.current, self.log.current_peaks = None, []
        self.log.peaks.extend(m.window_peak(self.t_start, t_end) for m in self.meters)
        self.log.meters.extend({**m.provenance(), "attempt": self.attempt} for m in self.meters)
        self.log.starts.append(self._start_record(t_end))
        self.runner.ctx.store.write_memory(self.runner.record_key, self._series(), self.attempt)
        self.runner._write(self.log)


@dataclass
class _SessionLog:
    """What a session has recorded so far; it grows while the session runs and is written as a
    SessionRecord at every server start, after steps and at every stop. On resume it starts from the
    earlier record (a start that was open when the runner was killed is kept as it was last written)."""

    starts: list[ServerStart] = field(default_factory=list)
    peaks: list[Peak] = field(default_factory=list)
    meters: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    idle: dict = field(default_factory=dict)
    current: ServerStart | None = None  # the start running now
    current_peaks: list[Peak] = field(default_factory=list)
    served_model: ServedModel | None = None  # /v1/models at the last start that got ready
    probe: RetentionProbe | None = None  # the first request sent again after the last step

    def all_starts(self) -> tuple[ServerStart, ...]:
        return (*self.starts, *([self.current] if self.current else []))

    def all_peaks(self) -> list[Peak]:
        return [*self.peaks, *self.current_peaks]

    @classmethod
    def resume(cls, prior: SessionRecord | None, pending: int, topup_sends: int = 0) -> _SessionLog:
        if prior is None:
            return cls()
        why = (f"restarted for {topup_sends} top-up send(s) on an open latency ratio (repeats = auto)"
               if topup_sends and not pending else f"resumed with {pending} step(s) to do")
        return cls(list(prior.starts), list(prior.session_peaks), list(prior.meters), [*prior.notes, why],
                   dict(prior.idle_baseline), served_model=prior.served_model, probe=prior.retention_probe)


class _MemoryTicker:
    """Feeds the newest device reading to the live display twice a second."""

    def __init__(self, events: Events, card: str, meters: list[Meter]) -> None:
        self.events, self.card, self.meters = events, card, meters
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            value = next((v for m in self.meters if m.metric == "device" and (v := m.latest()) is not None),
                         None)
            self.events.memory(self.card, value)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)


def start_failure_line(failure: Failure) -> str:
    """A start failure for the console's one line: its class and message, and the server's own error line
    when the message does not already end with it ("oom_at_load: out of memory at load — model load failed:
    CUDA out of memory. Tried to allocate …")."""
    said = next(iter(error_lines("\n".join(failure.evidence))), "")
    said = re.sub(r"^(ERROR|CRITICAL|FATAL)\s+[\w.-]+:\s*", "", without_stamp(said))  # "ERROR refserver: "
    text = f"{failure.kind}: {failure.message}"
    return f"{text} — {said}" if said and said not in failure.message else text


def _topup_passes(ctx: RunContext, lane_name: str, refs: References, baselines: Baselines,
                  scorer: ThreadPoolExecutor) -> list[SessionRecord]:
    """`repeats = "auto"` after a lane's sessions: while an open latency ratio asks a session whose server
    is no longer up for more sends, restart that session for them (its server up again, the session's own
    look then takes the next level). Each session is restarted at most once per level, so this ends."""
    if not ctx.matrix.run.auto_repeats:
        return []
    lane = next(x for x in ctx.plan.lanes if x.name == lane_name)  # every session, not only the pending ones
    sessions = [s for s in lane.sessions if not ctx.set_aside(s.card)]
    restarts: dict[str, int] = {}
    out = []
    while not ctx.stop.is_set():
        asked = next(((s, t) for s in sessions if restarts.get(s.key, 0) < len(sequential.levels(
            ctx.matrix.run.max_repeats)) and (t := ctx.topups(s))), None)
        if asked is None:
            break
        session, topups = asked
        restarts[session.key] = restarts.get(session.key, 0) + 1
        out.append(SessionRunner(ctx, replace(session, steps=()), refs, baselines, scorer, topups).run_session())
    return out


def _diagnosis_passes(ctx: RunContext, lane_name: str, refs: References, baselines: Baselines) -> None:
    """After a lane's measured sends: the diagnosis pass (runner.run.diagnose) of each of its flag sets decided
    by a device OOM that has none yet (a resume does not repeat one; an interrupted pass is not recorded, so a
    resume runs it)."""
    from runner.run import diagnose

    lane = next(x for x in ctx.plan.lanes if x.name == lane_name)
    for session in lane.sessions:
        if ctx.stop.is_set():
            return
        if ctx.set_aside(session.card):
            continue
        steps = ctx.recorded(session.card)
        record = ctx.store.load_session(session.key)
        for target in diagnose.targets(ctx.matrix.run.diagnosis, session, steps, record,
                                       ctx.matrix.verdict.target_references):
            refs_sent = target.step.references if target.step else None
            if ctx.stop.is_set() or ctx.store.diagnosis_path(session.key, target.at, refs_sent).exists():
                continue
            ctx.events.diagnosis_started(session.card, session.flags, target.at)
            started = time.time()
            try:
                done = diagnose.run_target(SessionRunner(ctx, session, refs, baselines), target)
            except Abandoned:  # interrupted: not recorded, so a resume runs the pass again
                return
            except Exception as exc:  # a pass's every failure is its record, never the lane's end
                done = diagnose.failed(session, target, started, exc)
            ctx.store.write_diagnosis(done)
            ctx.events.diagnosis_done(done)


def _soak_passes(ctx: RunContext, lane_name: str, refs: References, baselines: Baselines) -> None:
    """After a lane's sessions: the soak of its cards (runner.run.soak), where [soak] asks for one."""
    if ctx.matrix.soak is None:
        return
    from runner.run.soak import soak_passes

    soak_passes(ctx, lane_name, refs, baselines)


def run_plan(ctx: RunContext) -> list[SessionRecord]:
    """Run what is pending: one thread per lane, sessions one after another within a lane."""
    refs, baselines = References(), Baselines(ctx.matrix, ctx.store)
    assert ctx.todo is not None
    own_watch = ctx.pauses is None
    if ctx.pauses is None:
        ctx.pauses = PauseWatch().start()
    try:
        return _run_lanes(ctx, refs, baselines)
    finally:
        if own_watch:
            ctx.pauses.stop()


def _run_lanes(ctx: RunContext, refs: References, baselines: Baselines) -> list[SessionRecord]:
    assert ctx.todo is not None
    lanes = ctx.todo.lanes
    if ctx.matrix.run.auto_repeats or ctx.matrix.soak is not None:  # a lane with no step left may still owe
        # top-ups or a soak (a resume); never for a card set aside
        have = {lane.name for lane in lanes}
        lanes = (*lanes, *(replace(lane, cards=cards, sessions=()) for lane in ctx.plan.lanes if lane.name not in have
                           if (cards := tuple(c for c in lane.cards if not ctx.set_aside(c)))))

    def lane_job(lane_index: int) -> list[SessionRecord]:
        lane = lanes[lane_index]
        ctx.events.lane_started(lane.name, lane.cards, sum(len(s.steps) for s in lane.sessions))
        with contextlib.ExitStack() as held, ThreadPoolExecutor(max_workers=1, thread_name_prefix="score") as scorer:
            # What a backend holds for the whole lane (slurm: its allocations), released when the lane ends.
            for backend in dict.fromkeys(s.server.backend for s in lane.sessions if s.server is not None):
                scope = BACKENDS.get(backend).lane
                if scope is not None:
                    held.enter_context(load(scope)(lane, ctx))
            # After an interrupt, later sessions still record their steps as skipped ("run interrupted")
            # without starting anything, so the partial report shows what was not done.
            out = [SessionRunner(ctx, s, refs, baselines, scorer).run_session() for s in lane.sessions]
            out += _topup_passes(ctx, lane.name, refs, baselines, scorer)
            _diagnosis_passes(ctx, lane.name, refs, baselines)
            _soak_passes(ctx, lane.name, refs, baselines)
        ctx.events.lane_done(lane.name)
        return out

    results: list[SessionRecord] = []
    with ThreadPoolExecutor(max_workers=max(1, len(lanes)), thread_name_prefix="lane") as pool:
        futures = [pool.submit(lane_job, i) for i in range(len(lanes))]
        try:
            for f in futures:
                while True:
                    try:
                        results.extend(f.result(timeout=0.5))
                        break
                    except TimeoutError:
                        continue
        except BaseException:  # Ctrl-C, or a record that cannot be written (StoreError): every lane stops
            ctx.stop.set()  # lanes stop after their current request; servers are stopped in finally
            for f in futures:
                f.result()
            raise
    return results

