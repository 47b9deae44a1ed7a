"""The suite's own schedule (tests/schedule.py): the longest units first, the waiting ones spread evenly among the
computing ones."""

from __future__ import annotations

from tests import schedule


def test_longest_first_and_waiting_units_interleaved() -> None:
    units = {"slurm": (400.0, 50.0), "docker": (200.0, 40.0), "ssh": (120.0, 55.0),  # waiting: CPU < half the wall
             "example": (240.0, 200.0), "stand": (130.0, 170.0), "glance": (70.0, 44.0), "core": (2.0, 1.9)}
    # computing: 442 s in all, waiting: 720; each step takes the kind that is further behind its share
    assert schedule.order(units) == ["example", "slurm", "stand", "docker", "ssh", "glance", "core"]


def test_neither_kind_is_left_for_the_end() -> None:
    waiting = {f"wait{n}": (30.0 - n / 10, 3.0) for n in range(30)}
    units = waiting | {f"cpu{n}": (10.0 - n / 10, 10.0) for n in range(30)}
    order = schedule.order(units)
    for part in (order[:20], order[20:40], order[40:]):
        assert 8 <= sum(u.startswith("wait") for u in part) <= 12, part


def test_unit_times_sum_their_tests_and_count_unrecorded_ones_as_nothing() -> None:
    tests = [("g", "a.py::t1"), ("g", "a.py::t2"), ("b.py::t", "b.py::t")]
    seconds = {"a.py::t1": [10.0, 2.0], "a.py::t2": [5.0, 5.0]}
    assert schedule.unit_times(tests, seconds) == {"g": (15.0, 7.0), "b.py::t": (0.0, 0.0)}
