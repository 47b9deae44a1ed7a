"""Where the test suite's CPU goes (issue 32): a pytest plugin that charges each test the whole machine's busy
CPU time (/proc/stat) while it ran — its own process, the servers and runners it started, and the daemons it
drives (Docker, Slurm, sshd) — so run it serially for a fair split.

    PYTHONPATH=benchmarks SUITE_CPU_OUT=/tmp/cpu.json .venv/bin/python -m pytest -q -p suite_cpu -p no:xdist
    .venv/bin/python benchmarks/suite_cpu.py /tmp/cpu.json        # the split by folder, file and test

On a machine with nothing else running, the sum over tests is the suite's CPU floor: on N cores no parallel
run can finish in less than that sum over N.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

_rows: list[tuple[str, float, float]] = []


def busy_cpu_s() -> float:
    """Seconds of CPU the whole machine has spent busy since boot (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    cpu, wall = busy_cpu_s(), time.monotonic()
    yield
    _rows.append((item.nodeid, busy_cpu_s() - cpu, time.monotonic() - wall))


def pytest_sessionfinish(session: pytest.Session) -> None:
    with open(os.environ.get("SUITE_CPU_OUT", "suite_cpu.json"), "w") as f:
        json.dump(_rows, f)


def summary(rows: list[Any], top: int = 25) -> str:
    out = [f"{len(rows)} tests: {sum(r[1] for r in rows) / 60:.1f} CPU-min busy, {sum(r[2] for r in rows) / 60:.1f} "
           f"min wall"]
    for depth, label in ((2, "folder"), (3, "file")):
        by: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
        for node, cpu, wall in rows:
            key = "/".join(node.split("::")[0].split("/")[:depth])
            by[key][0] += cpu
            by[key][1] += wall
        out.append(f"\nby {label} (CPU s, wall s):")
        out += [f"{c:7.0f} {w:7.0f}  {k}" for k, (c, w) in sorted(by.items(), key=lambda x: -x[1][0])[:top]]
    out.append("\nby test (CPU s, wall s):")
    out += [f"{c:7.0f} {w:7.0f}  {n}" for n, c, w in sorted(rows, key=lambda r: -r[1])[:top]]
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(summary(json.load(f)))
