"""`python -m runner.slurm.lifeline`: the runner's allocations die with the runner, `kill -9` included.

The runner starts this in its own session with a pipe on stdin that only the runner writes to, and tells it
"+JOB" when it holds an allocation and "-JOB" when it released it. When the pipe closes (the runner exited
or was killed), every job still held is cancelled. The same lifeline as the local backend's supervisor.
"""

from __future__ import annotations

import signal
import subprocess
import sys


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the runner's terminal is the runner's to handle
    held: set[str] = set()
    for line in sys.stdin:
        word = line.strip()
        if word[:1] == "+" and word[1:].isdigit():
            held.add(word[1:])
        elif word[:1] == "-":
            held.discard(word[1:])
    if held:
        jobs = sorted(held, key=int)
        subprocess.run(["scancel", "--quiet", *jobs], timeout=60, check=False)
        print(f"runner slurm lifeline: the runner is gone; cancelled job(s) {', '.join(jobs)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
