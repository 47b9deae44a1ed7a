"""Issue 46 R-1 on the real local Slurm: a run folder named relative to the working folder, as a person types it
(and as the runner printed the resume command when it was given one). The job step's `--chdir` and `--output`
are read on the node, inside the run folder itself: a relative folder there was nested in itself, slurmd
could not open the step's log, and every start failed as `load_exit`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from runner.slurm import client
from tests.slurm.slurmkit import ROOT, run_dir, runner_argv, session, steps, write_matrix

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}  # this tree's runner, from a working folder outside it


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=cwd, env=ENV)


def _served_in_place(run: Path) -> None:
    (step,) = steps(run)
    assert step["status"] == "ok", step
    (start,) = session(run)["starts"][-1:]
    assert start["failure"] is None and start["ready_s"] is not None, start
    assert list((run / "c").glob("slurm-*.log")), "the allocation's log is in the card's folder"
    assert not (run / "c" / run.relative_to(run.parents[1])).exists(), "no run folder nested in itself"


def test_a_fresh_run_with_a_relative_results_folder_runs_on_slurm(tag: str, tmp_path: Path) -> None:
    matrix = write_matrix(tmp_path, tag)
    proc = _run(runner_argv(matrix, Path("relres")), tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    _served_in_place(run_dir(tmp_path / "relres"))
    assert not [j for j in client.jobs() if j.name.startswith(f"runner-{tag}") and j.active]


def test_a_resume_by_a_relative_path_sends_the_lost_step(tag: str, tmp_path: Path) -> None:
    matrix = write_matrix(tmp_path, tag)
    first = _run(runner_argv(matrix, tmp_path / "results"), tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    run = run_dir(tmp_path / "results")
    (lost,) = run.glob("c/default/refs-1/*.json")  # the step is lost: a resume sends it again
    lost.unlink()
    lost.with_suffix(".png").unlink(missing_ok=True)
    typed = run.relative_to(tmp_path)  # results/<run-id>, from the folder the person is in
    resumed = _run(runner_argv(matrix, tmp_path / "results", "--resume", str(typed)), tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "1 step(s) to send" in resumed.stderr, resumed.stderr[-2000:]
    _served_in_place(run)
    assert len(session(run)["starts"]) == 2  # the first run's start and the resume's
