"""One run of examples/local.toml (the README's first command) shared by the tests that read it: each run
is minutes on this machine, and the tests only read the run folder."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ExampleRun:
    proc: subprocess.CompletedProcess[str]
    run_dir: Path


@pytest.fixture(scope="session")
def local_example(tmp_path_factory: pytest.TempPathFactory) -> ExampleRun:
    results = tmp_path_factory.mktemp("local-example")
    proc = subprocess.run([sys.executable, "-m", "runner", str(ROOT / "examples" / "local.toml"), "--results",
                           str(results), "--no-progress"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = results.glob("local-*")
    return ExampleRun(proc, run_dir)
