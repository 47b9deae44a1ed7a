"""Failure classification: pure functions over what was observed, returning a FailureClass.

vLLM-Omni reports a mid-request CUDA OOM as an HTTP 500 with a mangled message; the OOM text appears only
in its log. So the server log lines written during the request window are evidence too. An OOM failure
carries PyTorch's message taken apart and its site in the server's code (runner.observe.oom.read_oom). A
failure's evidence starts with the server's own last error lines (`error_lines`): the OOM line, the cause an
exception chain began with before the wrapper it ended with, an ERROR-level log line; an HTTP error's body
message before them — what a reader needs to see why, without opening server.log. An access-log line is
never the server's words about why (`server_lines`).
"""

from __future__ import annotations

import json
import re

from runner.core.records import Failure, FailureClass, OomReport
from runner.observe.oom import read_oom
from runner.observe.scheduler import cluster_end
from runner.observe.traceback import MARKERS, SERVER_PACKAGES, chains, package_path, strip_prefix

# slurmstepd's end-of-step cause → the failure class (the scheduler ended it; it says nothing about memory)
CLUSTER_CLASS = {"cancelled": FailureClass.CANCELLED, "preempted": FailureClass.PREEMPTED,
                 "time_limit": FailureClass.TIME_LIMIT, "node_failure": FailureClass.NODE_FAILURE}

OOM_PATTERN = re.compile(r"CUDA out of memory|OutOfMemoryError|out of memory", re.IGNORECASE)


# The last line of a Python traceback (`ModuleNotFoundError: No module named 'x'`, `torch.OutOfMemoryError:
# ...`): an unindented dotted name ending in Error/Exception/... and a colon or the end of the line.
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Fault)(:|$)")
# A log record at error level: `ERROR refserver: ...`, vLLM's `ERROR 11-30 12:00:00 [x.py:12] ...`.
ERROR_LEVEL = re.compile(r"\b(ERROR|CRITICAL|FATAL)\b")


# A leading log timestamp (`2026-11-30 02:53:37,691 `, `[2026-11-30T02:53:37.691Z] `): noise in a one-line reason.
LOG_STAMP = re.compile(r"^\[?\d{4}-\d\d-\d\d[ T][\d:.,]+Z?\]?\s*")


def without_stamp(line: str) -> str:
    return LOG_STAMP.sub("", line)


def oom_lines(text: str, limit: int = 3) -> tuple[str, ...]:
    return tuple(line.strip()[:400] for line in text.splitlines() if OOM_PATTERN.search(line))[:limit]


def _chain(text: str) -> tuple[list[str], list[tuple[str | None, str]]]:
    """(every exception line, the last exception chain as (marker before it, exception line) root cause
    first), read line by line with the process, rank and logger prefixes read off: from a log excerpt, or
    from a failure's evidence, which keeps the chain's markers between its lines. An exception line the
    chain already holds is the same failure printed again (vLLM-Omni prints one up to four times: two
    loggers, the thread's excepthook, the main thread's exit), not a new one."""
    seen: list[str] = []
    found: list[list[tuple[str | None, str]]] = []
    marker: str | None = None
    for raw in text.splitlines():
        line = strip_prefix(raw).rstrip()
        if line.strip() in MARKERS:
            marker = line.strip()
            continue
        if not EXCEPTION_LINE.match(line):
            continue
        exc = line.strip()[:400]
        seen.append(exc)
        if found and exc in (e for _, e in found[-1]):
            marker = None
            continue
        if marker is not None and found:
            found[-1].append((marker, exc))
        else:
            found.append([(None, exc)])
        marker = None
    return seen, (found[-1] if found else [])


def _typed_oom(line: str) -> bool:
    return "OutOfMemory" in line.split(":", 1)[0]


def error_lines(text: str, limit: int = 3) -> tuple[str, ...]:
    """The server's own last error lines in a log excerpt, most telling first: the out-of-memory error (a
    `torch.OutOfMemoryError` line, else the last chain's OOM link, else the last line with OOM text), the
    cause that the text's last exception chain began with ("The above exception was the direct cause of the
    following exception:", "During handling of the above exception, …"), then the exception the chain ended
    with (the wrapper, e.g. vLLM-Omni's `RuntimeError: Orchestrator initialization failed:`); else the last
    error-level log line. Empty when the text has none."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    ooms = [ln.strip() for ln in lines if OOM_PATTERN.search(ln)]
    seen, chain = _chain(text)
    typed = [e for e in seen if _typed_oom(e)]
    in_chain = [e for _, e in chain if OOM_PATTERN.search(e)]
    oom = typed[-1:] or in_chain[:1] or ooms[-1:]
    picked = [*oom, *(e for _, e in chain[:1]), *(e for _, e in chain[-1:])]
    errors = [ln.strip() for ln in lines if ERROR_LEVEL.search(ln)]
    return tuple(dict.fromkeys(ln[:400] for ln in picked or errors[-1:]))[:limit]


def _evidence(text: str) -> tuple[str, ...]:
    """The server's error lines first (a chain's links with the markers between them, as Python prints
    them, so the cause stays first when the evidence is read again), then the log's last lines for context
    (no line twice)."""
    said = error_lines(text)
    _, chain = _chain(text)
    linked = [line for marker, exc in chain for line in (marker, exc) if line is not None] if len(chain) > 1 else []
    first = [ln for ln in said if ln not in linked]
    return tuple(dict.fromkeys((*first, *linked, *tail(text))))


def cause(text: str) -> str | None:
    """The error a log excerpt ended with, as a reason: the cause its last exception chain began with, and
    where it was raised when the line names no message of its own (a bare `NotImplementedError`: the
    innermost frame of its traceback, package-relative); else the last error-level line. None: neither."""
    _, chain = _chain(text)
    if not chain:
        found = error_lines(text)
        return without_stamp(found[0]) if found else None
    root = chain[0][1]
    if root.rstrip(":").strip() == root.split(":", 1)[0]:  # no message: where it was raised says what it is
        link = next((c[0] for c in reversed(chains(text)) if c[0][1] == root and c[0][0]), None)
        if link is not None:
            path, line, function, _ = link[0][-1]
            return f"{root.rstrip(':')} (raised in {function}, {package_path(path)[0]}:{line})"
    return root


def _with_cause(message: str, text: str) -> str:
    """A message with the server's own error appended (the cause of a chained exception), when there is one."""
    found = cause(text)
    return f"{message}: {found}" if found else message


# An HTTP access-log line (uvicorn: `INFO:     127.0.0.1:50624 - "POST /v1/images/edits HTTP/1.1" 400 Bad
# Request`): the server recording that it answered, never its words about why.
ACCESS_LOG = re.compile(r'"[A-Z]+ \S+ HTTP/[\d.]+" \d{3}\b')


def body_message(body: str) -> str | None:
    """The message of an HTTP error body, as the server wrote it: OpenAI's and vLLM-Omni's `{"error":
    {"message": …}}`, `{"error": "…"}`, `{"message": …}`, FastAPI's `{"detail": "…"}` or its validation list
    (`detail[0].msg`, with its `loc`). A body cut short (the runner keeps its first 4000 bytes) is searched
    for the first `"message"` string. None when the body carries no message."""
    try:
        doc = json.loads(body)
    except ValueError:
        m = re.search(r'"message"\s*:\s*("(?:[^"\\]|\\.)*")', body)
        try:
            found = json.loads(m.group(1)) if m else None
        except ValueError:
            return None
        return found[:600] if isinstance(found, str) and found.strip() else None
    err = doc.get("error", doc) if isinstance(doc, dict) else None
    if isinstance(err, str):
        return err[:600] or None
    if not isinstance(err, dict):
        return None
    for key in ("message", "detail"):
        value = err.get(key)
        if isinstance(value, str) and value.strip():
            return value[:600]
        first = value[0] if isinstance(value, list) and value else None
        if isinstance(first, dict) and isinstance(msg := first.get("msg"), str):
            where = first.get("loc")
            loc = ".".join(str(x) for x in where if isinstance(x, (str, int))) if isinstance(where, list) else ""
            return (f"{loc}: " if loc else "") + msg[:600]
    return None


def server_lines(failure: Failure) -> tuple[str, ...]:
    """A failure's words from the server, most telling first: for an HTTP error the body's own message
    (kept first in the evidence), then the server's error lines in the evidence (the OOM, a chain's cause,
    its wrapper); where the scheduler ended the server, its line; else the evidence's last line that is not
    an HTTP access-log line. Never an access-log line: it says that the server answered, not why."""
    if failure.kind in CLUSTER_CLASS.values():
        return failure.evidence[:1]
    said = error_lines("\n".join(failure.evidence))
    if failure.kind == FailureClass.HTTP_ERROR and failure.evidence and failure.evidence[0].startswith("HTTP "):
        said = (failure.evidence[0], *said)
    words = tuple(ln for ln in failure.evidence if not ACCESS_LOG.search(ln))
    return tuple(dict.fromkeys(said))[:3] or words[-1:]


HOST_OOM = ("killed by the kernel OOM killer: host memory (the container's memory limit or the machine's RAM), "
            "not device memory")
# What a kernel OOM kill tells of itself: which memory, and that there is no allocator message nor traceback.
KILLED = OomReport(message="the container engine reports the server OOM-killed (OOMKilled)", source="engine",
                   memory="host", no_site="the kernel's OOM killer ends the process without a traceback")

# Exit codes of a server stopped by a signal someone else sent (the runner stops servers only between
# requests): a shell's 128+N (containers: `docker stop`, an engine shutting down) or Popen's -N. SIGKILL is not
# here: the kernel's OOM killer sends it too.
OUTSIDE_STOP = {143: "SIGTERM", -15: "SIGTERM", 129: "SIGHUP", -1: "SIGHUP", 130: "SIGINT", -2: "SIGINT"}


def classify_request(*, http_status: int | None, body: str, log_window: str, timed_out: bool,
                     server_exit: int | None, parse_problem: str | None, oom_killed: bool = False,
                     own: tuple[str, ...] = SERVER_PACKAGES) -> Failure | None:
    """A request's outcome → a Failure, or None when an image came back."""
    body_oom, log_oom = oom_lines(body), oom_lines(log_window)
    if oom_killed:  # the engine says so (docker's State.OOMKilled): an OOM, of host memory, not a crash
        return Failure(kind=FailureClass.OOM, message=f"server {HOST_OOM}, during the request",
                       evidence=log_oom or _evidence(log_window), http_status=http_status, exit_code=server_exit,
                       oom=KILLED)
    # A server the scheduler is ending may still answer (a 500 as it shuts down): its line decides.
    failed = server_exit is not None or http_status is None or http_status >= 400
    ended = _ended_by_scheduler(log_window) if failed else None
    if ended is not None and not log_oom:
        return ended
    if server_exit is not None:
        if not log_oom and server_exit in OUTSIDE_STOP:
            return Failure(kind=FailureClass.STOPPED,
                           message=f"server was stopped from outside during the request (exit code {server_exit}: "
                           f"{OUTSIDE_STOP[server_exit]}); not a measurement, a resume sends it again",
                           evidence=_evidence(log_window), http_status=http_status, exit_code=server_exit)
        if log_oom:
            return Failure(kind=FailureClass.OOM, message=f"server exited with code {server_exit} during the request",
                           evidence=log_oom, http_status=http_status, exit_code=server_exit,
                           oom=read_oom(body=body, log=log_window, own=own))
        return Failure(kind=FailureClass.CRASH,
                       message=_with_cause(f"server exited with code {server_exit} during the request", log_window),
                       evidence=_evidence(log_window), http_status=http_status, exit_code=server_exit)
    if timed_out:
        return Failure(kind=FailureClass.TIMEOUT, message="no response within the request deadline",
                       evidence=_evidence(log_window))
    if http_status is None:
        return Failure(kind=FailureClass.CONNECTION, message=body[:300] or "connection failed",
                       evidence=_evidence(log_window))
    if http_status >= 400:
        if body_oom or log_oom:
            where = "response body" if body_oom else "server log during the request"
            said = body_message(body) if body_oom else None  # its words, not the JSON they came in
            evidence = ((said,) if said and OOM_PATTERN.search(said) else body_oom) if body_oom else log_oom
            return Failure(kind=FailureClass.OOM, message=f"HTTP {http_status}; out-of-memory text in the {where}",
                           evidence=evidence, http_status=http_status,
                           oom=read_oom(body=body, log=log_window, own=own))
        said = body_message(body)  # the server's words about why, before any log line
        head = (f"HTTP {http_status}: {said}",) if said else ()
        return Failure(kind=FailureClass.HTTP_ERROR, message=head[0] if head else f"HTTP {http_status}: {body[:300]}",
                       evidence=tuple(dict.fromkeys((*head, *_evidence(log_window)))), http_status=http_status)
    if parse_problem:
        return Failure(kind=FailureClass.BAD_RESPONSE, message=parse_problem, evidence=(), http_status=http_status)
    return None


DROPPED_REF = re.compile(r"Failed to decode reference image")
RECEIVED_REFS = re.compile(r"ref_images=(\d+)")


def references_dropped(*, log_window: str, sent: int, http_status: int | None) -> Failure | None:
    """A served request whose server used fewer references than were sent → a failure, else None.

    vLLM-Omni 0.30 logs "Failed to decode reference image: ..." per reference it cannot decode and serves
    the request without it (HTTP 200); it also logs "Diffusion chat request <id>: ref_images=N" with the
    count it received (a count below `sent` means references were lost before decoding). The response
    itself carries no count, so the request's log window is the evidence."""
    if sent <= 0:
        return None
    lines = log_window.splitlines()
    drops = [ln.strip()[:400] for ln in lines if DROPPED_REF.search(ln)]
    counts = [int(m.group(1)) for ln in lines if (m := RECEIVED_REFS.search(ln))]
    received = counts[-1] if counts else sent
    served = min(received, sent) - len(drops)
    if served >= sent:
        return None
    evidence = tuple(drops) or tuple(ln.strip()[:400] for ln in lines if RECEIVED_REFS.search(ln))[-1:]
    return Failure(kind=FailureClass.REFERENCES_DROPPED,
                   message=f"HTTP {http_status} with an image, but the server served {max(served, 0)} of {sent} "
                   "references (the rest were dropped)", evidence=evidence[:4], http_status=http_status)


# How much of a failed start's log the classifier reads: vLLM-Omni prints a failed start's traceback chain up to
# four times (a real one is 60 KB), and an OOM a library swallowed is logged before all of them.
START_LOG_BYTES = 256 * 1024


def classify_start(*, exit_code: int | None, oom_killed: bool, timed_out: bool, log_tail: str,
                   own: tuple[str, ...] = SERVER_PACKAGES) -> Failure:
    """A server that never became ready → why. An OOM anywhere in the excerpt decides it (one a library
    swallowed and logged, then failed otherwise, included: the OOM is the cause); else the cause its last
    exception chain began with, the wrapper kept in the evidence."""
    ooms = oom_lines(log_tail)
    ended = _ended_by_scheduler(log_tail, "before it was ready")
    if ended is not None and not ooms:
        return ended.model_copy(update={"exit_code": exit_code})
    if ooms or oom_killed:
        if oom_killed and not ooms:
            return Failure(kind=FailureClass.OOM_AT_LOAD, message=HOST_OOM, evidence=tail(log_tail), http_status=None,
                           exit_code=exit_code, oom=KILLED)
        return Failure(kind=FailureClass.OOM_AT_LOAD, message="out of memory at load",
                       evidence=tuple(dict.fromkeys((*error_lines(log_tail)[:1], *ooms))), http_status=None,
                       exit_code=exit_code, oom=read_oom(log=log_tail, own=own, ended=True))
    if timed_out:
        return Failure(kind=FailureClass.READY_TIMEOUT, message=_with_cause("not ready before the deadline", log_tail),
                       evidence=_evidence(log_tail), http_status=None, exit_code=exit_code)
    return Failure(kind=FailureClass.LOAD_EXIT,
                   message=_with_cause(f"server exited with code {exit_code} before it was ready", log_tail),
                   evidence=_evidence(log_tail), http_status=None, exit_code=exit_code)


def _ended_by_scheduler(text: str, when: str = "during the request") -> Failure | None:
    """The scheduler's own line that it ended the server (Slurm: `*** STEP 12.0 ON n1 CANCELLED AT ... DUE
    TO PREEMPTION ***`) → that class, the line first in the evidence; None when no scheduler ended it."""
    end = cluster_end(text)
    if end is None:
        return None
    what = {"cancelled": "cancelled by the scheduler (scancel)", "preempted": "preempted by the scheduler",
            "time_limit": "ended by the scheduler at the allocation's time limit",
            "node_failure": "lost with its node (node failure)"}[end.cause]
    return Failure(kind=CLUSTER_CLASS[end.cause], message=f"server {what} {when}", evidence=(end.line, *tail(text, 4)))


# An object's repr inside an exception message (`<_io.BytesIO object at 0x7f3a…>`): a different address every
# run, so the same failure would read differently each time (and `runner compare` would see a change).
_OBJECT_REPR = re.compile(r"<([\w.]+) object at 0x[0-9a-fA-F]+>")


def without_addresses(text: str) -> str:
    return _OBJECT_REPR.sub(lambda m: f"<{m.group(1)}>", text)


def tail(text: str, lines: int = 8) -> tuple[str, ...]:
    return tuple(line[:400] for line in text.strip().splitlines()[-lines:])
