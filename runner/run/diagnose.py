"""The diagnosis pass: for a flag set whose deciding failure is a device OOM (at load or in a request), one more
start of its server with the allocator history on (the dialect's profiler interface: vLLM-Omni's
--profiler-config, POST /start_profile, /stop_profile), the deciding request sent once more, the allocator
snapshot collected into the session folder. With `[run] diagnosis = "always"` also the peak of the last
served reference count.

Recorded apart (<card>/<flags>/diagnosis.json, runner.core.records.DiagnosisRecord): no meter runs, nothing
it measures is a timed sample or a peak of a cell; it runs after the lane's measured sends. A server without
the interface, a remote Docker host, or a load OOM of a server that writes nothing before its port opens is
one line in the record (`why_none`), never invented sites.
"""

from __future__ import annotations

import fnmatch
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from runner import backends
from runner.backends.base import Attempt, StartFailed
from runner.core.records import DiagnosisRecord, FailureClass, SessionRecord, Status, StepRecord
from runner.core.registry import BACKENDS, load
from runner.core.units import fmt_bytes, slug
from runner.judge.findings.held import Reading
from runner.judge.findings.memory import deciding_oom
from runner.observe import bounded, snapshot, trace
from runner.observe.traceback import SERVER_PACKAGES
from runner.plan.lanes import Session, Step
from runner.run import dialects
from runner.run.store import inside

DIAGNOSIS = "diagnosis.json"
FOLDER = "diagnosis"
CONTROL_TIMEOUT_S = 120.0  # /start_profile, /stop_profile: a dump of a large history takes a while
MAX_SNAPSHOTS = 64


@dataclass(frozen=True)
class Target:
    at: str  # "oom" | "peak"
    of: str  # the step key, or the session key at load
    step: Step | None  # None: a load OOM (the start itself is the diagnosis)


def targets(mode: str, session: Session, steps: list[StepRecord], record: SessionRecord | None,
            target_references: int) -> list[Target]:
    """What a flag set's diagnosis pass sends (pure): the deciding device OOM's request (or its load); with
    `always` also the first step of the highest served reference count and of the lowest."""
    if mode == "off":
        return []
    mine = [s for s in steps if s.card == session.card and s.flags == session.flags]
    out = []
    oom = deciding_oom(mine, record, target_references)
    if oom is not None and oom.memory == "device":
        step = next((s for s in mine if s.key == oom.record), None)
        if oom.references is None:
            out.append(Target("oom", oom.record, None))
        elif step is not None:
            out.append(Target("oom", oom.record, Step(step.card, step.flags, step.fixture, step.references, step.seed)))
    if mode == "always":  # the highest served count's peak, and the lowest's: which site grows per reference
        served = [s for s in mine if s.status == Status.OK]
        counts = sorted({s.references for s in served}, reverse=True)
        for n in dict.fromkeys((counts[0], counts[-1])) if counts else ():
            s = min((x for x in served if x.references == n), key=lambda x: (x.fixture, x.seed))
            out.append(Target("peak", s.key, Step(s.card, s.flags, s.fixture, s.references, s.seed)))
    return out


def _written(folder: Path, pattern: str) -> list[Path]:
    """The files named like `pattern` the server wrote under its profiler folder, newest first (a bounded walk)."""
    found: list[Path] = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(dirs)[:MAX_SNAPSHOTS]
        found += [Path(root) / f for f in files if fnmatch.fnmatchcase(f, pattern)]
        if len(found) >= MAX_SNAPSHOTS:
            break
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def _trace_reading(path: Path) -> tuple[trace.TraceMemory | None, str]:
    """The trace's memory events, or None and why not (one line)."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > trace.MAX_FILE_BYTES:
            raise trace.TraceError("not a regular file within the size bound")
        return trace.read_bytes(path.read_bytes()), ""
    except (OSError, trace.TraceError) as exc:
        return None, f"its trace {path.name} not read: {exc}"


def _control(client: httpx.Client, base: str, path: str) -> str | None:
    """POST a profiler endpoint; None when it answered 2xx, else why not (one line)."""
    try:
        answer = bounded.exchange(client, "POST", base + path, deadline_s=CONTROL_TIMEOUT_S, max_bytes=64 * 1024)
    except (bounded.Overdue, bounded.TooLarge, httpx.HTTPError) as exc:
        return f"POST {path}: {type(exc).__name__}"
    return None if 200 <= answer.status < 300 else f"POST {path} answered {answer.status}"


def run_target(session_runner: object, target: Target) -> DiagnosisRecord:
    """One diagnosis pass (side effects: a server start, three requests, files). `session_runner` is the
    session's execute.SessionRunner (its plan, store, references and request building)."""
    from runner.run.execute import SessionRunner

    assert isinstance(session_runner, SessionRunner)
    r = session_runner
    ctx, session = r.ctx, r.session
    key = session.key
    name = "oom" if target.at == "oom" else f"peak-{target.step.references if target.step else 0}"
    folder = ctx.store.session_dir(key) / FOLDER / name
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    base = dict(key=key, card=session.card, flags=session.flags, at=target.at, of=target.of,
                references=target.step.references if target.step else None, started_at=t0)

    def done(**kw: object) -> DiagnosisRecord:
        return DiagnosisRecord(**base, total_s=round(time.time() - t0, 3), **kw)  # type: ignore[arg-type]

    plan = session.server
    assert plan is not None
    try:
        plan, seen_as = load(BACKENDS.get(plan.backend).profile_dir)(plan, folder / "profile")
    except ValueError as exc:
        return done(outcome="not run", why_none=f"no allocator snapshot: {exc}")
    prof = dialects.profiler(r.profile.dialect, seen_as)
    if prof is None:
        return done(outcome="not run", why_none="no allocator snapshot: this server cannot record one (its "
                                                "dialect has no profiler interface)")
    (folder / "profile").mkdir(exist_ok=True)
    plan = replace(plan, argv=(*plan.argv, *prof.args))
    attempt = Attempt(name=slug(f"runner-{ctx.run_id}-{session.card}-{session.flags}-diag-{name}").lower(),
                      log_path=folder / "server.log", labels={"runner.run": ctx.run_id, "runner.diagnosis": name})
    server = backends.create(plan, attempt)
    ctx.live.add(server)
    start_s = request_s = None
    outcome = "served"
    why: str | None = None
    try:
        try:
            start_s = server.launch(r.run.ready_timeout_s, stop=ctx.stop)
        except StartFailed as exc:
            kind = exc.failure.kind
            outcome = "oom at load" if kind == FailureClass.OOM_AT_LOAD else f"start failed: {kind}"
            if target.step is not None or exc.failure.kind != FailureClass.OOM_AT_LOAD:
                why = f"no allocator snapshot: the diagnosis start failed ({exc.failure.kind})"
        except Exception as exc:  # the backend itself failed
            outcome, why = "not run", f"no allocator snapshot: the diagnosis start failed ({type(exc).__name__})"
        else:
            if target.step is None:  # the deciding load OOM did not repeat
                outcome, why = "loaded", "no allocator snapshot: the load did not run out of memory this time"
            else:
                with bounded.client() as client:
                    if prof.warm_first:  # unmeasured: it only puts the profiler's start on the serving thread
                        r.sender(client, server).send(r._request(target.step))
                    t1 = time.time()
                    why = _control(client, server.base_url, prof.start_path)
                    if why is None:
                        sent = r.sender(client, server).send(r._request(target.step))
                        seen = r.sender(client, server).observe(sent, target.step.references)
                        outcome = ("served" if seen.failure is None else
                                   "oom" if seen.failure.kind == FailureClass.OOM else str(seen.failure.kind))
                        if server.exited() is None:
                            why = _control(client, server.base_url, prof.stop_path)
                    request_s = round(time.time() - t1, 3)
    finally:
        server.stop()
        server.seal_log()
        ctx.live.discard(server)
    found = _written(folder / "profile", prof.pattern)
    if found:
        rel = found[0].relative_to(ctx.store.root).as_posix()
        return done(start_s=None if start_s is None else round(start_s, 3), request_s=request_s, outcome=outcome,
                    snapshot=rel, log=(folder / "server.log").relative_to(ctx.store.root).as_posix())
    traced: dict[str, object] = {}
    if why is None:
        why = ("no allocator snapshot: the server's port never opened at the load OOM and it wrote none (vLLM-Omni's "
               "endpoints cannot take one there)" if target.step is None else
               "no allocator snapshot: the server wrote none")
        # Where it wrote a trace instead (vLLM-Omni on a device without allocator history), its memory events are
        # a reading of their own: said as what they are, never as a snapshot's sites.
        traces = _written(folder / "profile", prof.trace) if prof.trace and target.step is not None else []
        if traces:
            memory, not_read = _trace_reading(traces[0])
            traced["trace"] = traces[0].relative_to(ctx.store.root).as_posix()
            if memory is None:
                why += f"; {not_read}"
            elif memory.peak_allocated is None:
                why += f"; its profiler trace has no memory figure ({memory.events} [memory] events)"
            else:
                traced.update(trace_peak_bytes=memory.peak_allocated, trace_device=memory.device)
                why += (f"; its profiler trace's memory events (the {memory.device} allocator, the profiling thread, "
                        f"from /start_profile on, no sites) peak at {fmt_bytes(memory.peak_allocated)} allocated")
    elif not why.startswith("no allocator snapshot"):
        why = f"no allocator snapshot: {why}"
    return done(start_s=None if start_s is None else round(start_s, 3), request_s=request_s, outcome=outcome,
                why_none=why, log=(folder / "server.log").relative_to(ctx.store.root).as_posix(), **traced)


LOAD_BEGAN_US = 2**62  # a load OOM has no request: everything live was held by the load (resident)


def readings(store: object, own: Mapping[str, tuple[str, ...]] | None = None
             ) -> dict[tuple[str, str], tuple[Reading, ...]]:
    """Every diagnosis record's snapshot, read (runner.observe.snapshot): by (card, flags), its sites relative to
    the card's server and model packages (`own`, by card). A snapshot that is refused or broken is its one line,
    never a traceback."""
    from runner.run.store import RunStore

    assert isinstance(store, RunStore)
    out: dict[tuple[str, str], list[Reading]] = {}
    for d in store.load_diagnoses():
        held, why = None, d.why_none
        if d.snapshot is not None:
            try:
                path = inside(store.root, d.snapshot)
                data = path.read_bytes() if path.stat().st_size <= snapshot.MAX_FILE_BYTES else b""
                if not data:
                    raise snapshot.SnapshotError(f"too large: more than {snapshot.MAX_FILE_BYTES} bytes")
                # The runner asked /start_profile (which clears the history) just before the request: the trace
                # is the request's own (began at 0); at a load OOM everything live was the load's.
                held = snapshot.read_bytes(data, LOAD_BEGAN_US if d.references is None and d.at == "oom" else 0,
                                           (own or {}).get(d.card, SERVER_PACKAGES))
            except (OSError, ValueError) as exc:  # SnapshotError is a ValueError; inside() refuses escapes
                why = f"allocator snapshot {d.snapshot} not read: {exc}"
        out.setdefault((d.card, d.flags), []).append(
            Reading(record=d.key, at=d.at, references=d.references, file=d.snapshot, held=held, why=why))
    return {k: tuple(v) for k, v in out.items()}
