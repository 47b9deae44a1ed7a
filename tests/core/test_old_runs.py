"""A run directory written by an earlier main (tests/fixtures/run-v3: record schema_version 3, written by
main 09c7220 from tests/fixtures/run-v3.toml) still loads, validates against the published schemas and
reports with the same verdicts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema

from runner.core.records import SessionRecord, StepRecord
from runner.run.store import RunStore

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "run-v3"
SCHEMAS = ROOT / "runner" / "schema"


def records(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.json") if p.name not in ("verdict.json",))


def test_every_record_of_the_old_run_validates_and_loads() -> None:
    result = json.loads((SCHEMAS / "result.schema.json").read_text())
    found = records(FIXTURE)
    assert len(found) == 13  # run.json, 4 sessions, 8 steps
    for path in found:
        jsonschema.validate(json.loads(path.read_text()), result)
    store = RunStore(FIXTURE)
    assert len(store.load_steps()) == 8 and all(isinstance(s, StepRecord) for s in store.load_steps())
    assert all(isinstance(s, SessionRecord) for s in store.load_sessions())
    jsonschema.validate(json.loads((FIXTURE / "verdict.json").read_text()),
                        json.loads((SCHEMAS / "verdict.schema.json").read_text()))


def test_the_old_run_reports_again_with_its_verdicts(tmp_path: Path) -> None:
    run = tmp_path / "run-v3"
    shutil.copytree(FIXTURE, run)
    before = {v["card"]: v["world"] for v in json.loads((run / "verdict.json").read_text())["verdicts"]}
    proc = subprocess.run([sys.executable, "-m", "runner", "report", str(run)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    after = json.loads((run / "verdict.json").read_text())
    assert {v["card"]: v["world"] for v in after["verdicts"]} == before == {"cpu-roomy": "fits-resident",
                                                                           "cpu-tiny": "not-built"}
    jsonschema.validate(after, json.loads((SCHEMAS / "verdict.schema.json").read_text()))
    assert "## cpu-roomy — fits-resident" in (run / "report.md").read_text()
