"""Every file a fresh run of examples/local.toml writes validates against the published JSON Schemas
(runner/schema/*.json, as committed): each step record, each session.json and run.json against
result.schema.json, verdict.json against verdict.schema.json, profiles.json and each card's findings against
findings.schema.json. The validator is shown to refuse a corrupted copy of each kind of record, so a schema
that accepted anything would fail here."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.conftest import ExampleRun

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "runner" / "schema"

pytestmark = pytest.mark.slow


def validator(name: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / name).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def problems(check: jsonschema.Draft202012Validator, doc: Any) -> list[str]:
    """Each error as its deepest cause (a oneOf's failure then names the field, not the whole record)."""
    out = []
    for error in check.iter_errors(doc):
        cause = max(_causes(error), key=lambda e: len(e.absolute_path))
        out.append(f"{'/'.join(map(str, cause.absolute_path))}: {cause.message[:200]}")
    return out


def _causes(error: jsonschema.ValidationError) -> list[jsonschema.ValidationError]:
    return [error, *(c for sub in error.context for c in _causes(sub))]


def test_every_record_of_a_fresh_local_run_validates(local_example: ExampleRun) -> None:
    run = local_example.run_dir
    result, verdict, findings = (validator(n) for n in ("result.schema.json", "verdict.schema.json",
                                                        "findings.schema.json"))
    steps = sorted(run.glob("*/*/refs-*/*.json"))
    sessions = sorted(run.glob("*/*/session.json"))
    diagnoses = sorted(run.glob("*/*/diagnosis*.json"))  # the diagnosis passes of the device OOMs (issue 27)
    soaks = sorted(run.glob("*/*/soak/soak.json"))  # the example's soak: cpu-roomy's default and retain
    by_schema = {p: result for p in (*steps, *sessions, *diagnoses, *soaks, run / "run.json")}
    by_schema[run / "verdict.json"] = verdict
    by_schema[run / "profiles.json"] = findings
    assert len(steps) == 107 and len(sessions) == 16 and len(diagnoses) >= 1 and len(soaks) == 2
    assert set(run.rglob("*.json")) == set(by_schema)  # no JSON file of the run is left unchecked
    for path, check in by_schema.items():
        assert not (found := problems(check, json.loads(path.read_text()))), f"{path.relative_to(run)}: {found}"
    lines = [(p, n, line) for p in sorted(run.glob("*/*/soak/requests.jsonl"))
             for n, line in enumerate(p.read_text().splitlines(), 1)]
    assert len(lines) == 2 * 12  # each soak's requests, a line each
    for path, n, line in lines:
        assert not (found := problems(result, json.loads(line))), f"{path.relative_to(run)}:{n}: {found}"
    doc = json.loads((run / "verdict.json").read_text())
    for v in doc["verdicts"]:
        assert v["findings"] is not None and not problems(findings, v["findings"]), v["card"]
    statuses = {json.loads(p.read_text())["status"] for p in steps}
    assert statuses == {"ok", "failed", "skipped"}  # every branch of the status rules was exercised


def _corrupted(doc: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    node: Any = out
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return out


def test_the_schemas_refuse_a_corrupted_record(local_example: ExampleRun) -> None:
    run = local_example.run_dir
    result, verdict, findings = (validator(n) for n in ("result.schema.json", "verdict.schema.json",
                                                        "findings.schema.json"))
    steps = [json.loads(p.read_text()) for p in sorted(run.glob("*/*/refs-*/*.json"))]
    ok = next(s for s in steps if s["status"] == "ok")
    failed = next(s for s in steps if s["status"] == "failed")
    session = json.loads(next(run.glob("*/*/session.json")).read_text())
    run_doc = json.loads((run / "run.json").read_text())
    verdict_doc = json.loads((run / "verdict.json").read_text())
    profiles = json.loads((run / "profiles.json").read_text())
    soak = json.loads(next(run.glob("*/*/soak/soak.json")).read_text())
    soak_request = json.loads(next(run.glob("*/*/soak/requests.jsonl")).read_text().splitlines()[0])
    bad = [
        (result, _corrupted(ok, ("references",), "two")),
        (result, _corrupted(ok, ("scores",), None)),  # ok without scores
        (result, _corrupted(failed, ("failure",), None)),  # failed without a failure
        (result, _corrupted(ok, ("peaks", 0, "bytes"), -1)),
        (result, _corrupted(session, ("starts", 0, "attempt"), "0")),
        (result, _corrupted(run_doc, ("schema_version",), 0)),
        (result, {**ok, "unknown": 1}),
        (result, _corrupted(soak, ("requests",), "twelve")),
        (result, _corrupted(soak_request, ("number",), "1")),
        (verdict, _corrupted(verdict_doc, ("verdicts", 0, "world"), "fits")),
        (findings, _corrupted(profiles, ("cards", 0, "counts"), "none")),
    ]
    for check, doc in bad:
        assert problems(check, doc), f"accepted a corrupted record: {json.dumps(doc)[:300]}"
