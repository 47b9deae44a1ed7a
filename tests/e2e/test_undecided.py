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
    assert verdicts["healthy"]["world"] == "fits-resident", verdicts["healthy"]["reason"]
    assert "healthy: fits-resident" in proc.stdout

    missing = "ModuleNotFoundError: No module named 'opentelemetry_not_in_this_env'"
    v = verdicts["broken-import"]
    assert v["world"] == "undecided" and missing in v["reason"]
    assert v["evidence"]["blocking"][0]["record"] == "broken-import/default"
    assert v["evidence"]["blocking"][0]["server_says"] == [missing]
    md = missing.replace("_", "\\_")  # report.md's quoted text is Markdown-inert: brackets and underscores escaped
    assert f"| broken-import | **undecided** | – | cannot tell — default did not start (load\\_exit) " \
           f"\\[broken-import/default\\]: {md} |" in report  # the section has the rest
    assert f"cannot tell — default 'default': server did not start (load\\_exit: server exited with code 1 " \
           f"before it was ready: {md})" in report
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


def _straddling_seed() -> int:
    """A jitter seed whose four timed sends at 2 references (repeats = 2: requests 1-4 are refs-1, 5-8 are
    refs-2 seeds 1 and 2) are two well under and two well over twice the default's latency."""
    from runner.refserver.faults import FaultPlan

    for seed in range(1000):
        plan = FaultPlan.parse([f"jitter=0.5:4:{seed}"])
        delays = sorted(plan.delay_s(n) for n in range(5, 9))
        if delays[1] < 1.0 and delays[2] > 3.5:
            return seed
    raise AssertionError("no seed found")


def test_latency_interval_under_straddling_and_over_the_limit(tmp_path: Path) -> None:
    # Default sleeps a fixed 1 s per request and runs out of memory at 3 references; each card's offload
    # flag set (the cache in host memory, serving 3) sleeps a seeded draw. Compute is ~0.2 s here, so the
    # sleeps dominate: offload/default at 2 references is ~1.1 (under 2), 0.5..4 (straddles), ~5 (over; still
    # over 2 with 2 s of compute a send on a machine loaded by parallel tests: 8 / 3).
    # Two timed sends per step (the executor's repeats): four samples a side at 2 references.
    seed = _straddling_seed()
    path = matrix(tmp_path, f"""
        [cards.under]
        server = "ref"
        vram_mib = 7.75

        [cards.straddles]
        server = "ref"
        vram_mib = 7.75

        [cards.over]
        server = "ref"
        vram_mib = 7.75

        [flags.default]
        role = "default"
        args = ["--fault", "jitter=1:1"]

        [flags.host-under]
        role = "offload"
        args = ["--cond-cache", "host", "--fault", "jitter=1:1.2"]

        [flags.host-straddles]
        role = "offload"
        args = ["--cond-cache", "host", "--fault", "jitter=0.5:4:{seed}"]

        [flags.host-over]
        role = "offload"
        args = ["--cond-cache", "host", "--fault", "jitter=6:6.1"]

        [matrix]
        references = [1, 2, 3]
        exclude = [{{card = "under", flags = "host-straddles"}}, {{card = "under", flags = "host-over"}},
                   {{card = "straddles", flags = "host-under"}}, {{card = "straddles", flags = "host-over"}},
                   {{card = "over", flags = "host-under"}}, {{card = "over", flags = "host-straddles"}}]

        [verdict]
        max_latency_ratio = 2
        """, seeds="[1, 2]", repeats=2, diagnosis="off")  # the OOMs bound the cells; what held them is not read
    proc, run_dir = run(path)
    assert proc.returncode == 1, proc.stderr[-2000:]  # the straddling card is undecided
    verdicts = {v["card"]: v for v in json.loads((run_dir / "verdict.json").read_text())["verdicts"]}
    for card in ("under", "straddles", "over"):
        assert step(run_dir, f"{card}/default/refs-3/shapes-seed-1")["failure"]["kind"] == "oom"
    under = verdicts["under"]
    assert under["world"] == "offload-works" and under["flags"] == "host-under", under["reason"]
    assert under["evidence"]["latency_interval"][1] <= 2
    assert under["evidence"]["latency_reference"]["samples"] == [4, 4]  # 2 seeds × 2 timed repeats a side
    assert under["evidence"]["latency_reference"]["what"].startswith("default 'default' at 2 reference(s)")
    straddles = verdicts["straddles"]
    assert straddles["world"] == "undecided", straddles["reason"]
    assert "straddles 2: rerun with more repeats" in straddles["reason"]
    over = verdicts["over"]
    assert over["world"] == "not-built", over["reason"]
    assert over["evidence"]["flag_sets"]["host-over"]["stop"] == "latency" and "too slow" in over["reason"]
    print({c: v["reason"] for c, v in verdicts.items()})
