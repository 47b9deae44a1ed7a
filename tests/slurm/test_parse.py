"""runner.slurm.parse on the shapes other Slurm versions print (the local 22.05 shapes are covered by
test_client against the real daemons)."""

from __future__ import annotations

import json

import pytest

from runner.observe.scheduler import cluster_end
from runner.slurm import parse


def test_squeue_json_of_slurm_23_wraps_numbers_and_lists_states() -> None:
    doc = {"errors": [], "jobs": [{"job_id": 42, "name": "runner:x", "job_state": ["PENDING"],
                                   "state_reason": "Priority", "nodes": "", "comment": "c",
                                   "partition": "gpu", "tres_per_node": "gres/gpu:a100:1",
                                   "submit_time": {"set": True, "infinite": False, "number": 1700000000},
                                   "start_time": {"set": False, "infinite": False, "number": 0},
                                   "end_time": {"set": True, "infinite": True, "number": 0}}]}
    (job,) = parse.jobs_from_squeue_json(json.dumps(doc))
    assert (job.job_id, job.state, job.reason, job.pending) == (42, "PENDING", "Priority", True)
    assert (job.submit_time, job.start_time, job.end_time) == (1700000000.0, None, None)


def test_an_errors_entry_is_the_message() -> None:
    with pytest.raises(parse.SlurmParseError, match="Invalid job id"):
        parse.jobs_from_squeue_json(json.dumps({"errors": [{"error": "Invalid job id specified"}], "jobs": []}))
    with pytest.raises(parse.SlurmParseError, match="no JSON"):
        parse.jobs_from_squeue_json("squeue: error: x")


@pytest.mark.parametrize(("gres", "gpu_type"), [("gpu:rtx3090:1", "rtx3090"), ("gpu:1", None),
                                                ("rtx5080", "rtx5080"), ("gres:gpu:a100:2", "a100"),
                                                ("gpu", None)])
def test_requested_gpu_type(gres: str, gpu_type: str | None) -> None:
    assert parse.requested_gpu_type(gres) == gpu_type


def test_gres_lists_with_socket_affinity() -> None:
    assert parse.split_gres("gpu:a100:4(S:0-1),gpu:h100:2") == ["gpu:a100:4", "gpu:h100:2"]
    assert parse.gres_types(("gpu:a100:4", "gpu:2", "nic:mlx:1")) == {"a100"}
    assert parse.split_gres("(null)") == []


@pytest.mark.parametrize(("line", "cause"), [
    ("slurmstepd: error: *** JOB 12 ON n1 CANCELLED AT 2026-12-01T09:20:58 DUE TO TIME LIMIT ***", "time_limit"),
    ("slurmstepd: error: *** JOB 12 ON n1 CANCELLED AT 2026-12-01T09:20:58 DUE TO PREEMPTION ***", "preempted"),
    ("slurmstepd: error: *** STEP 12.0 ON n1 CANCELLED AT 2026-12-01T09:20:58 DUE TO NODE FAILURE ***",
     "node_failure"),
    ("slurmstepd-n1: error: *** STEP 12.3 ON n1 CANCELLED AT 2026-12-01T09:20:58 ***", "cancelled"),
    # what slurmstepd and srun wrote here when the node was set down under a running job (22.05)
    ("slurmstepd-vm: error: *** JOB 54 ON vm CANCELLED AT 2026-12-01T10:08:34 DUE TO NODE FAILURE, SEE SLURMCTLD "
     "LOG FOR DETAILS ***", "node_failure"),
    ("srun: error: Node failure on vm", "node_failure"),
])
def test_slurmstepd_end_lines(line: str, cause: str) -> None:
    end = cluster_end(f"INFO serving\n{line}\n")
    assert end is not None and end.cause == cause
    assert cluster_end("INFO serving\nERROR something else\n") is None


def test_sbatch_and_scontrol_lines() -> None:
    assert parse.job_id_from_sbatch("123;cluster\n") == 123
    with pytest.raises(parse.SlurmParseError):
        parse.job_id_from_sbatch("Submitted batch job 123")
    assert parse.key_values("PartitionName=debug Nodes=vm State=UP")["State"] == "UP"
    assert parse.controller_up("Slurmctld(primary) at vm is UP\n")
    assert not parse.controller_up("Slurmctld(primary) at vm is DOWN\n")


def test_local_slurm_example_is_local_toml_through_slurm() -> None:
    """examples/local-slurm.toml is examples/local.toml with every card submitted through Slurm (no Slurm
    needed to check that)."""
    from pathlib import Path

    from runner.plan.matrix import load_matrix

    examples = Path(__file__).resolve().parents[2] / "examples"
    slurm_m, local_m = load_matrix(examples / "local-slurm.toml"), load_matrix(examples / "local.toml")
    assert {c.backend for c in slurm_m.cards.values()} == {"slurm"}
    assert {n: c.vram_gib for n, c in local_m.cards.items()} == {n: c.vram_gib for n, c in slurm_m.cards.items()}
    assert slurm_m.servers == local_m.servers and slurm_m.flags == local_m.flags
    assert slurm_m.fixtures == local_m.fixtures and slurm_m.axes == local_m.axes
    assert slurm_m.verdict == local_m.verdict and slurm_m.baseline == local_m.baseline
    assert {c.options.gres_request for c in slurm_m.cards.values()} == {"gpu:rtx3090:1", "gpu:rtx5080:1"}
