"""Failure classification: pure functions over what was observed, returning a FailureClass.

vLLM-Omni reports a mid-request CUDA OOM as an HTTP 500 with a mangled message; the OOM text appears only
in its log. So the server log lines written during the request window are evidence too. An OOM failure
carries PyTorch's message taken apart and its site in the server's code (runner.observe.oom.read_oom). A
failure's evidence starts with the server's own last error lines (`error_lines`): the OOM line, the traceback's last
line, an ERROR-level log line — what a reader needs to see why, without opening server.log.
"""

from __future__ import annotations

import re

from runner.core.records import Failure, FailureClass, OomReport
from runner.observe.oom import read_oom
from runner.observe.scheduler import cluster_end
from runner.observe.traceback import SERVER_PACKAGES

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


def error_lines(text: str, limit: int = 3) -> tuple[str, ...]:
    """The server's own last error lines in a log excerpt, most telling first: the last OOM line, the last
    traceback line (the exception), else the last error-level log line. Empty when the text has none."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    ooms = [ln.strip() for ln in lines if OOM_PATTERN.search(ln)]
    exceptions = [ln for ln in lines if EXCEPTION_LINE.match(ln)]
    errors = [ln.strip() for ln in lines if ERROR_LEVEL.search(ln)]
    picked = [*ooms[-1:], *exceptions[-1:]] or errors[-1:]
    return tuple(dict.fromkeys(ln[:400] for ln in picked))[:limit]


def _evidence(text: str) -> tuple[str, ...]:
    """The server's error lines first, then the log's last lines for context (no line twice)."""
    return tuple(dict.fromkeys((*error_lines(text), *tail(text))))


def _with_cause(message: str, text: str) -> str:
    """A message with the server's own last error line appended, when there is one."""
    found = error_lines(text)
    return f"{message}: {without_stamp(found[0])}" if found else message


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
            return Failure(kind=FailureClass.OOM, message=f"HTTP {http_status}; out-of-memory text in the {where}",
                           evidence=body_oom or log_oom, http_status=http_status,
                           oom=read_oom(body=body, log=log_window, own=own))
        return Failure(kind=FailureClass.HTTP_ERROR, message=f"HTTP {http_status}: {body[:300]}",
                       evidence=_evidence(log_window),
                       http_status=http_status)
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


def classify_start(*, exit_code: int | None, oom_killed: bool, timed_out: bool, log_tail: str,
                   own: tuple[str, ...] = SERVER_PACKAGES) -> Failure:
    """A server that never became ready → why."""
    ooms = oom_lines(log_tail)
    ended = _ended_by_scheduler(log_tail, "before it was ready")
    if ended is not None and not ooms:
        return ended.model_copy(update={"exit_code": exit_code})
    if ooms or oom_killed:
        if oom_killed and not ooms:
            return Failure(kind=FailureClass.OOM_AT_LOAD, message=HOST_OOM, evidence=tail(log_tail), http_status=None,
                           exit_code=exit_code, oom=KILLED)
        return Failure(kind=FailureClass.OOM_AT_LOAD, message="out of memory at load", evidence=ooms, http_status=None,
                       exit_code=exit_code,
                       oom=read_oom(log=log_tail, own=own))
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
