"""The published JSON Schema is generated from the record declarations (runner.present.schemas, from the pydantic
models in runner.core.records) and validates what the records write; older records migrate to the current form
and a record of wrong types is one line naming the field and the value."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from runner.core.records import (
    SCHEMA_VERSION,
    Failure,
    FailureClass,
    Peak,
    RecordError,
    Sanity,
    Scores,
    ServerStart,
    SessionRecord,
    Status,
    StepRecord,
    load,
    migrate,
)
from runner.present import schemas

PUBLISHED = Path(__file__).resolve().parents[2] / "runner" / "schema" / "result.schema.json"


def test_committed_schema_matches_the_declaration() -> None:
    assert PUBLISHED.read_text() == schemas.texts()["result.schema.json"], \
        "runner/schema/result.schema.json drifted: run `runner schema`"


def test_records_validate_and_round_trip() -> None:
    schema = json.loads(PUBLISHED.read_text())
    peak = Peak(source="nvml", metric="device", bytes=2**30, samples=10, rate_hz=100.0, available=True)
    ok = StepRecord(key="c/f/refs-2/fx-seed-1", card="c", flags="f", role="default", fixture="fx", references=2,
                    seed=1, status=Status.OK, wall_s=1.0, wall_samples_s=(1.0, 1.1), image="fx-seed-1.png",
                    image_sha256="ab", peaks=(peak,),
                    scores=Scores(baseline=None, psnr_db=None, ssim=None, size_match=None, reason="no baseline",
                                  sanity=Sanity(width=8, height=8, mode="RGB", transparent_share=0.0, pixel_std=3.0,
                                                nan_or_black=False, broken=False)))
    implied = StepRecord(key="c/f/refs-3/fx-seed-1", card="c", flags="f", role="default", fixture="fx",
                         references=3, seed=1, status=Status.SKIPPED, skip_reason="implied",
                         implied_by="c/f/refs-2/fx-seed-2")
    session = SessionRecord(key="c/f", card="c", flags="f", role="offload", backend="local",
                            starts=(ServerStart(attempt=0, started_at=1.0, ready_s=None,
                                                failure=Failure(kind=FailureClass.OOM_AT_LOAD, message="oom",
                                                                evidence=("CUDA out",))),))
    for record in (ok, implied, session):
        doc = json.loads(json.dumps(record.model_dump(mode="json")))
        jsonschema.validate(doc, schema)
        assert doc["schema_version"] == SCHEMA_VERSION
        assert load(type(record), doc) == record


def test_schema_rejects_what_the_declaration_does_not_allow() -> None:
    schema = json.loads(PUBLISHED.read_text())
    bad = StepRecord(key="c/f/refs-1/fx-seed-1", card="c", flags="f", role="default", fixture="fx", references=1,
                     seed=1, status=Status.FAILED).model_dump(mode="json")  # failed without a failure
    for doc in (bad, {**bad, "status": "failed", "failure": None}, {**bad, "role": "fast"},
                {**bad, "unknown": 1}, {**bad, "status": "ok", "image": "x.png", "image_sha256": "ab"},
                {**bad, "references": -1}, {**bad, "key": "no-slash"}):
        try:
            jsonschema.validate(doc, schema)
        except jsonschema.ValidationError:
            continue
        raise AssertionError(f"accepted {doc}")


def test_peak_unknown_is_null_never_zero_in_the_schema() -> None:
    schema = json.loads(PUBLISHED.read_text())
    peak = Peak(source="nvml", metric="device", bytes=None, samples=0, rate_hz=None, available=False, reason="x")
    step = StepRecord(key="c/f/refs-1/fx-seed-1", card="c", flags="f", role="default", fixture="fx", references=1,
                      seed=1, status=Status.SKIPPED, skip_reason="x", peaks=(peak,)).model_dump(mode="json")
    jsonschema.validate(step, schema)
    step["peaks"][0]["bytes"] = 0
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(step, schema)


def test_records_written_before_versions_migrate_to_the_current_form() -> None:
    doc = StepRecord(key="c/f/refs-1/fx-seed-1", card="c", flags="f", role="default", fixture="fx", references=1,
                     seed=1, status=Status.SKIPPED, skip_reason="x").model_dump(mode="json")
    del doc["schema_version"], doc["implied_by"], doc["sends"], doc["wall_samples_s"]  # a version-1 file
    record = load(StepRecord, doc)
    assert record.schema_version == SCHEMA_VERSION and record.implied_by is None and record.sends == ()
    assert "schema_version" not in doc  # migrate makes a new dict
    v2 = {**doc, "schema_version": 2, "server_peak_mb": 7.0}
    assert migrate(StepRecord, v2)["server_peak_mib"] == 7.0 and "server_peak_mb" not in migrate(StepRecord, v2)
    with pytest.raises(RecordError, match="schema_version: 99: written by a newer runner"):
        load(StepRecord, {**doc, "schema_version": 99})


@pytest.mark.parametrize(("change", "line"), [
    ({"references": "two"}, "references: 'two': input should be a valid integer"),
    ({"references": "2"}, "references: '2': input should be a valid integer"),  # refused, never coerced
    ({"seed": True}, "seed: True: input should be a valid integer"),
    ({"status": "done"}, "status: 'done': input should be 'ok', 'failed' or 'skipped'"),
    ({"peaks": [{"source": "nvml"}]}, "peaks.0.metric: missing (and 4 more)"),
    ({"wall_samples_s": ["\x1b[31m1"]}, "wall_samples_s.0: '\\x1b[31m1': input should be a valid number"),
    ({"extra": 1}, "extra: 1: extra inputs are not permitted"),
])
def test_a_record_of_wrong_types_is_one_line_naming_field_and_value(change: dict[str, object], line: str) -> None:
    doc = {**StepRecord(key="c/f/refs-1/fx-seed-1", card="c", flags="f", role="default", fixture="fx",
                        references=1, seed=1, status=Status.SKIPPED, skip_reason="x").model_dump(mode="json"),
           **change}
    with pytest.raises(RecordError) as caught:
        load(StepRecord, doc)
    assert str(caught.value) == line and "\n" not in str(caught.value)


def test_run_json_as_runinfo_writes_it_is_the_declared_record(matrix_dir: Path) -> None:
    from runner.core.records import RunRecord
    from runner.plan.lanes import make_plan
    from runner.plan.matrix import load_matrix
    from runner.present import runinfo

    matrix = load_matrix(matrix_dir / "matrix.toml")
    doc = runinfo.run_doc(matrix, make_plan(matrix), "t-1", 1.0)
    record = load(RunRecord, doc)  # a key runinfo writes but the record does not declare is a RecordError
    out = json.loads(json.dumps({**record.model_dump(mode="json"), "finished_at": 2.0, "resumes": [{"at_iso": "x"}]}))
    jsonschema.validate(out, json.loads(PUBLISHED.read_text()))


FINDINGS = PUBLISHED.parent / "findings.schema.json"


def test_committed_findings_schema_matches_the_declaration() -> None:
    assert FINDINGS.read_text() == schemas.texts()["findings.schema.json"], \
        "runner/schema/findings.schema.json drifted: run `runner schema`"


def test_an_oom_failure_with_its_anatomy_validates_and_round_trips() -> None:
    from runner.observe.oom import read_oom

    log = (Path(__file__).parent / "fixtures" / "oom" / "qwen-default.txt").read_text()
    failure = Failure(kind=FailureClass.OOM, message="HTTP 500", evidence=("CUDA out",), http_status=500,
                      exit_code=None, oom=read_oom(log=log))
    record = StepRecord(key="c/f/refs-4/fx-seed-1", card="c", flags="f", role="default", fixture="fx",
                        references=4, seed=1, status=Status.FAILED, failure=failure)
    doc = json.loads(json.dumps(record.model_dump(mode="json")))
    jsonschema.validate(doc, json.loads(PUBLISHED.read_text()))
    assert doc["failure"]["oom"]["tried_bytes"] == 480 * 2**20
    assert load(StepRecord, doc) == record


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
    from runner.plan import matrix

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
    """An unknown key, a wrong type, a bool for a number, a bad name, a key of another backend, an empty list
    where one item is the least: refused by the editor's schema as by the loader."""
    import tomllib

    from runner.core.errors import UserError
    from runner.plan.matrix import load_matrix

    validator = matrix_validator()
    text = (matrix_dir / "matrix.toml").read_text()
    assert validator.is_valid(tomllib.loads(text))
    for old, new in [("steps = 4", "stepz = 4"), ("steps = 4", 'steps = "4"'), ("steps = 4", "steps = true"),
                     ("vram_gib = 0.5", "vram_gib = -1"), ("[cards.small]", '[cards."a/b"]'),
                     ("[cards.small]", '[cards.small]\ndocker_host = "ssh://x"'),
                     ('role = "default"', 'role = "fast"'), ("references = [1, 2]", "references = [1, 99]"),
                     *[("references = [1, 2]", f"references = [1, 2]\n\n[soak]\nrequests = 3\n{key} = []")
                       for key in ("references", "flags", "cards")]]:
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


def test_runner_schema_writes_to_the_published_folder_by_default() -> None:
    assert PUBLISHED.parent == schemas.FOLDER
