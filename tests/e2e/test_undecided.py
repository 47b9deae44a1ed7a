"""A card whose harness is broken is undecided, with the server's own error line, and the run exits 1; a
healthy card beside it keeps its world. End to end against real processes on 127.0.0.1."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_run import matrix, no_server_left, run, step

pytestmark = pytest.mark.slow


def test_broken_harness_cards_are_undecided_with_the_servers_own_error_lines(tmp_path: Path) -> None:
    path = matrix(tmp_path, f"""
        [servers.no-module]
        command = ["{sys.executable}", "-c", "import opentelemetry_not_in_this_env"]

        [servers.never-ready]
        command = ["{sys.executable}", "-c", "import time; print('loading weights', flush=True); time.sleep(120)"]

        [servers.crashes]
        command = ["{{python}}", "-m", "runner.refserver", "--port", "{{port}}", "--preset", "tiny",
                   "--fault", "exit@3"]

        [cards.healthy]
        server = "ref"
        vram_mib = 64

        [cards.broken-import]
        server = "no-module"
        vram_gib = 1

        [cards.never-ready]
        server = "never-ready"
        vram_gib = 1

        [cards.crashes]
        server = "crashes"
        vram_gib = 1

        [flags.default]
        role = "default"

        [matrix]
        references = [1, 2]
        """, ready_timeout=30)
    proc, run_dir = run(path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    verdicts = {v["card"]: v for v in json.loads((run_dir / "verdict.json").read_text())["verdicts"]}
    report = (run_dir / "report.md").read_text()
    assert verdicts["healthy"]["world"] == "fits-resident"
    assert "healthy: fits-resident" in proc.stdout

    missing = "ModuleNotFoundError: No module named 'opentelemetry_not_in_this_env'"
    v = verdicts["broken-import"]
    assert v["world"] == "undecided" and missing in v["reason"]
    assert v["evidence"]["blocking"][0]["record"] == "broken-import/default"
    assert v["evidence"]["blocking"][0]["server_says"] == [missing]
    assert f"| broken-import | **undecided** | – | cannot tell — default 'default': server did not start " \
           f"(load_exit: server exited with code 1 before it was ready: {missing})" in report
    assert "broken-import: undecided — cannot tell" in proc.stdout and missing in proc.stdout

    v = verdicts["never-ready"]
    assert v["world"] == "undecided" and "ready_timeout: not ready before the deadline" in v["reason"]
    assert v["evidence"]["blocking"][0]["server_says"] == ["loading weights"]  # its last words, no error line
    assert "never-ready | **undecided**" in report

    v = verdicts["crashes"]  # request 3 = refs-2 (after refs-1 and its determinism repeat)
    crash = step(run_dir, "crashes/default/refs-2/shapes-seed-1")
    assert crash["failure"]["kind"] == "crash"
    assert v["world"] == "undecided" and v["evidence"]["blocking"][0]["record"] == crash["key"]
    assert "fault exit@3: exiting with code 1 in the middle of the request" in v["reason"]
    assert "crashes | **undecided**" in report and "fault exit@3" in report
    no_server_left(run_dir)
