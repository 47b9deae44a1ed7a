"""Writes tests/durations.json, the order the workers take the tests in (tests/conftest.py), from the per-test log
of a whole suite run:

    RUNNER_TEST_CPU_LOG=/tmp/cpu.jsonl scripts/test.sh
    .venv/bin/python -m tests.durations /tmp/cpu.jsonl

Each test of a second or more gets its wall and CPU seconds in that run (the CPU of the worker and of the children
it waited for); the rest count as nothing. A stale file costs only time: a test it lacks is handed out after the
timed ones (tests/schedule.py)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from tests.conftest import DURATIONS

MIN_S = 1.0
GROUP_SUFFIX = re.compile(r"@[\w:/.-]+$")  # a parameter's id ends with "]"


def durations(log_lines: list[str]) -> dict[str, list[float]]:
    rows = (json.loads(line) for line in log_lines if line.strip())
    # xdist's loadgroup appends "@group" to a grouped test's id; the collection that reads the file has none yet
    seconds = {GROUP_SUFFIX.sub("", row["test"]): [round(row["wall_s"], 1), round(row["cpu_s"], 1)]
               for row in rows if row["wall_s"] >= MIN_S}
    return dict(sorted(seconds.items()))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m tests.durations RUNNER_TEST_CPU_LOG-file")
    times = durations(Path(sys.argv[1]).read_text().splitlines())
    # one test a line, so that a new record's diff shows which tests moved
    DURATIONS.write_text("{\n" + ",\n".join(f"{json.dumps(t)}: {json.dumps(v)}" for t, v in times.items()) + "\n}\n")
    print(f"{DURATIONS}: {len(times)} tests of {MIN_S:g} s or more")
