"""The README's first command: the embedded default shows the three verdict worlds and leaves every file the
README promises."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from runner.observe.quote import markdown
from tests.conftest import ExampleRun, example_copy

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_local_example_shows_all_three_worlds(local_example: ExampleRun) -> None:
    run_dir = local_example.run_dir  # run once for the e2e tests that read it (tests/conftest.py)
    worlds = {v["card"]: v["world"] for v in json.loads((run_dir / "verdict.json").read_text())["verdicts"]}
    assert worlds == {"cpu-roomy": "fits-resident", "cpu-tight": "offload-works", "cpu-tiny": "not-built"}
    assert (run_dir / "report.md").read_text().count("## cpu-") == 3
    plots = {p.name for p in (run_dir / "plots").glob("*.png")}
    assert {"cpu-roomy-capacity.png", "cpu-tight--default-memory.png"} <= plots and len(plots) >= 15
    steps = [json.loads(p.read_text()) for p in run_dir.glob("*/*/refs-*/*.json")]
    # 3 cards × 5 flag sets × 4 counts × 2 seeds, but int8 and fp8-collapse (quantization: decide no world) send
    # their second seed at the target only under repeats = "auto" (runner.plan.lanes.first_seed_off_target); and
    # retain (role other) on cpu-roomy alone: 4 counts of the first seed, the target's second
    assert len(steps) == 120 - 3 * 2 * 3 + 5
    for s in steps:
        png = run_dir / f"{s['key']}.png"
        assert png.is_file() == (s["status"] == "ok"), s["key"]
    report = (run_dir / "report.md").read_text()
    _glance(report, {"cpu-roomy": 6, "cpu-tight": 5, "cpu-tiny": 5})
    assert report.count("### Findings") == 3
    assert "Where a fix would go" in report and "<code>diffusers/models/" in report  # cpu-tiny: quoted sites
    profiles = json.loads((run_dir / "profiles.json").read_text())
    assert [c["card"] for c in profiles["cards"]] == ["cpu-roomy", "cpu-tight", "cpu-tiny"]


def _glance(report: str, flag_sets: dict[str, int]) -> None:
    """The report's first table reads at a glance: no "why" cell shows over 300 characters (Markdown's escapes,
    such as \\[, are not shown), and each card's cell names every one of its flag sets (the deciding one, and
    each other one's stop)."""
    rows = [ln for ln in report.splitlines() if ln.startswith("| ") and " | **" in ln][:len(flag_sets)]
    assert len(rows) == len(flag_sets)
    for row in rows:
        card, _, _, why = (c.strip() for c in row.strip("|").split(" | ", 3))
        shown = re.sub(r"\\(.)", r"\1", why)
        assert len(shown) <= 300, (card, len(shown), why)
        named = [part for part in why.split("; ")]
        assert len(named) >= flag_sets[card], (card, why)


def test_the_host_meter_measured_every_server_that_loaded(local_example: ExampleRun) -> None:
    """The local backend's host RAM (the server's process tree RSS) is the evidence that an offload flag moved
    memory to the host: every session whose server became ready has host samples and a peak. (From 0b37963 a
    cache attribute named like a method made every sample fail, and the report only said "n/a".)"""
    sessions = sorted(local_example.run_dir.glob("*/*/session.json"))
    loaded = [json.loads(p.read_text()) for p in sessions]
    loaded = [s for s in loaded if any(start["ready_s"] is not None for start in s["starts"])]
    assert loaded
    for session in loaded:
        (host,) = [m for m in session["meters"] if m["source"] == "host" and m["attempt"] == 0]
        assert host["available"] and host["samples"] > 0, (session["key"], host)
        (peak,) = [p for p in session["session_peaks"] if p["source"] == "host"]
        assert peak["bytes"] > 10 * 2**20, (session["key"], peak)  # a Python process with torch: far over 10 MiB


def test_seed_emulated_example_reads_at_a_glance(tmp_path: Path) -> None:
    # The glance is the report's words for two cards of six flag sets each: one seed at 8 steps and no
    # diagnosis pass give the same cells for about half the CPU (75 against 141 CPU-s as the file stands).
    example = example_copy("seed-emulated.toml", tmp_path / "matrix", seeds="[2301]", steps="8",
                           diagnosis='"off"')
    proc = subprocess.run([sys.executable, "-m", "runner", str(example),
                           "--results", str(tmp_path), "--no-progress"], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    (run_dir,) = tmp_path.glob("seed-emulated-*")
    doc = json.loads((run_dir / "verdict.json").read_text())
    sets = {v["card"]: len({c["flags"] for c in v["cells"]}) for v in doc["verdicts"]}
    _glance((run_dir / "report.md").read_text(), sets)
    console = [ln for ln in proc.stdout.splitlines() if ln.split(":")[0] in sets]
    for v in doc["verdicts"]:  # the console names each stop in the report's words
        line = next(ln for ln in console if ln.startswith(v["card"] + ":"))
        row = next(ln for ln in (run_dir / "report.md").read_text().splitlines() if ln.startswith(f"| {v['card']} |"))
        assert markdown(line.split(" — ", 1)[1]) in row  # the same words (report.md quotes them as Markdown)


def test_the_not_built_card_says_what_held_the_memory(local_example: ExampleRun) -> None:
    """Issue 27 on the embedded default: cpu-tiny's Findings read the diagnosis passes' snapshots. The four flag
    sets that fail the same load share one reading with each snapshot file; cpu-offload's request OOM names the
    request's largest live allocation by its site, and says what moving it, or the conditioning cache, would buy."""
    report = (local_example.run_dir / "report.md").read_text()
    tiny = report[report.index("## cpu-tiny"):]
    held = tiny[tiny.index("What held the memory"):tiny.index("### Evidence")]
    load = next(ln for ln in held.splitlines() if "(the same reading): at load" in ln)
    assert load.count(".pickle`") == 4 and "moving the resident set" in load
    offload = next(ln for ln in held.splitlines() if ln.startswith("- 'cpu-offload': at the 3-reference OOM"))
    assert "the request's largest live allocation was" in offload and "Against a shortfall of at least" in offload
    # the transformer copied in for the request is named as such, never offered as an activation to chunk
    largest = offload.split("largest live allocation was")[1].split(";")[0]
    assert "in onload`" not in largest and "of the request's bytes were the server's onloaded weights" in offload
    assert "moving the onloaded weights off the device frees" in offload
    cache = offload.split(" of the request's bytes were the server's conditioning cache")[0].rsplit("; ", 1)[1]
    assert cache.endswith(("KiB", "MiB")) and "moving the conditioning cache off the device frees " + cache in offload
    assert {p.name for p in (local_example.run_dir / "plots").glob("*-held.png")} == {"cpu-tight-held.png",
                                                                                     "cpu-tiny-held.png"}
