"""Failure classification: pure functions over what was observed, returning a FailureClass.

vLLM-Omni reports a mid-request CUDA OOM as an HTTP 500 with a mangled message; the OOM text appears only
in its log. So the server log lines written during the request window are evidence too.
"""

from __future__ import annotations

import re

from runner.records import Failure, FailureClass

OOM_PATTERN = re.compile(r"CUDA out of memory|OutOfMemoryError|out of memory", re.IGNORECASE)


def oom_lines(text: str, limit: int = 3) -> tuple[str, ...]:
    return tuple(line.strip()[:400] for line in text.splitlines() if OOM_PATTERN.search(line))[:limit]


def classify_request(*, http_status: int | None, body: str, log_window: str, timed_out: bool,
                     server_exit: int | None, parse_problem: str | None) -> Failure | None:
    """A request's outcome → a Failure, or None when an image came back."""
    body_oom, log_oom = oom_lines(body), oom_lines(log_window)
    if server_exit is not None:
        evidence = log_oom or tail(log_window)
        return Failure(FailureClass.OOM if log_oom else FailureClass.CRASH,
                       f"server exited with code {server_exit} during the request", evidence,
                       http_status, server_exit)
    if timed_out:
        return Failure(FailureClass.TIMEOUT, "no response within the request deadline", tail(log_window))
    if http_status is None:
        return Failure(FailureClass.CONNECTION, body[:300] or "connection failed", tail(log_window))
    if http_status >= 400:
        if body_oom or log_oom:
            where = "response body" if body_oom else "server log during the request"
            return Failure(FailureClass.OOM, f"HTTP {http_status}; out-of-memory text in the {where}",
                           body_oom or log_oom, http_status)
        return Failure(FailureClass.HTTP_ERROR, f"HTTP {http_status}: {body[:300]}", tail(log_window),
                       http_status)
    if parse_problem:
        return Failure(FailureClass.BAD_RESPONSE, parse_problem, (), http_status)
    return None


def classify_start(*, exit_code: int | None, oom_killed: bool, timed_out: bool, log_tail: str) -> Failure:
    """A server that never became ready → why."""
    ooms = oom_lines(log_tail)
    if ooms or oom_killed:
        what = "killed by the kernel OOM killer" if oom_killed and not ooms else "out of memory at load"
        return Failure(FailureClass.OOM_AT_LOAD, what, ooms or tail(log_tail), None, exit_code)
    if timed_out:
        return Failure(FailureClass.READY_TIMEOUT, "not ready before the deadline", tail(log_tail), None,
                       exit_code)
    return Failure(FailureClass.LOAD_EXIT, f"server exited with code {exit_code} before it was ready",
                   tail(log_tail), None, exit_code)


def tail(text: str, lines: int = 8) -> tuple[str, ...]:
    return tuple(line[:400] for line in text.strip().splitlines()[-lines:])
