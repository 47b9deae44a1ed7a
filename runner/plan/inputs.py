"""The inputs a run's records depend on, fingerprinted into run.json, so that a resume in a changed world is
refused and says what changed (instead of mixing records of two worlds in one cell).

Fingerprinted: the matrix as parsed (so a comment-only or whitespace edit is not a change, and the same
matrix copied to another folder is the same), each reference image and baseline file by content (what the
matrix names them, so a copy of the matrix next to the same files resumes), every `${VAR}` the servers' env
resolves (a salted hash: the value itself never reaches run.json) and each session's server command (argv,
env, image, backend, host, GPU, mounts). Not fingerprinted: what a mount holds (model weights are too
large to hash at every resume) and the image's bytes (run.json records its id per start).
"""

from __future__ import annotations

import hashlib
import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from runner.core.errors import UserError
from runner.plan import baseline
from runner.plan.lanes import Plan
from runner.plan.matrix import Matrix, env_refs

LISTED = 3  # changes named in the refusal line; the rest are counted


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _file(path: Path) -> str:
    try:
        return _sha(path.read_bytes())
    except OSError as exc:
        return f"unreadable ({exc.strerror})"


def _canonical(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str).encode()


def fingerprint(matrix: Matrix, plan: Plan, salt: str, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """name → digest for every input the records depend on (names say where the matrix names it)."""
    out = {"matrix (as parsed)": _sha(_canonical(tomllib.loads(matrix.text)))}
    for fx in matrix.axes.fixtures:
        for i, path in enumerate(matrix.fixtures[fx].references[: matrix.most_references]):
            out[f"fixtures.{fx}.references[{i}] ({path.name})"] = _file(path)
    b = matrix.baseline
    if b and b.directory is not None:
        out["baseline samples.json"] = _file(b.directory / "samples.json")
        try:
            samples = baseline.load_samples(b.directory)
        except UserError:
            samples = []  # already covered: samples.json's digest differs or is unreadable
        for sample in samples:
            out[f"baseline {sample.file.name}"] = _file(sample.file)
    names = sorted({name for s in plan.sessions if s.server for v in s.server.env.values()
                    for name in env_refs(v)})
    for name in names:
        value = environ.get(name)
        out[f"env ${{{name}}}"] = "unset" if value is None else _sha(f"{salt}\0{name}\0{value}".encode())
    for s in plan.sessions:
        if s.server is not None:
            # the profile is a pydantic model (runner.plan.matrix): its dump is what asdict gave when it was a dataclass
            server = {k: v for k, v in asdict(s.server).items() if k != "labels"} | \
                {"profile": s.server.profile.model_dump()}
            out[f"server command of {s.key}"] = _sha(_canonical(server))
    return out


def changes(before: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    """What differs, in words (empty when nothing does)."""
    out = [f"{k} changed" for k in before if k in now and before[k] != now[k]]
    out += [f"{k} is new" for k in now if k not in before]
    out += [f"{k} is gone" for k in before if k not in now]
    return out


def refusal(run_id: str, diff: list[str]) -> str:
    listed = "; ".join(diff[:LISTED]) + (f"; and {len(diff) - LISTED} more" if len(diff) > LISTED else "")
    return (f"cannot resume run {run_id}: its inputs changed since it started ({listed}); its records would "
            f"mix two different worlds — restore the inputs or start a new run")
