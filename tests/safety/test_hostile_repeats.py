"""The hostile-server corpus, auto-repeat cases (issue 30 A-1, A-2): one real run of `runner` with `repeats =
"auto"` against servers whose wall times a latency ratio must survive (tests/safety/hostile.py's spike and wide
modes), the default flag set running out of memory at two references so that the offload's latency decides.
Every card ends in a verdict and the run in a report whose latency words are readable.

A-1 (a 40x slower top-up send at max_repeats = 100) was an OverflowError in the top-up pass on 213f931. A-3
(identical wall times, a zero-width interval) cannot be made by a real server, whose walls always differ in
their last digits: tests/core/test_latency_words.py and test_sequential.py give it the identical walls."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.core.test_latency_words import unreadable
from tests.safety.hostile_matrix import HOSTILE, ROOT

REFS = [ROOT / "examples" / "refs" / f"ref-{i}.png" for i in (1, 2)]
pytestmark = pytest.mark.slow  # a real run each, 10-40 s
CARDS = {"a1-spike": ("spike", 100), "a2-wide": ("wide", 4)}  # card: (the offload's mode, max_repeats)


def run_card(tmp: Path, card: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
    mode, most = CARDS[card]
    path = tmp / card / "matrix.toml"
    path.parent.mkdir(parents=True)
    path.write_text(textwrap.dedent(f"""
        [run]
        name = "{card}"
        seeds = [1, 2]
        repeats = "auto"
        max_repeats = {most}
        determinism_check = false
        restarts = 0
        steps = 2
        size = "64x64"
        request_timeout_s = 10
        ready_timeout_s = 20
        results_dir = "{path.parent / 'results'}"

        [servers.h]
        command = ["{{python}}", "{HOSTILE}", "--port", "{{port}}", "--mode", "oom-at-2"]

        [cards.{card}]
        server = "h"
        vram_gib = 1
        meters = ["host"]

        [flags.default]
        role = "default"

        [flags.offl]
        role = "offload"
        args = ["--mode", "{mode}"]

        [fixtures.two]
        prompt = "a cat"
        references = {json.dumps([str(r) for r in REFS])}

        [matrix]
        references = [1, 2]

        [verdict]
        target_references = 2
        max_latency_ratio = 2
        """))
    proc = subprocess.run([sys.executable, "-m", "runner", str(path), "--no-progress"], capture_output=True,
                          text=True, timeout=600)
    return next((path.parent / "results").glob(f"{card}-*")), proc


def test_a_40x_top_up_send_at_max_repeats_100_ends_in_a_verdict_and_a_report(tmp_path: Path) -> None:
    run, proc = run_card(tmp_path, "a1-spike")
    assert "Traceback" not in proc.stderr and proc.returncode in (0, 1), proc.stderr[-3000:]
    (verdict,) = json.loads((run / "verdict.json").read_text())["verdicts"]
    report = (run / "report.md").read_text()
    assert verdict["world"] in ("offload-works", "undecided", "not-built"), verdict["reason"]
    assert unreadable(verdict["reason"]) == [] and unreadable(report) == [], verdict["reason"]
    samples = [json.loads(p.read_text())["wall_samples_s"]
               for p in sorted((run / "a1-spike" / "offl" / "refs-1").glob("*.json"))]
    walls = [w for s in samples for w in s]
    assert max(len(s) for s in samples) > 1, samples  # the ratio was open: auto topped it up ...
    assert max(walls) / min(walls) > 20, walls  # ... and a ~40x send was timed and kept


def test_a_ratio_still_open_at_max_repeats_is_undecided_without_rerun_advice(tmp_path: Path) -> None:
    run, proc = run_card(tmp_path, "a2-wide")
    assert "Traceback" not in proc.stderr and proc.returncode == 1, proc.stderr[-3000:]  # undecided: exit 1
    (verdict,) = json.loads((run / "verdict.json").read_text())["verdicts"]
    assert verdict["world"] == "undecided", verdict["reason"]
    assert "max_repeats" in verdict["reason"] and "rerun with more repeats" not in verdict["reason"]
    assert unreadable(verdict["reason"]) == [] and unreadable((run / "report.md").read_text()) == []
    levels = [len(json.loads(p.read_text())["wall_samples_s"])
              for p in sorted((run / "a2-wide" / "offl" / "refs-1").glob("*.json"))]
    assert levels and max(levels) == 4, levels  # auto reached max_repeats before it gave up
