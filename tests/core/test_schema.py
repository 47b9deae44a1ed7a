"""The published JSON Schema is generated from the record declarations (runner.schemagen) and validates
what the records write."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema

from runner import schemagen, schemas
from runner.records import (
    SCHEMA_VERSION,
    Failure,
    FailureClass,
    Peak,
    Sanity,
    Scores,
    ServerStart,
    SessionRecord,
    Status,
    StepRecord,
)

PUBLISHED = Path(__file__).resolve().parents[2] / "runner" / "schema" / "result.schema.json"


def test_committed_schema_matches_the_declaration() -> None:
    assert PUBLISHED.read_text() == schemagen.render(), \
        "runner/schema/result.schema.json drifted: python -m runner.schemagen > runner/schema/result.schema.json"


def test_records_validate_and_round_trip() -> None:
    schema = json.loads(PUBLISHED.read_text())
    peak = Peak("nvml", "device", 2**30, 10, 100.0, True)
    ok = StepRecord(key="c/f/refs-2/fx-seed-1", card="c", flags="f", role="default", fixture="fx", references=2,
                    seed=1, status=Status.OK, wall_s=1.0, wall_samples_s=(1.0, 1.1), image="fx-seed-1.png",
                    image_sha256="ab", peaks=(peak,),
                    scores=Scores(None, None, None, None, "no baseline", Sanity(8, 8, "RGB", 0.0, 3.0, False, False)))
    implied = StepRecord(key="c/f/refs-3/fx-seed-1", card="c", flags="f", role="default", fixture="fx",
                         references=3, seed=1, status=Status.SKIPPED, skip_reason="implied",
                         implied_by="c/f/refs-2/fx-seed-2")
    session = SessionRecord("c/f", "c", "f", "offload", "local",
                            (ServerStart(0, 1.0, None, Failure(FailureClass.OOM_AT_LOAD, "oom", ("CUDA out",))),))
    for record in (ok, implied, session):
        doc = json.loads(json.dumps(record.to_json()))
        jsonschema.validate(doc, schema)
        assert doc["schema_version"] == SCHEMA_VERSION
        assert type(record).from_json(doc) == record


def test_schema_rejects_what_the_declaration_does_not_allow() -> None:
    schema = json.loads(PUBLISHED.read_text())
    bad = StepRecord(key="c/f/refs-1/fx-seed-1", card="c", flags="f", role="default", fixture="fx", references=1,
                     seed=1, status=Status.FAILED).to_json()  # failed without a failure
    for doc in (bad, {**bad, "status": "failed", "failure": None}, {**bad, "role": "fast"},
                {**bad, "unknown": 1}):
        try:
            jsonschema.validate(doc, schema)
        except jsonschema.ValidationError:
            continue
        raise AssertionError(f"accepted {doc}")


def test_records_written_before_versions_read_as_version_1() -> None:
    doc = StepRecord(key="c/f/refs-1/fx-seed-1", card="c", flags="f", role="default", fixture="fx", references=1,
                     seed=1, status=Status.SKIPPED, skip_reason="x").to_json()
    del doc["schema_version"], doc["implied_by"]
    assert StepRecord.from_json(doc).schema_version == 1


def test_run_json_as_runinfo_writes_it_is_the_declared_record(matrix_dir: Path) -> None:
    from runner import runinfo
    from runner.matrix import load_matrix
    from runner.plan import make_plan
    from runner.records import RunRecord

    matrix = load_matrix(matrix_dir / "matrix.toml")
    doc = runinfo.run_doc(matrix, make_plan(matrix), "t-1", 1.0)
    record = RunRecord.from_json(doc)  # a key runinfo writes but the record does not declare is a TypeError
    out = json.loads(json.dumps({**record.to_json(), "finished_at": 2.0, "resumes": [{"at_iso": "x"}]}))
    jsonschema.validate(out, json.loads(PUBLISHED.read_text()))


FINDINGS = PUBLISHED.parent / "findings.schema.json"


def test_committed_findings_schema_matches_the_declaration() -> None:
    assert FINDINGS.read_text() == schemagen.render_findings(), \
        "runner/schema/findings.schema.json drifted: python -m runner.schemagen findings > " \
        "runner/schema/findings.schema.json"


def test_an_oom_failure_with_its_anatomy_validates_and_round_trips() -> None:
    from runner.findings.oom import read_oom

    log = (Path(__file__).parent / "fixtures" / "oom" / "qwen-default.txt").read_text()
    failure = Failure(FailureClass.OOM, "HTTP 500", ("CUDA out",), 500, None, read_oom(log=log))
    record = StepRecord(key="c/f/refs-4/fx-seed-1", card="c", flags="f", role="default", fixture="fx",
                        references=4, seed=1, status=Status.FAILED, failure=failure)
    doc = json.loads(json.dumps(record.to_json()))
    jsonschema.validate(doc, json.loads(PUBLISHED.read_text()))
    assert doc["failure"]["oom"]["tried_bytes"] == 480 * 2**20
    assert StepRecord.from_json(doc) == record


def test_runner_schema_writes_every_published_schema(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "runner", "schema", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name, text in schemas.texts().items():
        assert (tmp_path / name).read_text() == text
        assert (PUBLISHED.parent / name).read_text() == text, f"runner/schema/{name} drifted: run `runner schema`"
