"""`runner ARGS` in this process, then its CPU split: the runner's own (the sampling, scoring and report) against
its servers' (every child it waited for). Where the CPU of a run goes decides what to cut first (issues 28, 32).

    .venv/bin/python benchmarks/run_cpu.py examples/local.toml --results /tmp/l --no-progress
"""

from __future__ import annotations

import atexit
import resource
import runpy
import sys
import time

START = time.monotonic()


def _split() -> None:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"run_cpu: {time.monotonic() - START:.1f} s wall; the runner {own.ru_utime + own.ru_stime:.1f} CPU-s, "
          f"its servers and other children {kids.ru_utime + kids.ru_stime:.1f} CPU-s", file=sys.stderr)


if __name__ == "__main__":
    atexit.register(_split)  # runs after the runner's own sys.exit too
    sys.argv = ["runner", *sys.argv[1:]]
    runpy.run_module("runner", run_name="__main__", alter_sys=True)
