"""`runner compare`: two runs' verdict.json → what changed, over the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_verdict import RULES, session, step

from runner.records import FailureClass, Status
from runner.verdict import decide


def write_run(root: Path, run_id: str, steps: list, sessions: list) -> Path:
    root.mkdir(parents=True)
    verdict = decide("c", steps, sessions, RULES)
    (root / "verdict.json").write_text(json.dumps({"run_id": run_id, "verdicts": [verdict.to_json()]}))
    return root


def test_compare_names_verdict_and_cell_changes(tmp_path: Path) -> None:
    before = write_run(tmp_path / "a", "run-a", [
        step("default", "default", 1, gib=10), step("default", "default", 2, Status.FAILED, kind=FailureClass.OOM)],
        [session("default", "default")])
    after = write_run(tmp_path / "b", "run-b", [
        step("default", "default", 1, gib=9, wall=0.5), step("default", "default", 2, gib=11)],
        [session("default", "default")])
    out = tmp_path / "compare.md"
    proc = subprocess.run([sys.executable, "-m", "runner", "compare", str(before), str(after), "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "| c | not-built | fits-resident ⚠️ changed |" in proc.stdout
    assert "| c | default | 2 | not served | served ⚠️ |" in proc.stdout
    assert "| c | default | 1 | served | served | -1.00 GiB | -0.500 (-50%) | +0.00 |" in proc.stdout
    assert out.read_text() == proc.stdout


def test_compare_without_verdict_is_one_line_error(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "runner", "compare", str(tmp_path), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "cannot read verdicts" in proc.stderr and "Traceback" not in proc.stderr
