"""A small slurm matrix on disk and the runner as a subprocess, for the backend's tests."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from tests.conftest import write_png

ROOT = Path(__file__).resolve().parents[2]

MATRIX = """
[run]
name = "{name}"
seeds = {seeds}
steps = 2
size = "64x64"
request_timeout_s = {request_timeout_s}
ready_timeout_s = 240
restarts = {restarts}
sample_hz = 5

[servers.ref]
command = ["{{python}}", "-m", "runner.refserver", "--host", "{{host}}", "--port", "{{port}}", "--preset", "tiny",
           "--vram-gib", "{{vram_gib}}"]

[cards.c]
server = "ref"
backend = "slurm"
partition = "{partition}"
gres = "{gres}"
time_limit = "{time_limit}"
vram_gib = 1
{card_extra}

[flags.default]
role = "default"
args = {flag_args}

[fixtures.pair]
prompt = "a cat on a sofa"
references = ["refs/a.png", "refs/b.png"]

[matrix]
references = {references}
"""


def write_matrix(folder: Path, name: str, *, partition: str = "debug", gres: str = "gpu:rtx5080:1",
                 seeds: str = "[1]", references: str = "[1]", restarts: int = 0, card_extra: str = "",
                 time_limit: str = "20:00", flag_args: str = "[]", request_timeout_s: int = 60) -> Path:
    write_png(folder / "refs" / "a.png", 1)
    write_png(folder / "refs" / "b.png", 2)
    path = folder / "matrix.toml"
    path.write_text(textwrap.dedent(MATRIX.format(name=name, partition=partition, gres=gres, seeds=seeds,
                                                  references=references, restarts=restarts,
                                                  card_extra=card_extra, time_limit=time_limit,
                                                  flag_args=flag_args, request_timeout_s=request_timeout_s)))
    return path


def runner_argv(matrix: Path, results: Path, *more: str) -> list[str]:
    return [sys.executable, "-m", "runner", str(matrix), "--results", str(results), "--no-progress", *more]


def start_runner(matrix: Path, results: Path, log: Path, *more: str) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(runner_argv(matrix, results, *more), stdout=out, stderr=subprocess.STDOUT,
                                cwd=ROOT)


def find_run(results: Path) -> Path | None:
    """The run's one folder, or None while the runner has not made results/ or the folder yet."""
    runs = [p for p in results.iterdir() if p.is_dir()] if results.is_dir() else []
    if not runs:
        return None
    (found,) = runs
    return found


def run_dir(results: Path) -> Path:
    found = find_run(results)
    assert found is not None, f"no run folder in {results}"
    return found


def a_step_is_ok(results: Path) -> bool:
    """A wait_for predicate, safe while the runner is still making results/ and its run folder."""
    found = find_run(results)
    return found is not None and any(s["status"] == "ok" for s in steps(found))


def session(run: Path, key: str = "c/default") -> dict[str, Any]:
    return json.loads((run / key / "session.json").read_text())


def steps(run: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(run.glob("*/*/refs-*/*.json"))]
