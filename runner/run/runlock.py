"""One runner per run folder: a second `--resume` of a running run is refused, naming the holder.

The lock is an flock on `<run>/.lock`, held from before the first record is read until the runner exits;
the kernel drops it when the process dies (SIGKILL included), so a stale lock never blocks a resume. The
file says who holds it (PID, host, since when, the command) so the refusal can name the holder; the file
stays when the lock is released (removing it would race with the next runner's open).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from runner.core.errors import UserError

LOCK_NAME = ".lock"


class RunLocked(UserError):
    """Another runner holds the run folder."""


class RunLock:
    def __init__(self, root: Path, fd: int) -> None:
        self.root, self._fd = root, fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None  # type: ignore[assignment]


def holder_text(path: Path) -> str:
    """Who holds a lock, in words, from what its file says (it may be empty or half written)."""
    try:
        doc = json.loads(path.read_text(errors="replace")[:4096] or "{}")
    except (OSError, ValueError):
        doc = {}
    if not isinstance(doc, dict) or "pid" not in doc:
        return "another runner"
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(doc.get("since", 0))))
    return f"runner PID {doc.get('pid')} on {doc.get('host', '?')} (since {since}: {doc.get('command', '?')})"


def acquire(root: Path) -> RunLock:
    """Lock `root` for this process (creating the folder) or raise RunLocked naming the holder."""
    path = root / LOCK_NAME
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise UserError(f"{path}: cannot lock the run folder: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunLocked(f"{root}: run is in use by {holder_text(path)}; not starting a second runner on it "
                        f"(wait for it to end, or stop it)") from None
    doc = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
           "command": " ".join(sys.argv)[:300]}
    with contextlib.suppress(OSError):  # who holds it is information for the refusal, not the lock itself
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(doc).encode(), 0)
    return RunLock(root, fd)
