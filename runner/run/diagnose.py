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

import contextlib
import fnmatch
import functools
import io
import os
import re
import stat
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from PIL import Image

from runner import backends
from runner.backends.base import Attempt, StartFailed, StartInterrupted
from runner.core.records import NOT_RUN, DiagnosisRecord, FailureClass, SessionRecord, Status, StepRecord
from runner.core.registry import BACKENDS, load
from runner.core.units import fmt_bytes, slug
from runner.judge.findings.held import Reading
from runner.judge.findings.memory import deciding_oom
from runner.judge.findings.retention import KEEPS, retention
from runner.observe import bounded, isolated, quote, server_file, snapshot, trace
from runner.observe.failures import START_LOG_BYTES
from runner.observe.traceback import SERVER_PACKAGES
from runner.plan.lanes import Session, Step
from runner.run import dialects
from runner.run.interrupts import Abandoned, interruptible
from runner.run.store import RunStore

if TYPE_CHECKING:  # the executor calls this module: its type only, no import at run time (no circle)
    from runner.run.execute import SessionRunner

DIAGNOSIS = "diagnosis.json"
FOLDER = "diagnosis"
CONTROL_TIMEOUT_S = 120.0  # /start_profile, /stop_profile: a dump of a large history takes a while
MAX_SNAPSHOTS = 64


@dataclass(frozen=True)
class Target:
    at: str  # "oom" | "peak" | "kept"
    of: str  # the step key, or the session key at load
    step: Step | None  # None: a load OOM (the start itself is the diagnosis)


def targets(mode: str, session: Session, steps: list[StepRecord], record: SessionRecord | None,
            target_references: int) -> list[Target]:
    """What a flag set's diagnosis pass sends (pure): the deciding device OOM's request (or its load); where the
    level grew after its requests (runner.judge.findings.retention), the highest served count's first request, to
    see what stays live after it; with `always` also the first step of the highest served reference count and of
    the lowest."""
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
    kept = retention(mine, None, record.retention_probe if record is not None else None)
    served = [s for s in mine if s.status == Status.OK]
    if kept is not None and kept.kind in KEEPS and served:  # what its request leaves live after it, by site
        n = max(s.references for s in served)
        s = min((x for x in served if x.references == n), key=lambda x: (x.fixture, x.seed))
        out.append(Target("kept", s.key, Step(s.card, s.flags, s.fixture, s.references, s.seed)))
    if mode == "always":  # the highest served count's peak, and the lowest's: which site grows per reference
        served = [s for s in mine if s.status == Status.OK]
        counts = sorted({s.references for s in served}, reverse=True)
        for n in dict.fromkeys((counts[0], counts[-1])) if counts else ():
            s = min((x for x in served if x.references == n), key=lambda x: (x.fixture, x.seed))
            out.append(Target("peak", s.key, Step(s.card, s.flags, s.fixture, s.references, s.seed)))
    return out


def _written(folder: Path, pattern: str) -> list[tuple[Path, os.stat_result]]:
    """What the server wrote under its profiler folder named like `pattern` (files, links, FIFOs, folders: each
    with its own lstat, never followed), newest first; a bounded walk that never descends into a link, and
    an entry that is gone by the time it is looked at is left out (a dangling link is listed: it is refused)."""
    found: list[tuple[Path, os.stat_result]] = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(dirs)[:MAX_SNAPSHOTS]
        for name in sorted([*files, *dirs]):
            if fnmatch.fnmatchcase(name, pattern):
                with contextlib.suppress(OSError):
                    found.append((Path(root) / name, os.lstat(Path(root) / name)))
        if len(found) >= MAX_SNAPSHOTS:
            break
    return sorted(found, key=lambda x: x[1].st_mtime, reverse=True)


def taken(found: Iterable[tuple[Path, os.stat_result]], root: Path, secrets: Iterable[str] = ()
          ) -> tuple[str | None, str | None]:
    """(the newest regular file with a plain name, relative to the run folder, or None; why none was taken,
    when something was found): a link, a FIFO, a folder, a name with control characters or a secret is
    refused here, before any record names it (pure)."""
    refused: list[str] = []
    for path, info in found:
        rel = path.relative_to(root).as_posix()
        if not stat.S_ISREG(info.st_mode):
            refused.append(f"{quote.console(quote.server_text(path.name, secrets, 200))} is "
                           f"{server_file.kind(info.st_mode)}, not a regular file")
        elif not server_file.plain_name(rel, secrets):
            refused.append("its name is not plain text (control characters, spaces, markup or a secret)")
        else:
            return rel, None
    return None, (f"what the server wrote was not taken: {refused[0]}" if refused else None)


def _trace_reading(root: Path, relative: str) -> tuple[trace.TraceMemory | None, str]:
    """The trace's memory events (read as a snapshot is: runner.observe.server_file, isolated), or None and
    why not (one line)."""
    name = relative.rsplit("/", 1)[-1]
    try:
        data = server_file.read(root, relative, trace.MAX_FILE_BYTES)
        return trace.TraceMemory(**isolated.read("trace", data, {}, trace.TraceError)), ""
    except ValueError as exc:  # NotRead, TraceError
        return None, f"its trace {name} not read: {exc}"


def _endpoints_only(session_dir: Path, prof: dialects.Profiler) -> str | None:
    """The line of the session's server log, bounded and made inert, that shows its profiler starts only through
    its endpoints (Profiler.endpoints_only); None where the log has none or cannot be read."""
    if prof.endpoints_only is None:
        return None
    try:
        with open(session_dir / "server.log", "rb") as log:
            head = log.read(START_LOG_BYTES).decode("utf-8", "replace")  # the banner comes before the load
    except OSError:
        return None
    found = re.search(prof.endpoints_only, head)
    return None if found is None else quote.console(quote.server_text(found.group(0), (), 80))


def _control(client: httpx.Client, base: str, path: str, stop: threading.Event) -> str | None:
    """POST a profiler endpoint; None when it answered 2xx, else why not (one line). Interruptible as a
    measured send is: Abandoned as soon as the run is stopped."""
    try:
        answer = interruptible(lambda: bounded.exchange(client, "POST", base + path, deadline_s=CONTROL_TIMEOUT_S,
                                                        max_bytes=64 * 1024), stop)
    except (bounded.Overdue, bounded.TooLarge, httpx.HTTPError) as exc:
        return f"POST {path}: {type(exc).__name__}"
    return None if 200 <= answer.status < 300 else f"POST {path} answered {answer.status}"


def run_target(session_runner: SessionRunner, target: Target) -> DiagnosisRecord:
    """One diagnosis pass (side effects: a server start, three requests, files). `session_runner` is the
    session's execute.SessionRunner (its plan, store, references and request building). Whatever fails in it
    is the record's outcome and `why_none`; an interrupt is Abandoned (nothing to record: a resume runs the
    pass again)."""
    r = session_runner
    ctx, session = r.ctx, r.session
    key = session.key
    name = target.at if target.at in ("oom", "kept") else f"peak-{target.step.references if target.step else 0}"
    folder = ctx.store.session_dir(key) / FOLDER / name
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    base = dict(key=key, card=session.card, flags=session.flags, at=target.at, of=target.of,
                references=target.step.references if target.step else None, started_at=t0)

    def done(**kw: object) -> DiagnosisRecord:
        return DiagnosisRecord(**base, total_s=round(time.time() - t0, 3), **kw)

    plan = session.server
    assert plan is not None
    try:
        plan, seen_as = load(BACKENDS.get(plan.backend).profile_dir)(plan, folder / "profile")
    except ValueError as exc:
        return done(outcome=NOT_RUN, why_none=f"no allocator snapshot: {exc}")
    prof = dialects.profiler(r.profile.dialect, seen_as)
    if prof is None:
        return done(outcome=NOT_RUN, why_none="no allocator snapshot: this server cannot record one (its "
                                                "dialect has no profiler interface)")
    said = _endpoints_only(ctx.store.session_dir(key), prof) if target.step is None else None
    if said is not None:  # a restart would load the model again only to run out again, with nothing written
        return done(outcome=NOT_RUN, why_none=f"no allocator snapshot: its log says \"{said}\": vLLM's profiler "
                                                "starts only through its endpoints, and its port never opens at a "
                                                "load OOM (no pass was started)")
    (folder / "profile").mkdir(exist_ok=True)
    plan = replace(plan, argv=(*plan.argv, *prof.args))
    attempt = Attempt(name=slug(f"runner-{ctx.run_id}-{session.card}-{session.flags}-diag-{name}").lower(),
                      log_path=folder / "server.log", labels={"runner.run": ctx.run_id, "runner.diagnosis": name})
    server = backends.create(plan, attempt)
    ctx.live.add(server)
    start_s = request_s = None
    stale: tuple[Path, int] | None = None  # the snapshot before the request, where it could not be removed
    outcome = "served"
    why: str | None = None
    try:
        try:
            start_s = server.launch(r.run.ready_timeout_s, stop=ctx.stop)
        except StartInterrupted:  # the run was stopped while the server loaded: not this pass's result
            raise Abandoned() from None
        except StartFailed as exc:
            kind = exc.failure.kind
            outcome = "oom at load" if kind == FailureClass.OOM_AT_LOAD else f"start failed: {kind}"
            if target.step is not None or exc.failure.kind != FailureClass.OOM_AT_LOAD:
                why = f"no allocator snapshot: the diagnosis start failed ({exc.failure.kind})"
        except Exception as exc:  # the backend itself failed
            outcome, why = NOT_RUN, f"no allocator snapshot: the diagnosis start failed ({type(exc).__name__})"
        else:
            if target.step is None:  # the deciding load OOM did not repeat
                outcome, why = "loaded", "no allocator snapshot: the load did not run out of memory this time"
            else:
                with bounded.client() as client:
                    if prof.warm_first:  # unmeasured: it only puts the profiler's start on the serving thread
                        # A kept pass warms with a picture no step sends: its request must find nothing cached
                        warm = (r._request(target.step, (unseen_reference(),)) if target.at == "kept"
                                else r._request(target.step))
                        r.sender(client, server).send(warm)
                    if target.at == "kept":  # what was live before the request: see _before
                        why, stale = _before(client, server.base_url, prof, folder, ctx.store.root, server.secrets,
                                             ctx.stop)
                    t1 = time.time()
                    why = why or _control(client, server.base_url, prof.start_path, ctx.stop)
                    if why is not None:  # nothing was sent under the profiler: no outcome of the request
                        outcome = "profiler failed"
                    else:
                        sent = r.sender(client, server).send(r._request(target.step))
                        seen = r.sender(client, server).observe(sent, target.step.references)
                        outcome = ("served" if seen.failure is None else
                                   "oom" if seen.failure.kind == FailureClass.OOM else str(seen.failure.kind))
                        if server.exited() is None:
                            why = _control(client, server.base_url, prof.stop_path, ctx.stop)
                    request_s = round(time.time() - t1, 3)
    finally:
        server.stop()
        server.seal_log()
        ctx.live.discard(server)
    log = (folder / "server.log").relative_to(ctx.store.root).as_posix()
    kept = dict(start_s=None if start_s is None else round(start_s, 3), request_s=request_s, outcome=outcome, log=log)
    root, secrets = ctx.store.root, server.secrets
    found, refused = taken([(p, st) for p, st in _written(folder / "profile", prof.pattern)
                            if (p, st.st_mtime_ns) != stale], root, secrets)
    before = folder / BEFORE
    if found:
        return done(**kept, snapshot=found,
                    before=before.relative_to(root).as_posix() if before.is_file() else None)
    traced: dict[str, object] = {}
    if why is None and refused is not None:
        why = f"no allocator snapshot: {refused}"
    if why is None:
        why = ("no allocator snapshot: the server's port never opened at the load OOM and it wrote none (vLLM-Omni's "
               "endpoints cannot take one there)" if target.step is None else
               "no allocator snapshot: the server wrote none")
        # Where it wrote a trace instead (vLLM-Omni on a device without allocator history), its memory events are
        # a reading of their own: said as what they are, never as a snapshot's sites.
        trace_at, not_taken = (taken(_written(folder / "profile", prof.trace), root, secrets)
                               if prof.trace and target.step is not None else (None, None))
        if not_taken is not None:
            why += f"; its trace: {not_taken}"
        if trace_at is not None:
            memory, not_read = _trace_reading(root, trace_at)
            traced["trace"] = trace_at
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
    return done(**kept, why_none=quote.console(quote.server_text(why, secrets, 2000)), **traced)


BEFORE = "before/memory_snapshot.pickle"  # a kept pass's snapshot with nothing sent under the profiler


def _before(client: httpx.Client, base: str, prof: dialects.Profiler, folder: Path, root: Path,
            secrets: Iterable[str], stop: threading.Event) -> tuple[str | None, tuple[Path, int] | None]:
    """A kept pass's snapshot with nothing sent under the profiler (start, then stop): the blocks live before
    the request. A block live in it and after the request is not the request's, however long the request's
    trace — a 1024² request wraps the servers' 100,000-event history, and a block whose alloc was overwritten
    could be either (the H200 kept passes, docs/evidence/h200-retention). Copied aside at once: the server may
    write the request's snapshot under the same name within the same second. (why the profiler failed, in a line,
    or None; the original with its mtime where it could not be removed — a container's root-owned file — so
    that it is never taken for the request's.)"""
    why = _control(client, base, prof.start_path, stop) or _control(client, base, prof.stop_path, stop)
    if why is not None:
        return why, None
    found, _ = taken(_written(folder / "profile", prof.pattern), root, secrets)
    if found is None:
        return None, None  # no snapshot before: the request's is read as it would be without one
    try:
        data = server_file.read(root, found, snapshot.MAX_FILE_BYTES)
        mtime = os.lstat(root / found).st_mtime_ns
    except (ValueError, OSError):
        return None, None
    (folder / BEFORE).parent.mkdir(parents=True, exist_ok=True)
    (folder / BEFORE).write_bytes(data)
    try:
        os.unlink(root / found)
    except OSError:
        return None, (root / found, mtime)
    return None, None


def failed(session: Session, target: Target, started_at: float, exc: BaseException) -> DiagnosisRecord:
    """The record of a pass that failed in a way run_target did not foresee: the failure named, never a lane's end."""
    return DiagnosisRecord(key=session.key, card=session.card, flags=session.flags, at=target.at, of=target.of,
                           references=target.step.references if target.step else None, started_at=started_at,
                           total_s=round(max(0.0, time.time() - started_at), 3), outcome="failed",
                           why_none=f"no allocator snapshot: the diagnosis pass failed ({type(exc).__name__})")


@functools.cache
def unseen_reference() -> tuple[str, bytes]:
    """A reference no step sends (a mid-grey PNG the runner draws): what a kept pass warms the server with, so
    that a cache across requests holds none of the references its measured request brings."""
    out = io.BytesIO()
    Image.new("RGB", (64, 64), (127, 127, 127)).save(out, format="PNG")
    return "image/png", out.getvalue()


LOAD_BEGAN_US = 2**62  # a load OOM has no request: everything live was held by the load (resident)


def readings(store: RunStore, own: Mapping[str, tuple[str, ...]] | None = None, secrets: Iterable[str] = ()
             ) -> dict[tuple[str, str], tuple[Reading, ...]]:
    """Every diagnosis record's snapshot, read (runner.observe.snapshot, in the bounded child of
    runner.observe.isolated, from a file opened as runner.observe.server_file opens one): by (card, flags), its
    sites relative to the card's server and model packages (`own`, by card), `secrets` (the values resolved into
    the servers' environments) masked in every text. Whatever goes wrong with one snapshot is its one line,
    never a traceback and never the report's end."""
    masked = tuple(secrets)
    out: dict[tuple[str, str], list[Reading]] = {}
    for d in store.load_diagnoses():
        held, why = None, d.why_none
        if d.snapshot is not None:
            try:
                data = server_file.read(store.root, d.snapshot, snapshot.MAX_FILE_BYTES)
                # The runner asked /start_profile (which clears the history) just before the request: the trace
                # is the request's own (began at 0); at a load OOM everything live was the load's. A kept pass
                # reads what is live at the snapshot (after the request), not at the request's high point.
                began = LOAD_BEGAN_US if d.references is None and d.at == "oom" else 0
                # A kept pass's snapshot before the request: what was live then is not the request's
                before = (isolated.read("live", server_file.read(store.root, d.before, snapshot.MAX_FILE_BYTES),
                                        {}, snapshot.SnapshotError) if d.before is not None else None)
                held = snapshot.from_json(isolated.read("snapshot", data, {
                    "request_began_us": began, "own": list((own or {}).get(d.card, SERVER_PACKAGES)),
                    "secrets": list(masked), "at_end": d.at == "kept", "before": before}, snapshot.SnapshotError))
            except ValueError as exc:  # NotRead, SnapshotError: our one line
                why = f"allocator snapshot {d.snapshot} not read: {exc}"
            except Exception as exc:  # anything else: named, and the report goes on
                why = f"allocator snapshot {d.snapshot} not read: {type(exc).__name__}"
        out.setdefault((d.card, d.flags), []).append(
            Reading(record=d.key, at=d.at, references=d.references, file=d.snapshot, held=held,
                    why=None if why is None else quote.console(quote.server_text(why, masked, 2000))))
    return {k: tuple(v) for k, v in out.items()}
