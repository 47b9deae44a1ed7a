"""The README's first command: the embedded default shows the three verdict worlds and leaves every file the
README promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_local_example_shows_all_three_worlds(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "runner", str(ROOT / "examples" / "local.toml"), "--results",
                           str(tmp_path), "--no-progress"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = tmp_path.glob("local-*")
    worlds = {v["card"]: v["world"] for v in json.loads((run_dir / "verdict.json").read_text())["verdicts"]}
    assert worlds == {"cpu-roomy": "fits-resident", "cpu-tight": "offload-works", "cpu-tiny": "not-built"}
    assert (run_dir / "report.md").read_text().count("## cpu-") == 3
    plots = {p.name for p in (run_dir / "plots").glob("*.png")}
    assert {"cpu-roomy-capacity.png", "cpu-tight--default-memory.png"} <= plots and len(plots) >= 15
    steps = [json.loads(p.read_text()) for p in run_dir.glob("*/*/refs-*/*.json")]
    assert len(steps) == 120
    for s in steps:
        png = run_dir / f"{s['key']}.png"
        assert png.is_file() == (s["status"] == "ok"), s["key"]
