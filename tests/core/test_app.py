"""Exit status of a run (runner.app.exit_status) and the run's --help text."""

from __future__ import annotations

import subprocess
import sys

from runner.app import EXIT_INCOMPLETE, EXIT_OK, exit_status


def test_exit_status_every_card_reached_a_world() -> None:
    assert exit_status(["fits-resident", "offload-works", "not-built"], steps_left=0) == EXIT_OK == 0


def test_exit_status_undecided_or_incomplete_is_1() -> None:
    assert exit_status(["fits-resident", "undecided"], steps_left=0) == EXIT_INCOMPLETE == 1
    assert exit_status(["fits-resident"], steps_left=3) == 1


def test_help_documents_exit_status() -> None:
    out = subprocess.run([sys.executable, "-m", "runner", "run", "--help"], capture_output=True, text=True,
                         timeout=60).stdout
    assert "130" in out and "undecided" in out and "bad input" in out
