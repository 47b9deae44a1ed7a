"""The order the xdist workers take the suite's work units in (tests/conftest.py; scripts/test.sh keeps it with
--no-loadscope-reorder), from each test's wall and CPU seconds in a recorded run (tests/durations.json, written by
tests/durations.py). Only the order depends on it, never a result; a stale file costs time, not correctness.

Two rules:
- the longest units first, so that the last minutes are short tests on every worker, not one long test on one
  worker and idle cores;
- the units that mostly wait (a Slurm time limit, latency sleeps, Ansible over SSH: CPU under half their wall)
  spread evenly among the ones that compute, each kind in its own longest-first order: the workers outnumber the
  cores (scripts/test.sh) so that waiting ones leave the cores to computing ones, and clumps of either kind,
  at the start or the end, leave a core idle or make them contend (docs/benchmarks.md, 2026-12-06).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

WAITING = 0.5  # CPU seconds per wall second below which a unit mostly waits


def order(units: Mapping[str, tuple[float, float]]) -> list[str]:
    """The units (name → (wall s, CPU s)) in the order to hand them out."""
    by_wall = sorted(units, key=lambda u: -units[u][0])
    computing = [u for u in by_wall if units[u][1] >= WAITING * units[u][0]]
    waiting = [u for u in by_wall if units[u][1] < WAITING * units[u][0]]
    total_computing = sum(units[u][0] for u in computing) or 1.0
    total_waiting = sum(units[u][0] for u in waiting) or 1.0
    out: list[str] = []
    computed = waited = 0.0
    while computing or waiting:
        # the kind that is further behind its share of the wall seconds goes next
        if computing and (not waiting or computed / total_computing <= waited / total_waiting):
            computed += units[computing[0]][0]
            out.append(computing.pop(0))
        else:
            waited += units[waiting[0]][0]
            out.append(waiting.pop(0))
    return out


def unit_times(unit_of_test: Iterable[tuple[str, str]], seconds: Mapping[str, list[float]]
               ) -> dict[str, tuple[float, float]]:
    """Each unit's summed (wall, CPU) seconds from its tests' recorded ones; a test with none counts nothing."""
    times: dict[str, tuple[float, float]] = {}
    for unit, test in unit_of_test:
        wall, cpu = seconds.get(test, (0.0, 0.0))
        before = times.get(unit, (0.0, 0.0))
        times[unit] = (before[0] + wall, before[1] + cpu)
    return times
