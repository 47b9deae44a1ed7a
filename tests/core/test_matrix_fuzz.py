"""Property-based fuzz of the matrix loader: whatever the file holds, load_matrix returns a Matrix or raises
UserError (one line) — never any other exception. Placeholder rendering of an accepted matrix never raises,
and the published schema (runner/schema/matrix.schema.json, what an editor checks) accepts what the loader
accepts.
"""

from __future__ import annotations

import json
import math
import tempfile
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner.core.errors import UserError
from runner.plan.lanes import render_template
from runner.plan.matrix import PLACEHOLDERS, load_matrix

SCHEMA = jsonschema.Draft4Validator(json.loads((Path(__file__).resolve().parents[2] / "runner" / "schema" /
                                                "matrix.schema.json").read_text()))

BASE = tomllib.loads(textwrap.dedent("""
    [run]
    name = "t"
    seeds = [1, 2]
    size = "64x64"
    [servers.ref]
    command = ["{python}", "-m", "runner.refserver", "--port", "{port}"]
    env = { A = "1" }
    [cards.small]
    server = "ref"
    vram_gib = 0.5
    [flags.default]
    role = "default"
    args = ["--x"]
    [fixtures.pair]
    prompt = "p"
    references = ["a.png", "b.png"]
    [matrix]
    references = [1, 2]
    [verdict]
    min_psnr_db = 20
    [baseline]
    cell = "small/default"
"""))

KEYS = ["name", "seeds", "size", "steps", "request_timeout_s", "ready_timeout_s", "sample_hz", "restarts",
        "results_dir", "true_cfg_scale", "command", "env", "port", "image", "server", "vram_gib", "vram_mib",
        "gpu", "meters", "backend", "docker_host", "publish_host", "role", "args", "prompt", "references",
        "cards", "flags", "fixtures", "exclude", "target_references", "max_latency_ratio", "min_psnr_db",
        "max_transparent_share", "min_pixel_std", "offload_roles", "cell", "dir", "health_path", "mounts",
        "A", "HF_TOKEN", "..", "", "x" * 300]

braces = st.sampled_from(["{", "}", "{{", "}}", "${", "${HOME}", "${1}", "{port}", "{port:>99999999}",
                          "{port!r}", "{port.real}", "{x}", '{"a": 1}', "..", "/", "\x00", "ü"] +
                         [f"{{{p}}}" for p in PLACEHOLDERS])
text = st.one_of(st.text(max_size=20), st.lists(st.one_of(braces, st.text(max_size=4)), max_size=5).map("".join))
scalar = st.one_of(text, st.integers(min_value=-2**63, max_value=2**63 - 1), st.booleans(),
                   st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([math.nan, math.inf, -math.inf, 0, -1, 1e300, 2**62]))
value = st.recursive(scalar, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.sampled_from(KEYS), inner, max_size=4)),
                     max_leaves=10)


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string, or a syntax error (surrogates): both fine to fuzz
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + "}"


def dump(doc: dict[str, Any]) -> str:
    lines = []
    for section, body in doc.items():
        if isinstance(body, dict) and all(isinstance(x, dict) for x in body.values()) and body:
            for name, table in body.items():
                lines.append(f"[{json.dumps(section)}.{json.dumps(name)}]")
                lines += [f"{json.dumps(k)} = {toml_value(x)}" for k, x in table.items()]
        elif isinstance(body, dict):
            lines.append(f"[{json.dumps(section)}]")
            lines += [f"{json.dumps(k)} = {toml_value(x)}" for k, x in body.items()]
        else:
            lines.insert(0, f"{json.dumps(section)} = {toml_value(body)}")
    return "\n".join(lines) + "\n"


def check(text_: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.toml"
        path.write_text(text_, encoding="utf-8", errors="surrogatepass")
        try:
            m = load_matrix(path, check_files=False)
        except UserError as exc:
            assert "\n" not in str(exc)
            return
        errors = [e.message for e in SCHEMA.iter_errors(tomllib.loads(m.text))]
        assert not errors, errors  # the editor's schema must not refuse a matrix the runner runs
        values = dict.fromkeys(PLACEHOLDERS, "v")
        for s in m.servers.values():
            for t in (*s.command, *s.env.values()):
                render_template(t, values)
        for f in m.flags.values():
            for t in (*f.args, *f.env.values()):
                render_template(t, values)


SECTIONS = [("run", None), ("servers", "ref"), ("cards", "small"), ("flags", "default"), ("fixtures", "pair"),
            ("matrix", None), ("verdict", None), ("baseline", None)]
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(SECTIONS), st.sampled_from(KEYS), value), min_size=1, max_size=4))
def test_loader_mutated_matrix_never_traces_back(edits: list) -> None:
    doc = json.loads(json.dumps(BASE))
    for (section, name), key, v in edits:
        table = doc.setdefault(section, {})
        if name is not None:
            table = table.setdefault(name, {})
        table[key] = v
    check(dump(doc))


@FUZZ
@given(st.dictionaries(st.sampled_from(["run", "servers", "cards", "flags", "fixtures", "matrix", "verdict",
                                        "baseline", "x"]), value, max_size=6))
def test_loader_random_documents_never_trace_back(doc: dict) -> None:
    check(dump(doc))


@FUZZ
@given(st.text(max_size=300))
def test_loader_random_text_never_traces_back(raw: str) -> None:
    check(raw)


VALUES = [0, 1, 2, 8, -1, 70000, 0.5, 2.5, 1e-300, 1e9, True, False, "", "x", "auto", "64x64", "/health", "default",
          "offload", "local", "docker", "small", "small/default", "vllm-omni-chat", "{port}", "${HOME}", "512m",
          [], [0], [1, 2], [2, 1], ["x"], ["server"], ["small"], ["default"], ["pair"], [{"card": "small"}],
          [{"source": "/a", "target": "/b"}], {}, {"A": "1"}, {"A": 1}, {"bad-key": "1"}]


def test_the_schema_accepts_every_matrix_the_loader_accepts() -> None:
    """Each declared key of each table set to each of a set of values, one at a time: whenever the loader
    accepts the matrix, so does the published schema (an editor must never flag a matrix that runs)."""
    sections = {"run": ("run", None), "ServerProfile": ("servers", "ref"), "Card": ("cards", "small"),
                "FlagSet": ("flags", "default"), "Fixture": ("fixtures", "pair"), "Axes": ("matrix", None),
                "VerdictRules": ("verdict", None), "Baseline": ("baseline", None)}
    defs = SCHEMA.schema["definitions"]
    accepted = 0
    for model, (section, name) in sections.items():
        keys = defs["RunSettings" if model == "run" else model]["properties"]
        for key in keys:
            for v in VALUES:
                doc = json.loads(json.dumps(BASE))
                table = doc.setdefault(section, {})
                table = table.setdefault(name, {}) if name else table
                table[key] = v
                with tempfile.TemporaryDirectory() as tmp:
                    path = Path(tmp) / "m.toml"
                    path.write_text(dump(doc))
                    try:
                        text = load_matrix(path, check_files=False).text
                    except UserError:
                        continue
                accepted += 1
                errors = [e.message for e in SCHEMA.iter_errors(tomllib.loads(text))]
                assert not errors, (section, key, v, errors)
    assert accepted > 100  # the sweep reached matrices that load, not only refusals
