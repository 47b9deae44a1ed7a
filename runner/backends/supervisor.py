"""The local backend's supervisor: started in place of the server (`python -I path/to/supervisor.py FD
ARGV...`), the leader of the server's process group.

It runs the server as its child and watches a pipe whose only write end the runner holds: when the runner
process dies (SIGKILL included) the kernel closes that end, the read sees EOF, and the supervisor stops the
whole group (SIGTERM, SIGKILL after 5 s) — workers the server forked included, which a parent-death signal
would miss. It is a child subreaper, so a worker that left the group (setsid) and lost its parent is still
its descendant: every descendant is stopped with the group, and when the server exits, whatever it left
behind is stopped too. It waits out stop()'s SIGTERM for its server and exits as the server did (same
code, same signal). Standard library only, so it starts in milliseconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

GRACE_S = 5.0  # SIGTERM to SIGKILL when the runner is gone
LEFTOVER_GRACE_S = 2.0  # SIGTERM to SIGKILL for what an exited server left behind
PR_SET_CHILD_SUBREAPER = 36


def descendants() -> list[int]:
    """Every process below this one (from /proc: parent links), the group and what left it."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], [os.getpid()]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _signal_all(sig: int) -> None:
    for pid in descendants():
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


def _watch(fd: int) -> None:
    while os.read(fd, 64):
        pass
    _signal_all(signal.SIGTERM)
    os.killpg(0, signal.SIGTERM)
    time.sleep(GRACE_S)
    _signal_all(signal.SIGKILL)
    os.killpg(0, signal.SIGKILL)


def _stop_leftovers() -> None:
    """The server exited: what it started and left behind (a setsid worker) goes with it."""
    if not descendants():
        return
    _signal_all(signal.SIGTERM)
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while descendants() and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(-1, os.WNOHANG)  # reparented leftovers are our children: reap the ones that ended
        time.sleep(0.05)
    _signal_all(signal.SIGKILL)


def main(args: list[str]) -> None:
    fd, argv = int(args[0]), args[1:]
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    with contextlib.suppress(Exception):  # a daemonizing server's orphans are reparented here, not to init
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    pid = os.fork()
    if pid == 0:
        os.close(fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            os.execvp(argv[0], argv)
        except OSError as exc:
            print(f"runner: cannot start {argv[0]}: {exc.strerror}", file=sys.stderr, flush=True)
            os._exit(127)
    threading.Thread(target=_watch, args=(fd,), daemon=True).start()
    _, status = os.waitpid(pid, 0)
    _stop_leftovers()
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main(sys.argv[1:])
