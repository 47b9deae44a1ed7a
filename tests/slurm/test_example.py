"""examples/local-slurm.toml on the real local Slurm: the same three worlds as examples/local.toml, the
cards' allocations running at the same time, and no job left afterwards. (A lane waiting in the queue is
tests/slurm/test_backend.py's.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runner.slurm import client
from tests.conftest import example_copy
from tests.slurm.slurmkit import ROOT

pytestmark = pytest.mark.slow


def test_local_slurm_example_gives_the_three_worlds_with_lanes_side_by_side(slurm: None, tmp_path: Path) -> None:
    # The example with one seed, no diagnosis pass and the two flag sets that decide the three worlds (default and
    # cpu-offload; examples/local.toml's run in tests/e2e has all five, both seeds and the passes): what is under
    # test here is Slurm's, the allocations and their lanes, not the findings. Nor the latency: with one seed on a
    # loaded 2-core machine, cpu-tight's offload-to-default interval once straddled the limit of 3 after 8 sends
    # (1.45x [0.68-3.10], CI-like run at d0f0fbd), an honest "undecided" that is not Slurm's to show.
    example = example_copy("local-slurm.toml", tmp_path / "matrix", seeds="[2301]", diagnosis='"off"',
                           verdict={"max_latency_ratio": "20"}, matrix={"flags": '["default", "cpu-offload"]'})
    proc = subprocess.run([sys.executable, "-m", "runner", str(example), "--results", str(tmp_path / "results"),
                           "--no-progress"], capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = (tmp_path / "results").glob("local-slurm-*")
    worlds = {v["card"]: v["world"] for v in json.loads((run / "verdict.json").read_text())["verdicts"]}
    assert worlds == {"cpu-roomy": "fits-resident", "cpu-tight": "offload-works", "cpu-tiny": "not-built"}
    # One allocation per card: every start of a card names the same job; the cards' jobs differ.
    jobs = {}
    for card in worlds:
        ids = {json.loads(p.read_text())["starts"][0]["info"]["slurm_job_id"]
               for p in run.glob(f"{card}/*/session.json")}
        assert len(ids) == 1, (card, ids)
        jobs[card] = ids.pop()
    assert len(set(jobs.values())) == 3
    # The controller's own times (squeue keeps finished jobs for MinJobAge): the three allocations ran at the
    # same time, each on its own GPU.
    times = {card: client.job(job) for card, job in jobs.items()}
    assert all(j and j.start_time and j.end_time for j in times.values()), times
    assert max(j.start_time for j in times.values()) < min(j.end_time for j in times.values()), times
    gpus = {c: json.loads(next(run.glob(f"{c}/*/session.json")).read_text())["starts"][0]["info"]
            ["cuda_visible_devices"] for c in times}
    assert sorted(gpus.values()) == ["0", "1", "2"] and gpus["cpu-tight"] == "2", gpus  # 2: the rtx5080
    assert proc.stderr.count("running on") == 3
    # Nothing left behind: every job of the run is over.
    left = [j for j in client.jobs() if j.job_id in jobs.values() and j.active]
    assert not left, left
    facts = json.loads((run / "run.json").read_text())["cards"]
    assert {f["job_id"] for f in facts["cpu-roomy"]["slurm"]} == {jobs["cpu-roomy"]}
