"""Issue 18 item 16: `sample_hz = 1e-300` and a FIFO passed as the matrix file each end as one line and exit
2 — no traceback, no hang."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def runner(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, timeout=30,
                          cwd=cwd)


def test_sample_hz_near_zero_is_one_line(matrix_dir: Path) -> None:
    path = matrix_dir / "matrix.toml"
    path.write_text(path.read_text().replace("steps = 4", "steps = 4\nsample_hz = 1e-300"))
    for args in (("plan", str(path)), (str(path), "--no-progress")):
        proc = runner(*args, cwd=matrix_dir)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "sample_hz" in lines[0] and "1e-300" in lines[0], proc.stderr


def test_a_fifo_as_the_matrix_is_refused_without_reading_it(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    for args in (("plan", str(fifo)), (str(fifo), "--no-progress")):
        proc = runner(*args, cwd=tmp_path)  # before the fix: blocked in read() until the 30 s timeout
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip() == f"runner: error: {fifo}: cannot read matrix: not a regular file"
