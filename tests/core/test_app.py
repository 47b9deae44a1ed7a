"""Exit status of a run (runner.app.exit_status), what a resume owes beyond its steps (the cards its preflight
must reach), and the run's --help text."""

from __future__ import annotations

import subprocess
import sys

from runner.app import EXIT_INCOMPLETE, EXIT_OK, exit_status, owed_beyond_steps, owed_here
from runner.plan.lanes import Lane, Session, Step
from runner.run.pending import Pending, without_cards


def test_exit_status_every_card_reached_a_world() -> None:
    assert exit_status(["fits-resident", "offload-works", "not-built"], steps_left=0) == EXIT_OK == 0


def test_exit_status_undecided_or_incomplete_is_1() -> None:
    assert exit_status(["fits-resident", "undecided"], steps_left=0) == EXIT_INCOMPLETE == 1
    assert exit_status(["fits-resident"], steps_left=3) == 1


def test_help_documents_exit_status() -> None:
    out = subprocess.run([sys.executable, "-m", "runner", "run", "--help"], capture_output=True, text=True,
                         timeout=60).stdout
    assert "130" in out and "undecided" in out and "bad input" in out


def test_a_resume_reaches_the_cards_that_owe_only_top_ups_or_their_soak() -> None:
    """Card a has steps left (its own preflight line counts them); b owes top-ups and soak requests, c only its
    soak: both start servers, so both are asked for, with what they owe."""
    session = Session("a", "default", (Step("a", "default", "f", 1, 1),))
    todo = Pending((Lane("a", ("a",), (session,)),), planned_sessions=3, planned_steps=3)
    owing = owed_beyond_steps(todo, topups={"a": 2, "b": 3}, soak={"a": 9, "b": 4, "c": 8})
    assert owing == {"b": "3 top-up send(s) and 4 soak request(s)", "c": "8 soak request(s)"}
    assert owed_here({"b": 4, "c": 8}, without_cards(todo, ["c"])) == 4  # a card set aside sends nothing now
