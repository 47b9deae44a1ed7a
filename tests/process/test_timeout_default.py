"""Issue 18 item 3, end to end on the reference server: the default flag set times out (its request hangs),
the offload flag set serves. A timeout says nothing about memory, so the card is undecided (exit 1) and the
line names the timed-out record — never offload-works from a timeout (09c7220: offload-works, exit 0)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from processkit import matrix, nothing_left, run_dir

pytestmark = pytest.mark.slow

FLAGS = """args = ["--fault", "hang@1"]

[flags.host-cache]
role = "offload"
args = ["--cond-cache", "host"]
"""


def test_a_default_that_times_out_never_makes_the_offload_set_offload_works(tmp_path: Path) -> None:
    path = matrix(tmp_path, seeds="[1]", references="[1]", request_timeout=3, flags=FLAGS,
                  extra="restarts = 0")
    proc = subprocess.run([sys.executable, "-m", "runner", str(path), "--no-progress"], capture_output=True,
                          text=True, timeout=240, cwd=tmp_path)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    run = run_dir(tmp_path)
    hung = json.loads((run / "roomy/default/refs-1/shapes-seed-1.json").read_text())
    served = json.loads((run / "roomy/host-cache/refs-1/shapes-seed-1.json").read_text())
    assert hung["failure"]["kind"] == "timeout" and served["status"] == "ok", (hung, served)
    (verdict,) = json.loads((run / "verdict.json").read_text())["verdicts"]
    assert verdict["world"] == "undecided", verdict["reason"]
    assert verdict["evidence"]["blocking"][0]["record"] == "roomy/default/refs-1/shapes-seed-1", verdict["evidence"]
    line = next(ln for ln in proc.stdout.splitlines() if "undecided" in ln)
    assert "default" in line and "timeout" in line and "offload-works" not in proc.stdout, proc.stdout
    assert proc.returncode == 1, proc.stdout[-2000:]
    nothing_left(tmp_path)
