"""Sending one step's request to a running server, back to back: each send timed and bounded (runner.observe.bounded),
its answer classified (runner.observe.failures), the server's log over it kept. No records here: runner.run.step_records
builds them from the sends, and runner.run.execute decides when to send.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import httpx

from runner.backends.base import ExitInfo, RunningServer
from runner.core.records import Failure, FailureClass
from runner.observe import bounded
from runner.observe.failures import classify_request, references_dropped
from runner.observe.traceback import SERVER_PACKAGES
from runner.run import dialects
from runner.run.interrupts import interruptible
from runner.run.step_records import HttpResult, Observed, Sends


def repeat_label(total: int) -> Callable[[int], str | None]:
    """How a failing send is named in its failure: the first as it is, a repeat by its place."""
    return lambda i: None if i == 0 else f"send {i + 1} of {total} of the same request"


@dataclass(frozen=True)
class Sender:
    """How one session sends to one server start: through its dialect, within the run's deadline and body
    cap; the run's stop event abandons a request in flight at once."""

    client: httpx.Client
    server: RunningServer
    dialect: str
    deadline_s: float
    size: tuple[int, int] | None
    stop: threading.Event
    own: tuple[str, ...] = SERVER_PACKAGES  # where an OOM's site may be: the servers' packages and the model's

    def send(self, call: dialects.HttpCall) -> HttpResult:
        server = self.server
        log0 = server.log_size()
        t0 = time.time()
        status, content, timed_out, problem = None, b"", False, None
        try:  # request_timeout_s is the whole answer's deadline, and the body has a cap (bounded.py)
            # On an interrupt the request in flight is abandoned at once (Abandoned), not waited for.
            answer = interruptible(lambda: bounded.exchange(
                self.client, "POST", server.base_url + call.path, **call.httpx_kwargs(),
                deadline_s=self.deadline_s, max_bytes=bounded.body_cap(self.size)), self.stop)
            status, content = answer.status, answer.content
        except bounded.Overdue:
            timed_out = True
        except bounded.TooLarge as exc:
            problem = f"response refused: {exc} (the requested image needs far less)"
        except httpx.HTTPError as exc:
            content = f"{type(exc).__name__}: {exc}".encode()
        t1 = time.time()
        exit_info = server.exited()
        if problem is None and (status is None or status >= 400):
            # The log line that explains a failure can trail the response (or the exit) by a moment.
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and (exit_info := server.exited()) is None and status is None:
                time.sleep(0.1)
            time.sleep(0.3)
        return HttpResult(status, content, timed_out, t0, t1, server.read_log(log0),
                          None if exit_info is None else exit_info.code,
                          exit_info is not None and exit_info.oom_killed, problem)

    def observe(self, sent: HttpResult, references: int) -> Observed:
        """What the session policy needs now (OOM? server lost?); the image is decoded on the scoring worker,
        where an undecodable one becomes a bad_response record. Every text of the server is quoted."""
        server = self.server
        parsed = dialects.parse(self.dialect, sent.content) if sent.status == 200 and not sent.problem else None
        image_bytes = parsed.image if parsed else None
        problem = sent.problem or (parsed.problem if parsed else None)
        if sent.problem and sent.exit_code is None:  # refused unread: what the server meant is unknown
            failure: Failure | None = Failure(kind=FailureClass.BAD_RESPONSE, message=sent.problem, evidence=(),
                                              http_status=sent.status)
        else:
            failure = classify_request(http_status=sent.status, body=server.quote(sent.content[:4000]),
                                       log_window=sent.log_window, timed_out=sent.timed_out,
                                       server_exit=sent.exit_code, parse_problem=problem,
                                       oom_killed=sent.oom_killed, own=self.own) or references_dropped(
                log_window=sent.log_window, sent=references, http_status=sent.status)
        if failure is None and image_bytes is None:
            failure = Failure(kind=FailureClass.BAD_RESPONSE, message=problem or "no image", evidence=())
        return Observed(None if failure is None else server.quote_failure(failure),
                        image_bytes if failure is None else None, parsed.server_peak if parsed else None,
                        server.quote(parsed.peak_unread) if parsed and parsed.peak_unread else None,
                        parsed.stage_durations if parsed else None)

    def repeats(self, call: dialects.HttpCall, references: int, total: int, *,
                label: Callable[[int], str | None], against_sha256: str | None = None) -> Sends:
        """Send one request `total` times, back to back, classifying each answer; the first failing send ends
        it (a repeat that crashes or hangs is that crash or timeout, never a served step). `different` is
        the first image unlike the first send's, or unlike the recorded image `against_sha256` (a top-up)."""
        sends: list[HttpResult] = []
        first: Observed | None = None
        failure: Failure | None = None
        different: bytes | None = None
        reported: list[dialects.ServerPeak] = []
        unread: list[str] = []
        for i in range(total):
            sent = self.send(call)
            seen = self.observe(sent, references)
            sends.append(replace(sent, content=b""))  # only the images kept below are needed from here on
            if seen.server_peak is not None:
                reported.append(seen.server_peak)
            elif seen.peak_unread is not None:
                unread.append(seen.peak_unread)
            if seen.failure is not None:
                named = label(i)
                failure = seen.failure if named is None else seen.failure.model_copy(
                    update={"message": f"{named}: {seen.failure.message}"})
                break
            if first is None:
                first = seen
                if against_sha256 is None:
                    continue
            if different is None and _unlike(seen.image_bytes, first, against_sha256):
                different = seen.image_bytes
        return Sends(tuple(sends), first, engine_lost(failure, self.server.exited()), different, tuple(reported),
                     tuple(unread))


def _unlike(image: bytes | None, first: Observed, against_sha256: str | None) -> bool:
    if against_sha256 is not None:
        return hashlib.sha256(image or b"").hexdigest() != against_sha256
    return image != first.image_bytes


def engine_lost(failure: Failure | None, gone: ExitInfo | None) -> Failure | None:
    """A request that failed while the server's engine went away measured nothing about the server: it is
    `stopped` (a resume sends it again), not the connection error or crash it looked like."""
    if failure is None or gone is None or gone.lost is None or failure.kind in (FailureClass.OOM,
                                                                                 FailureClass.STOPPED):
        return failure
    return Failure(kind=FailureClass.STOPPED,
                   message=f"server lost during the request: {gone.lost}; not a measurement, a "
                   f"resume sends it again", evidence=failure.evidence, http_status=failure.http_status,
                   exit_code=failure.exit_code)
