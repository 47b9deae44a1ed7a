"""`runner refserver` without the refserver extra: one line naming the extra, exit 2, no traceback."""

from __future__ import annotations

import subprocess
import sys

# A real interpreter in which torch cannot be imported (as in a venv without the extra).
BLOCK_TORCH = """
import sys
sys.modules["torch"] = None
from runner.cli import main
sys.exit(main(["refserver", "--port", "0"]))
"""


def test_refserver_without_extra_names_it_and_exits_2() -> None:
    done = subprocess.run([sys.executable, "-c", BLOCK_TORCH], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "refserver extra" in lines[0] and "torch" in lines[0], done.stderr
    assert "Traceback" not in done.stderr
