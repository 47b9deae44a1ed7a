"""SIGINT, SIGTERM and SIGHUP end a run the same way; a dropped ssh session (SIGHUP) is the common case.

First signal: one line at once saying what happens, and the run's stop event is set: lanes abandon the
request in flight (it is recorded as "run interrupted", so a resume sends it again), stop the servers they
started and record the rest as interrupted; the records are kept, a partial report is written and the resume
command printed; the exit status is 128 + the signal (130, 143, 129).
Second signal: stop now: every server of this run still up is killed and the runner exits at once with the
same status (the records on disk are whole: each was written atomically; `--resume` finishes the rest).

After SIGHUP the terminal is gone: writes to it would fail (EIO) in the middle of the shutdown, so stdout
and stderr become streams that drop what cannot be written.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, TextIO, TypeVar

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
T = TypeVar("T")


def exit_code(signum: int) -> int:
    return 128 + signum


class Abandoned(Exception):
    """The run was interrupted while this call was in flight; its result, if any comes, is not used."""


def interruptible(call: Callable[[], T], stop: threading.Event, poll_s: float = 0.1) -> T:
    """`call()` on a helper thread, its result or its exception; Abandoned as soon as `stop` is set. The
    abandoned call ends by itself when what it waits on goes away (the server is stopped next)."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def work() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=work, name="send", daemon=True).start()
    while not done.wait(poll_s):
        if stop.is_set():
            raise Abandoned()
    if "error" in box:
        raise box["error"]
    return box["value"]


class _Forgiving:
    """A text stream whose writes never raise (the terminal behind it may be gone)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        with contextlib.suppress(OSError, ValueError):
            return self._stream.write(text)
        return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _say(text: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        print(text, file=sys.stderr, flush=True)


class Interrupts:
    """Signal handling for one run: `install` in the main thread, `restore` when the run ends."""

    def __init__(self, stop: threading.Event, kill_now: Callable[[], None]) -> None:
        self.stop, self.kill_now = stop, kill_now
        self.signum: int | None = None
        self.phase = "sending"  # what the first signal interrupts: "sending" or "report"
        self._previous: dict[int, Any] = {}

    @property
    def interrupted(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach only the main thread (an embedding caller keeps its own handlers)
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)

    def restore(self) -> None:
        for s, old in self._previous.items():
            signal.signal(s, old)
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            sys.stdout, sys.stderr = _Forgiving(sys.stdout), _Forgiving(sys.stderr)  # type: ignore[assignment]
        name = signal.Signals(signum).name
        if self.signum is not None:
            _say(f"runner: {name} again: stopping now (servers killed, no report; the records on disk are "
                 f"kept and --resume continues)")
            with contextlib.suppress(Exception):
                self.kill_now()
            os._exit(exit_code(self.signum))
        self.signum = signum
        if self.phase == "report":
            _say(f"runner: {name}: finishing the report first (a few seconds); {name} again stops now")
        else:
            _say(f"runner: {name}: stopping — the request in flight is abandoned (a resume sends it again), "
                 f"the servers this run started are stopped, the records are kept and a partial report is "
                 f"written; {name} again stops now")
        self.stop.set()
