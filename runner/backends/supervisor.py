"""The local backend's supervisor: started in place of the server (`python -I path/to/supervisor.py FD
ARGV...`), the leader of the server's process group.

It runs the server as its child and watches a pipe whose only write end the runner holds: when the runner
process dies (SIGKILL included) the kernel closes that end, the read sees EOF, and the supervisor stops the
whole group (SIGTERM, SIGKILL after 5 s) — workers the server forked included, which a parent-death signal
would miss. It waits out stop()'s SIGTERM for its server and exits as the server did (same code, same
signal). Standard library only, so it starts in milliseconds.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

GRACE_S = 5.0  # SIGTERM to SIGKILL when the runner is gone


def _watch(fd: int) -> None:
    while os.read(fd, 64):
        pass
    os.killpg(0, signal.SIGTERM)
    time.sleep(GRACE_S)
    os.killpg(0, signal.SIGKILL)


def main(args: list[str]) -> None:
    fd, argv = int(args[0]), args[1:]
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
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
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main(sys.argv[1:])
