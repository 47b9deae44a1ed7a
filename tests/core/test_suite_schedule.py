"""The suite's own schedule (tests/schedule.py): the longest units first, the waiting ones interleaved with the
computing ones at about one waiting second for two computing ones."""

from __future__ import annotations

from tests import schedule


def test_longest_first_and_waiting_units_interleaved() -> None:
    units = {"slurm": (400.0, 50.0), "docker": (200.0, 40.0), "ssh": (120.0, 55.0),  # waiting: CPU < half the wall
             "example": (240.0, 200.0), "stand": (130.0, 170.0), "glance": (70.0, 44.0), "core": (2.0, 1.9)}
    # computing 240 first; then the 400 s wait (240 > 2 x 0); then computing while it is at most 2 x 400 ...
    assert schedule.order(units) == ["example", "slurm", "stand", "glance", "core", "docker", "ssh"]


def test_three_waiting_units_never_start_together_while_computing_ones_remain() -> None:
    units = {f"wait{n}": (300.0 - n, 10.0) for n in range(3)} | {f"cpu{n}": (100.0 - n, 100.0) for n in range(3)}
    first_three = schedule.order(units)[:3]
    assert sum(u.startswith("wait") for u in first_three) == 1, first_three


def test_unit_times_sum_their_tests_and_count_unrecorded_ones_as_nothing() -> None:
    tests = [("g", "a.py::t1"), ("g", "a.py::t2"), ("b.py::t", "b.py::t")]
    seconds = {"a.py::t1": [10.0, 2.0], "a.py::t2": [5.0, 5.0]}
    assert schedule.unit_times(tests, seconds) == {"g": (15.0, 7.0), "b.py::t": (0.0, 0.0)}
