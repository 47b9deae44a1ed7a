"""The hostile-server corpus, findings cases (issue 30 F-1…F-7): one real run of `runner` against servers
whose OOM text and tracebacks are hostile (tests/safety/hostile.py, its findings modes). Every card ends in a
verdict and the run in a report; the OOM stays an OOM; a figure no device can have is absent; the site
survives worker prefixes and a traceback longer than the log window; report.md renders site names as
themselves; nothing is a negative shortfall; body text is not called the server log.

On 9ea8d2e this run ends in a traceback (the 400-digit figure kills it), and each case below fails alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from markdown_it import MarkdownIt

from tests.safety.hostile_matrix import hostile_matrix

ROOT = Path(__file__).resolve().parents[2]
SITE = "vllm_omni/diffusion/__init__.py:12"
MODES = ("oom-huge", "load-oom-huge", "oom-signs", "oom-prefixed", "oom-prefixed-ansi", "oom-long", "load-oom-long",
         "load-oom-others", "oom-markup", "oom-body")


def write_matrix(tmp: Path) -> Path:
    return hostile_matrix(tmp, "hostile-findings", {mode: mode for mode in MODES})


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    tmp = tmp_path_factory.mktemp("findings")
    proc = subprocess.run([sys.executable, "-m", "runner", str(write_matrix(tmp)), "--no-progress"], cwd=tmp,
                          capture_output=True, text=True, timeout=300)
    return next((tmp / "results").glob("hostile-findings-*")), proc


def oom_of(run: Path, card: str) -> dict[str, Any]:
    step = run / card / "default" / "refs-1" / "one-seed-1.json"
    if card.startswith("load-"):
        failure = json.loads((run / card / "default" / "session.json").read_text())["starts"][0]["failure"]
        assert failure["kind"] == "oom_at_load", (card, failure)
    else:
        failure = json.loads(step.read_text())["failure"]
        assert failure["kind"] == "oom", (card, failure)
    return dict(failure["oom"])


def test_every_card_ends_in_a_verdict_and_the_run_in_a_report(finished: tuple[Path, Any]) -> None:
    run, proc = finished
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]  # every card decided: each one ran out of memory
    verdicts = {v["card"]: v for v in json.loads((run / "verdict.json").read_text())["verdicts"]}
    assert {c: v["world"] for c, v in verdicts.items()} == dict.fromkeys(MODES, "not-built")
    assert (run / "report.md").is_file() and (run / "profiles.json").is_file()


def test_f1_a_400_digit_figure_is_absent_and_the_failure_stays_an_oom(finished: tuple[Path, Any]) -> None:
    run, _ = finished
    for card in ("oom-huge", "load-oom-huge"):
        oom = oom_of(run, card)
        assert oom["tried_bytes"] is None and oom["capacity_bytes"] == 2**30, (card, oom)


def test_f5_figures_outside_what_a_device_can_have_are_absent(finished: tuple[Path, Any]) -> None:
    run, _ = finished
    oom = oom_of(run, "oom-signs")
    assert (oom["allowed_bytes"], oom["capacity_bytes"], oom["free_bytes"], oom["in_use_bytes"]) == (None,) * 4, oom
    assert oom["tried_bytes"] == 2 * 2**20 and oom["allocated_bytes"] == 2**20
    profiles = (run / "profiles.json").read_text()
    assert "e+31" not in profiles and "e31" not in profiles


@pytest.mark.parametrize("card", ["oom-prefixed", "oom-prefixed-ansi", "oom-long", "load-oom-long", "oom-markup"])
def test_f2_f3_the_site_survives_worker_prefixes_and_a_traceback_longer_than_the_window(
        finished: tuple[Path, Any], card: str) -> None:
    run, _ = finished
    oom = oom_of(run, card)
    assert oom["site"] == SITE and oom["function"] == "_x_" and oom["no_site"] is None, (card, oom)


def test_f4_f6_f7_report_and_reasons(finished: tuple[Path, Any]) -> None:
    run, _ = finished
    report = (run / "report.md").read_text()
    assert "short by at least -" not in report
    others = [line for line in report.splitlines() if "Loading needs at least" in line and "796.00 MiB" in line]
    assert others and all("held outside this process" in line for line in others), others
    html = MarkdownIt("commonmark").enable("strikethrough").enable("table").render(report)
    assert "<strong>init</strong>" not in html and "<em>x</em>" not in html and "<s>gone</s>" not in html
    assert "vllm_omni/diffusion/__init__.py:12" in html
    (body,) = [v for v in json.loads((run / "verdict.json").read_text())["verdicts"] if v["card"] == "oom-body"]
    assert "server log:" not in body["reason"] and "Image generation failed" in body["reason"], body["reason"]
