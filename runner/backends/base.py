"""The server seam: start, wait until ready while watching the process, read logs, stop — for any backend.

Readiness is `GET health_path` answering 200 under the runner's own deadline; an exit meanwhile fails fast
with the exit code and the log tail (vLLM-Omni may exit at an init OOM, or hang without listening).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from runner.core.records import Failure, FailureClass
from runner.core.secrets import resolved_values
from runner.observe import bounded, quote
from runner.observe.failures import START_LOG_BYTES, classify_start
from runner.observe.quote import LIMIT as QUOTE_LIMIT
from runner.plan.lanes import RUNTIME_PORT, ServerPlan

PROBE_S = 5.0  # one readiness probe's total deadline (within ready_timeout_s)
PROBE_BYTES = 1 << 20  # a /health answer larger than this is not one
PORT_TRIES = 3  # starts of one server whose picked port another process may take before it listens
# A server that could not listen because the port was taken: Python's errno text, uvicorn's, Go/C servers'.
ADDRESS_IN_USE = re.compile(r"\[Errno 98\]|address already in use|EADDRINUSE", re.IGNORECASE)


def port_loss_notes(start: int, losses: Sequence[str]) -> list[str]:
    """One note per try of server start `start` that lost its picked port, for the session's record: each loss
    was followed by another try, except the last when the losses used up PORT_TRIES: that one ended the start
    (`launch`), and its note says so (issue 46 L-1)."""
    gave_up = len(losses) >= PORT_TRIES
    return [f"start {start}: {lost}; " + ("the start failed: the port was lost at every try"
                                          if gave_up and i == len(losses) - 1 else "started again on another port")
            for i, lost in enumerate(losses)]


@dataclass(frozen=True)
class Attempt:
    """What one start adds to the planned server: its name, its log file and the run's labels."""

    name: str  # deterministic: runner-<run id>-<card>-<flags>-<attempt>
    log_path: Path
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ExitInfo:
    code: int | None
    oom_killed: bool = False
    lost: str | None = None  # the server can no longer be seen, and why (its Docker engine went away)


class StartInterrupted(Exception):
    """The run was interrupted while the server loaded; it has been stopped (not a start failure)."""


class StartFailed(Exception):
    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class PortLost(StartFailed):
    """The port the backend picked was taken by another process before the server listened on it: not the
    server's failure (a free port is only free until someone binds it), so `launch` starts it again."""


class RunningServer(ABC):
    """One start of a planned server. The backend reads the plan as it is and decides the port; `start` and
    `stop` are the only side effects; `stop` is idempotent."""

    def __init__(self, plan: ServerPlan, attempt: Attempt) -> None:
        self.plan, self.attempt = plan, attempt
        self.port: int | None = None  # the port the runner reaches, once the backend decided it
        self.port_losses: list[str] = []  # why each earlier try of this start lost its picked port
        self._secrets: tuple[str, ...] | None = None
        self._try_log_from = 0  # where this try's output begins in the log (earlier tries' lines are before)

    @property
    def name(self) -> str:
        return self.attempt.name

    @property
    def log_path(self) -> Path:
        return self.attempt.log_path

    @property
    def labels(self) -> dict[str, str]:
        return {**self.plan.labels, **self.attempt.labels}

    @property
    def secrets(self) -> tuple[str, ...]:
        """The values this runner resolved into the server's environment (masked in all it quotes)."""
        if self._secrets is None:
            self._secrets = resolved_values(self.plan.env, os.environ)
        return self._secrets

    def quote(self, text: str | bytes, limit: int = QUOTE_LIMIT) -> str:
        """Text this server sent (log, body, error), as the runner may keep it: masked, inert, bounded."""
        return quote.server_text(text, self.secrets, limit)

    def quote_failure(self, failure: Failure) -> Failure:
        """A failure built from this server's text, with that text quoted (messages hold body excerpts)."""
        return failure.model_copy(update={"message": self.quote(failure.message, 2000),
                                          "evidence": tuple(self.quote(line, 2000) for line in failure.evidence)})

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port or 0}"

    def command(self, port: int) -> tuple[tuple[str, ...], dict[str, str]]:
        """The plan's argv and env for this start: the port the backend chose, put where the plan left
        RUNTIME_PORT (a profile with port 0)."""
        fill = str(port)
        return (tuple(a.replace(RUNTIME_PORT, fill) for a in self.plan.argv),
                {k: v.replace(RUNTIME_PORT, fill) for k, v in self.plan.env.items()})

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def exited(self) -> ExitInfo | None:
        """None while the server runs."""

    @abstractmethod
    def stop(self) -> None: ...

    def end_try(self) -> None:
        """Stop this try of the start only, so that `start` can run again (what the server holds beyond one
        try, as a Slurm allocation, stays); by default the same as `stop`."""
        self.stop()

    def kill(self) -> None:
        """Stop at once (a second Ctrl-C): no grace period; best effort, never raises."""
        self.stop()

    def host_memory_bytes(self) -> int | None:
        """Host RAM held by the server (RSS or container usage); None when unknown."""
        return None

    def info(self) -> dict[str, Any]:
        return {}

    def meter_url(self, meter: str) -> tuple[str | None, str | None]:
        """(url, why not) of a meter this backend started beside the server itself (slurm: the sidecar
        step); (None, None) when it starts none and the card's own URL applies."""
        return None, None

    @property
    def port_picked(self) -> bool:
        """Whether the backend picked the port just before the server binds it (so another process may take
        it first, and another pick is as good); False for a fixed port or one the engine binds at start."""
        return False

    def foreign_answer(self) -> str | None:
        """Why the process answering on the server's address is not the one this runner started, or None.

        Checked before every readiness probe: a busy fixed port must never make the runner measure someone
        else's server."""
        return None

    # The log is a file in the session directory for every backend, so OOM lines are found the same way.
    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def read_log(self, start: int = 0, end: int | None = None, limit: int = QUOTE_LIMIT) -> str:
        try:
            with self.log_path.open("rb") as f:
                f.seek(start)
                data = f.read(-1 if end is None else max(0, end - start))
        except FileNotFoundError:
            return ""
        return self.quote(data, limit)  # every reader of the log gets it masked and inert

    def seal_log(self) -> None:
        """Once the server is stopped: its log rewritten as the runner keeps server text (quote.py: resolved
        values masked, control characters visible), so no file of the run holds a secret or a raw escape.
        Line by line into a temporary file, then renamed over it; a log that cannot be rewritten stays.

        Never raises: it runs where a session closes, often while a StoreError (a full or read-only results
        folder) is on its way to the one line the user sees; on a read-only file system even removing a
        temporary file that was never made fails (EROFS), and that must not replace it (issue 46 D-1)."""
        path = self.log_path
        tmp = path.with_name(f".{path.name}.sealing")
        try:
            with path.open("rb") as src, tmp.open("wb") as out:
                for line in src:
                    out.write(quote.inert(quote.mask(line.decode("utf-8", "replace"), self.secrets)).encode())
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)

    def log_tail(self, size: int = START_LOG_BYTES) -> str:
        """The end of the log a failed start is classified from (failures.START_LOG_BYTES: the whole of a
        vLLM-Omni failure, which prints its traceback chain several times)."""
        return self.read_log(max(0, self.log_size() - size), limit=size)

    @property
    def own_packages(self) -> tuple[str, ...]:
        """The packages an OOM's site may be in: the servers' own, and the model's this profile names."""
        return self.plan.profile.own_packages

    def launch(self, deadline_s: float, stop: threading.Event | None = None) -> float:
        """`start` then `wait_ready`; a try that lost its picked port to another process is stopped and
        started again on a new one, at most PORT_TRIES times (each loss kept in `port_losses`)."""
        while True:
            self._try_log_from = self.log_size()
            self.start()
            try:
                return self.wait_ready(deadline_s, stop=stop)
            except PortLost as lost:
                self.port_losses.append(lost.failure.message)
                if len(self.port_losses) >= PORT_TRIES:
                    raise StartFailed(lost.failure.model_copy(update={
                        "message": f"{lost.failure.message} (the port was lost to another process at each of "
                                   f"{PORT_TRIES} starts)"})) from None

    def wait_ready(self, deadline_s: float, poll_s: float = 0.25, stop: threading.Event | None = None) -> float:
        """Seconds until ready; raises StartFailed (after stopping the server) when it never is, and
        StartInterrupted (after stopping it) as soon as `stop` is set."""
        t0 = time.monotonic()
        url = self.base_url + self.plan.profile.health_path
        with bounded.client() as client:
            while True:
                if stop is not None and stop.is_set():
                    self.stop()
                    raise StartInterrupted()
                self._fail_if_exited()
                # Who listens is checked before every probe, so not even the probe reaches a foreign server.
                foreign = self.foreign_answer()
                if foreign is not None:
                    # A server that exited since the line above took its port with it: its exit says why
                    # (an OOM kill at load), not the vanished port (a clean-clone run met this race).
                    self._fail_if_exited()
                    if self.port_picked:
                        self.end_try()
                        raise PortLost(Failure(kind=FailureClass.LOAD_EXIT, message=foreign))
                    self.stop()
                    raise StartFailed(Failure(kind=FailureClass.LOAD_EXIT, message=foreign))
                # Each probe has a total deadline inside ready_timeout_s: a /health that drips never holds it.
                left = deadline_s - (time.monotonic() - t0)
                try:
                    answer = bounded.exchange(client, "GET", url, deadline_s=max(0.05, min(PROBE_S, left)),
                                              max_bytes=PROBE_BYTES)
                    if answer.status == 200:
                        return time.monotonic() - t0
                except (httpx.HTTPError, bounded.Overdue, bounded.TooLarge):
                    pass
                if time.monotonic() - t0 > deadline_s:
                    self.stop()
                    raise StartFailed(classify_start(exit_code=None, oom_killed=False, timed_out=True,
                                                     log_tail=self.log_tail(), own=self.own_packages))
                time.sleep(poll_s)

    def _fail_if_exited(self) -> None:
        """At load: a server that exited is stopped and its start fails, classified from its exit and log."""
        gone = self.exited()
        if gone is not None:
            said = self.read_log(max(self._try_log_from, self.log_size() - 16_384)) if self.port_picked else ""
            if ADDRESS_IN_USE.search(said):
                self.end_try()
                line = next(ln for ln in reversed(said.splitlines()) if ADDRESS_IN_USE.search(ln))
                raise PortLost(Failure(kind=FailureClass.LOAD_EXIT, message=f"port {self.port} was taken before "
                                       f"the server listened on it: {line.strip()[:300]}"))
            self.stop()
            raise StartFailed(classify_start(exit_code=gone.code, oom_killed=gone.oom_killed, timed_out=False,
                                             log_tail=self.log_tail(), own=self.own_packages))


def same_path(plan: ServerPlan, folder: Path) -> tuple[ServerPlan, str]:
    """A local server (or a Slurm step, whose working directory is the run folder on a shared filesystem) sees
    the runner's folders where the runner does."""
    return plan, str(folder)

