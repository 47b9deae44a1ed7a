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


MATRIX_SCHEMA = PUBLISHED.parent / "matrix.schema.json"
ROOT = PUBLISHED.parents[2]


def matrix_validator() -> jsonschema.protocols.Validator:
    schema = json.loads(MATRIX_SCHEMA.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    assert cls is jsonschema.Draft4Validator  # taplo (Even Better TOML) validates with draft 4
    return cls(schema)


def test_committed_matrix_schema_matches_the_models() -> None:
    from runner import matrix

    assert MATRIX_SCHEMA.read_text() == matrix.render_schema(), \
        "runner/schema/matrix.schema.json drifted: run `runner schema`"


def test_every_shipped_matrix_validates_against_the_matrix_schema() -> None:
    import tomllib

    validator = matrix_validator()
    paths = [ROOT / "matrix.toml", *sorted((ROOT / "examples").glob("*.toml"))]
    assert len(paths) >= 5
    for path in paths:
        errors = [e.message for e in validator.iter_errors(tomllib.loads(path.read_text()))]
        assert not errors, (path, errors)


def test_matrix_schema_rejects_what_the_loader_rejects(matrix_dir: Path) -> None:
    """An unknown key, a wrong type, a bool for a number, a bad name, a key of another backend: refused by
    the editor's schema as by the loader."""
    import tomllib

    from runner.errors import UserError
    from runner.matrix import load_matrix

    validator = matrix_validator()
    text = (matrix_dir / "matrix.toml").read_text()
    assert validator.is_valid(tomllib.loads(text))
    for old, new in [("steps = 4", "stepz = 4"), ("steps = 4", 'steps = "4"'), ("steps = 4", "steps = true"),
                     ("vram_gib = 0.5", "vram_gib = -1"), ("[cards.small]", '[cards."a/b"]'),
                     ("[cards.small]", '[cards.small]\ndocker_host = "ssh://x"'),
                     ('role = "default"', 'role = "fast"'), ("references = [1, 2]", "references = [1, 99]")]:
        assert old in text, old
        bad = text.replace(old, new, 1)
        assert not validator.is_valid(tomllib.loads(bad)), new
        (matrix_dir / "bad.toml").write_text(bad)
        try:
            load_matrix(matrix_dir / "bad.toml")
        except UserError:
            continue
        raise AssertionError(f"the loader accepted {new!r}")


def test_every_matrix_key_is_described() -> None:
    """Each table field (and each registry entry's card key) carries a description: the schema is the
    editor's hover text."""
    def walk(node: object, where: str) -> None:
        if isinstance(node, dict):
            for key, prop in node.get("properties", {}).items():
                assert isinstance(prop, dict) and prop.get("description"), f"{where}.{key} has no description"
            for key, value in node.items():
                walk(value, f"{where}.{key}")

    walk(json.loads(MATRIX_SCHEMA.read_text()), "schema")
