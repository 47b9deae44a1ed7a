"""Execute a Plan: lanes in parallel, sessions one after another, one request at a time.

This module holds the run's side effects (servers, HTTP, meters, files); everything it decides is asked of
pure functions (failures.classify_*, scoring, verdict). Failures become records, never exceptions that end
the run; each record is written the moment it exists.
"""

from __future__ import annotations

import hashlib
import io
import re
import socket
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
from PIL import Image

from runner import backends, baseline, dialects, scoring
from runner.backends.base import RunningServer, ServerSpec, StartFailed
from runner.failures import classify_request
from runner.matrix import Card, FlagSet, Matrix
from runner.meters import Meter, build_meters, idle_baseline
from runner.plan import Plan, Session, Step
from runner.records import Failure, FailureClass, Peak, ServerStart, SessionRecord, Status, StepRecord
from runner.store import RunStore

RESTART_AFTER = {FailureClass.CRASH, FailureClass.TIMEOUT}


class Events:
    """What the executor tells the outside world (progress bars, live metrics). No-ops by default."""

    def lane_started(self, lane: str, cards: tuple[str, ...], total_steps: int) -> None: ...
    def session_started(self, card: str, flags: str, attempt: int) -> None: ...
    def session_ready(self, card: str, flags: str, ready_s: float | None) -> None: ...
    def step_done(self, record: StepRecord) -> None: ...
    def memory(self, card: str, device_bytes: int | None) -> None: ...
    def lane_done(self, lane: str) -> None: ...


@dataclass
class RunContext:
    matrix: Matrix
    plan: Plan
    store: RunStore
    run_id: str
    events: Events = field(default_factory=Events)
    stop: threading.Event = field(default_factory=threading.Event)
    done: dict[str, StepRecord] = field(default_factory=dict)  # steps already recorded (resume), by key


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _slug(text: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_.-]+", "-", text)


def render(template: str, values: dict[str, str]) -> str:
    return template.format_map(values)


def server_spec(ctx: RunContext, card: Card, flags: FlagSet, attempt: int) -> ServerSpec:
    """Server profile + card + flag set → what the backend starts. Placeholders are filled here."""
    profile = ctx.matrix.servers[card.server]
    docker = card.backend == "docker"
    port = profile.port if (profile.port and not docker) else (0 if docker else free_port())
    values = {"port": str(profile.port if docker else port), "host": "0.0.0.0" if docker else "127.0.0.1",
              "model": profile.model, "python": sys.executable, "card": card.name, "gpu": card.gpu or "",
              "vram_gib": f"{card.vram_gib:g}", "flags": flags.name}
    argv = tuple(render(a, values) for a in (*profile.command, *flags.args))
    env = {k: render(v, values) for k, v in {**profile.env, **card.env, **flags.env}.items()}
    session_dir = ctx.store.session_dir(f"{card.name}/{flags.name}")
    return ServerSpec(
        name=_slug(f"runner-{ctx.run_id}-{card.name}-{flags.name}-{attempt}").lower(), argv=argv, env=env,
        host="127.0.0.1", port=port, health_path=profile.health_path,
        log_path=session_dir / ("server.log" if attempt == 0 else f"server.{attempt}.log"),
        image=profile.image, container_port=profile.port or None, publish_host=card.publish_host,
        docker_host=card.docker_host, gpu=card.gpu, mounts=profile.mounts, shm_size=profile.shm_size,
        ipc_mode=profile.ipc_mode,
        labels={"runner.managed": "true", "runner.run": ctx.run_id, "runner.card": card.name,
                "runner.flags": flags.name, "runner.attempt": str(attempt)},
    )


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

    def image(self, step: Step) -> tuple[str | None, Image.Image | None]:
        """The directory baseline for a step now; a cell baseline is scored after the run (rescore)."""
        sample = baseline.find(self.samples, step.fixture, step.references, step.seed)
        if sample is None:
            return None, None
        return str(sample.file), scoring.decode(sample.file.read_bytes())


class SessionRunner:
    def __init__(self, ctx: RunContext, session: Session, refs: References, baselines: Baselines) -> None:
        self.ctx, self.session, self.refs, self.baselines = ctx, session, refs, baselines
        self.card = ctx.matrix.cards[session.card]
        self.flags = ctx.matrix.flags[session.flags]
        self.profile = ctx.matrix.servers[self.card.server]
        self.run = ctx.matrix.run

    # -- records -------------------------------------------------------------------------------------
    def _base(self, step: Step, status: Status, **kw: object) -> StepRecord:
        return StepRecord(key=step.key, card=step.card, flags=step.flags, role=self.flags.role,
                          fixture=step.fixture, references=step.references, seed=step.seed, status=status,
                          **kw)  # type: ignore[arg-type]

    def _emit(self, record: StepRecord, png: bytes | None = None) -> StepRecord:
        self.ctx.store.write_step(record, png)
        self.ctx.events.step_done(record)
        return record

    def _skip(self, step: Step, reason: str) -> StepRecord:
        return self._emit(self._base(step, Status.SKIPPED, skip_reason=reason))

    # -- one request -----------------------------------------------------------------------------------
    def _request(self, step: Step) -> dialects.HttpCall:
        fixture = self.ctx.matrix.fixtures[step.fixture]
        refs = tuple(self.refs.get(p) for p in fixture.references[: step.references])
        req = dialects.ImageRequest(model=self.profile.model, prompt=fixture.prompt, references=refs,
                                    seed=step.seed, steps=self.run.steps, size=self.run.size,
                                    true_cfg_scale=self.run.true_cfg_scale,
                                    negative_prompt=self.run.negative_prompt)
        return dialects.build(self.profile.dialect, req)

    def _send(self, client: httpx.Client, server: RunningServer, call: dialects.HttpCall
              ) -> tuple[int | None, bytes, bool, float, float, str, int | None]:
        log0 = server.log_size()
        t0 = time.time()
        status, content, timed_out = None, b"", False
        try:
            response = client.post(server.base_url + call.path, json=call.body,
                                   timeout=httpx.Timeout(self.run.request_timeout_s, connect=10.0))
            status, content = response.status_code, response.content
        except httpx.TimeoutException:
            timed_out = True
        except httpx.HTTPError as exc:
            content = f"{type(exc).__name__}: {exc}".encode()
        t1 = time.time()
        exit_info = server.exited()
        if status is None or status >= 400:
            # The log line that explains a failure can trail the response (or the exit) by a moment.
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and (exit_info := server.exited()) is None and status is None:
                time.sleep(0.1)
            time.sleep(0.3)
        log_window = server.read_log(log0)
        return status, content, timed_out, t0, t1, log_window, None if exit_info is None else exit_info.code

    def execute(self, client: httpx.Client, server: RunningServer, meters: list[Meter], step: Step,
                attempt: int, check_determinism: bool) -> tuple[StepRecord, bytes | None]:
        call = self._request(step)
        status, content, timed_out, t0, t1, log_window, exit_code = self._send(client, server, call)
        parsed = dialects.parse(self.profile.dialect, content) if status == 200 else None
        image_bytes = parsed.image if parsed else None
        image = None
        problem = parsed.problem if parsed else None
        if image_bytes is not None:
            try:
                image = scoring.decode(image_bytes)
            except Exception as exc:  # any undecodable payload is a bad response, with its reason
                problem = f"image does not decode: {type(exc).__name__}: {exc}"
        failure = classify_request(http_status=status, body=content[:4000].decode("utf-8", "replace"),
                                   log_window=log_window, timed_out=timed_out, server_exit=exit_code,
                                   parse_problem=problem)
        peaks = _with_response_peak([m.window_peak(t0, t1) for m in meters],
                                    parsed.server_peak_mb if parsed else None)
        request = {"dialect": self.profile.dialect, "path": call.path, "steps": self.run.steps,
                   "size": list(self.run.size) if self.run.size else None, "seed": step.seed,
                   "references": [self.refs.digest(p) for p in
                                  self.ctx.matrix.fixtures[step.fixture].references[: step.references]]}
        common = dict(attempt=attempt, started_at=t0, wall_s=round(t1 - t0, 4), peaks=peaks, request=request,
                      server_peak_mb=parsed.server_peak_mb if parsed else None)
        if failure is not None or image is None or image_bytes is None:
            failure = failure or Failure(FailureClass.BAD_RESPONSE, problem or "no image", ())
            return self._base(step, Status.FAILED, failure=failure,
                              lost=failure.kind in RESTART_AFTER or exit_code is not None, **common), None
        name, base_image = self.baselines.image(step)
        rules = self.ctx.matrix.verdict
        scores = scoring.score(image, base_image, name, max_transparent_share=rules.max_transparent_share,
                               min_pixel_std=rules.min_pixel_std)
        deterministic = repeat_psnr = None
        if check_determinism:
            again = self._send(client, server, call)
            again_parsed = dialects.parse(self.profile.dialect, again[1]) if again[0] == 200 else None
            deterministic = bool(again_parsed and again_parsed.image == image_bytes)
            if again_parsed and again_parsed.image and not deterministic:
                # How far apart: numerical noise (high dB) or an ignored seed (low dB)?
                try:
                    repeat_psnr = scoring.score(scoring.decode(again_parsed.image), image, None).psnr_db
                except Exception:  # an undecodable repeat is simply not comparable
                    repeat_psnr = None
        record = self._base(step, Status.OK, image=Path(step.key).name + ".png",
                            image_sha256=hashlib.sha256(image_bytes).hexdigest(), scores=scores,
                            deterministic=deterministic, repeat_psnr_db=repeat_psnr, **common)
        return record, image_bytes

    # -- the session ---------------------------------------------------------------------------------
    def run_session(self) -> SessionRecord:
        pending = deque(s for s in self.session.steps if s.key not in self.ctx.done)
        log = _SessionLog.resume(self.ctx.store.load_session(self.session.key), len(pending))
        # An OOM already recorded (resume) still implies the larger reference counts.
        ooms = [r.references for s in self.session.steps if (r := self.ctx.done.get(s.key))
                and r.failure and r.failure.kind == FailureClass.OOM]
        self.oom_at = min(ooms) if ooms and self.run.stop_after_oom else None
        self.first_step = True
        attempt = len(log.starts)  # numbers server starts (and their log files) across resumes
        restarts_used = 0
        while pending and not self.ctx.stop.is_set():
            if (why := self._gpu_not_idle(log)) is not None:
                log.notes.append(why)
                self._skip_all(pending, why)
                break
            failure, lost = self._serve(attempt, pending, log)
            if failure is not None:
                self._skip_all(pending, f"server did not start: {failure.kind}")
                break
            if lost and restarts_used >= self.run.restarts:
                self._skip_all(pending, f"server died and {self.run.restarts} restart(s) were used")
                break
            if lost:
                restarts_used += 1
                attempt += 1
        self._skip_all(pending, "run interrupted")
        return self._write(log)

    def _gpu_not_idle(self, log: _SessionLog) -> str | None:
        """Whole-device meters include every process on the GPU: the baseline is taken before our server
        exists. A foreign holder stops the session under require_idle_gpu; nothing is ever killed."""
        baseline = idle_baseline(self.card)
        log.idle = log.idle or baseline.to_json()
        on_gpu = self.card.gpu is not None or bool({"nvml", "sidecar"} & set(self.card.meters))
        return baseline.stop_reason(self.run.require_idle_gpu) if on_gpu else None

    def _serve(self, attempt: int, pending: deque[Step], log: _SessionLog) -> tuple[Failure | None, bool]:
        """One server start: start it, wait until ready, send pending steps until none are left, the run
        stops, or the server is lost. Returns (start failure, lost). Always stops the server."""
        spec = server_spec(self.ctx, self.card, self.flags, attempt)
        server = backends.create(self.card.backend, spec)
        meters = build_meters(self.card, server, self.run.sample_hz)
        self.ctx.events.session_started(self.card.name, self.flags.name, attempt)
        t_start = time.time()
        for m in meters:
            m.start()
        ticker = _MemoryTicker(self.ctx.events, self.card.name, meters)
        ticker.start()
        failure: Failure | None = None
        ready_s: float | None = None
        lost = False
        t_ready = t_start
        try:
            try:
                server.start()
                ready_s = server.wait_ready(self.run.ready_timeout_s)
            except StartFailed as exc:
                failure = exc.failure
            except Exception as exc:  # the backend itself failed (engine unreachable, bad image...)
                failure = Failure(FailureClass.LOAD_EXIT, f"{type(exc).__name__}: {exc}"[:500])
                server.stop()
            t_ready = time.time()
            self.ctx.events.session_ready(self.card.name, self.flags.name, ready_s)
            if failure is None:
                lost = self._send_steps(server, meters, attempt, pending, log)
        finally:
            ticker.stop()
            server.stop()
            t_end = time.time()
            for m in meters:
                m.stop()
            log.peaks.extend(m.window_peak(t_start, t_end) for m in meters)
            log.meters.extend({**m.provenance(), "attempt": attempt} for m in meters)
            log.starts.append(ServerStart(attempt=attempt, started_at=t_start,
                                          ready_s=None if ready_s is None else round(ready_s, 3),
                                          failure=failure, stopped_at=t_end,
                                          load_peaks=tuple(m.window_peak(t_start, t_ready) for m in meters),
                                          info={**server.info(), "log": spec.log_path.name}))
            self.ctx.store.write_memory(self.session.key,
                                        (x for m in meters for x in (m.series(), *m.extra_series())), attempt)
            self._write(log)
        return failure, lost

    def _send_steps(self, server: RunningServer, meters: list[Meter], attempt: int, pending: deque[Step],
                    log: _SessionLog) -> bool:
        """Steps one at a time against a ready server; True when the server was lost (died or hung)."""
        with httpx.Client() as client:
            while pending and not self.ctx.stop.is_set():
                step = pending.popleft()
                if self.oom_at is not None and step.references > self.oom_at:
                    self._skip(step, f"implied by an out-of-memory at {self.oom_at} reference(s) in this session")
                    continue
                record, png = self.execute(client, server, meters, step, attempt,
                                           self.first_step and self.run.determinism_check)
                self.first_step = False
                self._emit(record, png)
                if record.failure and record.failure.kind == FailureClass.OOM and self.run.stop_after_oom:
                    self.oom_at = step.references if self.oom_at is None else min(self.oom_at, step.references)
                if record.lost or server.exited() is not None:
                    log.notes.append(f"server lost during {step.key} "
                                     f"({record.failure.kind if record.failure else 'exit'})")
                    return True
        return False

    def _skip_all(self, pending: deque[Step], reason: str) -> None:
        while pending:
            self._skip(pending.popleft(), reason)

    def _write(self, log: _SessionLog) -> SessionRecord:
        record = SessionRecord(key=self.session.key, card=self.card.name, flags=self.flags.name,
                               role=self.flags.role, backend=self.card.backend, starts=tuple(log.starts),
                               session_peaks=_max_by_source(log.peaks), meters=tuple(log.meters),
                               idle_baseline=log.idle, log="server.log", notes=tuple(log.notes))
        self.ctx.store.write_session(record)
        return record


@dataclass
class _SessionLog:
    """What a session has recorded so far; it grows while the session runs and is written as a
    SessionRecord after every server start. On resume it starts from the earlier record."""

    starts: list[ServerStart] = field(default_factory=list)
    peaks: list[Peak] = field(default_factory=list)
    meters: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    idle: dict = field(default_factory=dict)

    @classmethod
    def resume(cls, prior: SessionRecord | None, pending: int) -> _SessionLog:
        if prior is None:
            return cls()
        return cls(list(prior.starts), list(prior.session_peaks), list(prior.meters),
                   [*prior.notes, f"resumed with {pending} step(s) to send"], dict(prior.idle_baseline))


def _with_response_peak(peaks: list[Peak], peak_mb: float | None) -> tuple[Peak, ...]:
    """A `peak_memory_mb` in the response is the server's own exact peak for this request: it goes right
    before the polled server meter (which can miss a transient between polls), or last if none is listed."""
    if peak_mb is None:
        return tuple(peaks)
    reported = Peak("server-response", "device", int(peak_mb * 2**20), 1, None, True)
    at = next((i for i, p in enumerate(peaks) if p.source == "server"), len(peaks))
    return (*peaks[:at], reported, *peaks[at:])


def _max_by_source(peaks: list[Peak]) -> tuple[Peak, ...]:
    """One session peak per (source, metric) over all server starts."""
    best: dict[tuple[str, str], Peak] = {}
    for p in peaks:
        k = (p.source, p.metric)
        old = best.get(k)
        if old is None or (p.available and (not old.available or (p.bytes or 0) > (old.bytes or 0))):
            best[k] = p if old is None or not old.available else replace(p, samples=p.samples + old.samples)
    return tuple(best.values())


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


def run_plan(ctx: RunContext) -> list[SessionRecord]:
    refs, baselines = References(), Baselines(ctx.matrix, ctx.store)

    def lane_job(lane_index: int) -> list[SessionRecord]:
        lane = ctx.plan.lanes[lane_index]
        ctx.events.lane_started(lane.name, lane.cards, sum(len(s.steps) for s in lane.sessions))
        out = [SessionRunner(ctx, s, refs, baselines).run_session() for s in lane.sessions]
        ctx.events.lane_done(lane.name)
        return out

    results: list[SessionRecord] = []
    with ThreadPoolExecutor(max_workers=max(1, len(ctx.plan.lanes)), thread_name_prefix="lane") as pool:
        futures = [pool.submit(lane_job, i) for i in range(len(ctx.plan.lanes))]
        try:
            for f in futures:
                while True:
                    try:
                        results.extend(f.result(timeout=0.5))
                        break
                    except TimeoutError:
                        continue
        except KeyboardInterrupt:
            ctx.stop.set()  # lanes stop after their current request; servers are stopped in finally
            for f in futures:
                f.result()
            raise
    return results


def rescore_against_cell(ctx: RunContext) -> int:
    """Score every image against the baseline cell's image of the same fixture, references and seed."""
    b = ctx.matrix.baseline
    if not b or not b.cell:
        return 0
    rules = ctx.matrix.verdict
    steps = ctx.store.load_steps()
    card, flags = b.cell
    base = {(s.card if card is None else None, s.fixture, s.references, s.seed): s for s in steps
            if s.card == (card or s.card) and s.flags == flags and s.status == Status.OK}
    count = 0
    for s in steps:
        if s.status != Status.OK:
            continue
        png = ctx.store.read_png(s.key)
        ref = base.get((s.card if card is None else None, s.fixture, s.references, s.seed))
        ref_png = ctx.store.read_png(ref.key) if ref else None
        if png is None:
            continue
        scores = scoring.score(scoring.decode(png), scoring.decode(ref_png) if ref_png else None,
                               ref.key if ref else None, max_transparent_share=rules.max_transparent_share,
                               min_pixel_std=rules.min_pixel_std)
        if ref is None:
            scores = replace(scores, reason=f"baseline cell {card or s.card}/{flags} has no image for this "
                                            f"fixture, reference count and seed")
        updated = replace(s, scores=scores)
        ctx.store.write_step(updated)
        count += 1
    return count
