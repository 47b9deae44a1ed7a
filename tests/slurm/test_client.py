"""runner.slurm.client against the real slurmctld/slurmd of scripts/slurm-local.sh."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from runner.observe.scheduler import cluster_end
from runner.slurm import client, parse
from tests.slurm.conftest import wait_for

HOLD = "#!/bin/sh\nexec sleep 300\n"


def test_the_local_cluster_offers_two_gpu_types(slurm: None) -> None:
    nodes = client.nodes()
    assert nodes, "sinfo lists no node"
    offered = set().union(*(parse.gres_types(n.gres) for n in nodes))
    assert {"rtx3090", "rtx5080"} <= offered
    assert client.partition("debug") is not None and client.partition("debug")["State"] == "UP"
    assert client.partition("no-such-partition") is None


def test_two_gpu_types_run_side_by_side_each_with_its_own_device(tag: str, tmp_path: Path) -> None:
    ids = {}
    for gpu in ("rtx3090", "rtx5080"):
        out = tmp_path / f"{gpu}.out"
        ids[gpu] = client.sbatch([f"--job-name={tag}-{gpu}", f"--gres=gpu:{gpu}:1", f"--output={out}"],
                                 "#!/bin/sh\necho CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES\nexec sleep 300\n")
    running = wait_for(lambda: [j for j in client.jobs(job_ids=list(ids.values())) if j.state == "RUNNING"]
                       if len([j for j in client.jobs(job_ids=list(ids.values())) if j.state == "RUNNING"]) == 2
                       else None)
    assert {j.gres for j in running} == {"gres:gpu:rtx3090:1", "gres:gpu:rtx5080:1"}
    seen = {gpu: wait_for(lambda g=gpu: (tmp_path / f"{g}.out").read_text().strip()
                          if (tmp_path / f"{g}.out").exists() else None) for gpu in ids}
    # scripts/slurm-local.sh: nvidia0-1 are the two rtx3090, nvidia2 the rtx5080
    assert seen["rtx3090"] in ("CUDA_VISIBLE_DEVICES=0", "CUDA_VISIBLE_DEVICES=1")
    assert seen["rtx5080"] == "CUDA_VISIBLE_DEVICES=2"


def test_a_second_job_on_the_busy_rtx5080_pends_with_a_reason(tag: str) -> None:
    first = client.sbatch([f"--job-name={tag}-a", "--gres=gpu:rtx5080:1", "--output=/dev/null"], HOLD)
    wait_for(lambda: client.job(first) and client.job(first).state == "RUNNING")
    second = client.sbatch([f"--job-name={tag}-b", "--gres=gpu:rtx5080:1", "--output=/dev/null"], HOLD)
    job = wait_for(lambda: (j := client.job(second)) and j.reason != "None" and j)
    assert job.pending and job.reason == "Resources"
    client.scancel(first)
    wait_for(lambda: client.job(second).state == "RUNNING")


def test_a_step_cancelled_from_outside_leaves_slurmstepds_line_in_its_log(tag: str, tmp_path: Path) -> None:
    job_id = client.sbatch([f"--job-name={tag}", "--gres=gpu:rtx5080:1", "--output=/dev/null"], HOLD)
    wait_for(lambda: client.job(job_id).state == "RUNNING")
    log = tmp_path / "server.log"
    step = subprocess.Popen(client.srun_argv(job_id, name="server", output=str(log),
                                             command=["sh", "-c", "echo started; sleep 1; echo running; "
                                                      "exec sleep 300"]),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        found = wait_for(lambda: [s for s in client.steps(job_id) if s.name == "server"])
        assert found[0].step_id.startswith(f"{job_id}.")
        # Cancelled once its task has run a second, as a server the runner cancels has (it loads first). In a
        # clean-clone run a cancel 0.4 s after the launch (the task had printed "started") left the line in
        # slurmd.log ("[23.0] error: *** STEP 23.0 ON vm CANCELLED AT …") and not in the step's output.
        wait_for(lambda: log.is_file() and "running" in log.read_text())
        client.scancel(found[0].step_id)
        assert step.wait(timeout=30) != 0
    finally:
        step.kill()
    end = wait_for(lambda: cluster_end(log.read_text()), timeout_s=10)  # slurmstepd writes it as the task ends
    assert end is not None and end.cause == "cancelled" and f"STEP {found[0].step_id}" in end.line
    assert client.job(job_id).state == "RUNNING", "cancelling a step must leave its allocation"


def test_failures_are_one_line(slurm: None) -> None:
    with pytest.raises(client.SlurmError, match=r"[Ii]nvalid partition"):
        client.sbatch(["--partition=no-such-partition", "--output=/dev/null"], HOLD)
    with pytest.raises(client.SlurmError) as exc:
        client.sbatch(["--gres=gpu:h100:1", "--output=/dev/null"], HOLD)
    assert "\n" not in str(exc.value)
    client.scancel(999_999_999)  # gone already: not an error


def test_sacct_says_when_the_cluster_keeps_no_accounting(slurm: None) -> None:
    # The local cluster has no slurmdbd (accounting_storage/none): sacct must say so, not return nothing.
    assert client.sacct([1]) is None


# --- a controller that does not answer (issue 30 S-2) and the client's configuration (S-3) ---------------

OUTAGE_SHIM = """#!/bin/sh
# {command} while the controller is away, as Slurm 23+ answers it: JSON with an `errors` array
if [ -e "{flag}" ]; then
  echo '{{"errors": [{{"error": "Unable to contact slurm controller (connect failure)"}}], "{key}": []}}'
  exit 0
fi
exec {real} "$@"
"""


@pytest.fixture
def outage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A flag file: while it exists, `squeue` (first on PATH) answers as during a controller outage; so does
    `sinfo` while a second flag, `<flag>-sinfo`, exists."""
    import shutil

    flag, bin_dir = tmp_path / "controller-away", tmp_path / "bin"
    bin_dir.mkdir()
    for command, key, when in (("squeue", "jobs", flag), ("sinfo", "nodes", f"{flag}-sinfo")):
        shim = bin_dir / command
        shim.write_text(OUTAGE_SHIM.format(command=command, flag=when, key=key, real=shutil.which(command)))
        shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(client, "OUTAGE_POLL_S", 0.2, raising=False)
    return flag


def test_a_controller_outage_is_waited_out(slurm: None, outage: Path) -> None:
    outage.touch()
    back = threading.Timer(3.0, outage.unlink)
    back.start()
    t0 = time.monotonic()
    try:
        found = client.jobs()  # on 9ea8d2e: SlurmParseError at once, a traceback in the runner
    finally:
        back.cancel()
    assert isinstance(found, list) and time.monotonic() - t0 >= 3.0


def test_a_longer_outage_is_one_line_and_the_lanes_allocation_is_released(tag: str, outage: Path,
                                                                         tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from runner.backends.base import StartFailed
    from runner.backends.slurm import SlurmLane
    from runner.core.registry import SlurmOptions

    monkeypatch.setattr(client, "OUTAGE_S", 1.0, raising=False)
    lane = SlurmLane("c", tag)
    options = SlurmOptions(partition="debug", gres="gpu:rtx3090:1", time_limit="5")
    alloc = lane.allocation("c", options, tmp_path / "c")
    outage.touch()
    with pytest.raises(client.SlurmError, match=r"Unable to contact slurm controller .*did not answer for 1 s"):
        client.jobs()
    with pytest.raises(StartFailed) as failed:  # the next server start of the lane asks about its job
        lane.allocation("c", options, tmp_path / "c")
    assert f"job {alloc.job_id}" in failed.value.failure.message and "released" in failed.value.failure.message
    outage.unlink()
    wait_for(lambda: not client.job(alloc.job_id).active, timeout_s=30)  # type: ignore[union-attr]
    assert "c" not in lane.allocations


def test_an_outage_once_the_job_runs_releases_it_with_one_line(tag: str, outage: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Granted, then the controller is away when the lane asks for the node's address: before, a SlurmError
    # escaped and the job stayed held until the runner exited
    from runner.backends.base import StartFailed
    from runner.backends.slurm import SlurmLane
    from runner.core.registry import SlurmOptions

    monkeypatch.setattr(client, "OUTAGE_S", 1.0, raising=False)
    Path(f"{outage}-sinfo").touch()
    lane = SlurmLane("c", tag)
    with pytest.raises(StartFailed) as failed:
        lane.allocation("c", SlurmOptions(partition="debug", gres="gpu:rtx3090:1", time_limit="5"), tmp_path / "c")
    message = failed.value.failure.message
    assert "could not ask Slurm about node" in message and "released" in message and "\n" not in message
    job_id = int(message.split("of job ")[1].split(" ")[0])
    Path(f"{outage}-sinfo").unlink()
    wait_for(lambda: (job := client.job(job_id)) is None or not job.active, timeout_s=30)
    assert "c" not in lane.allocations


def test_the_clients_configuration_is_kept_and_a_jobs_context_is_not(slurm: None,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "424242")
    monkeypatch.setenv("SBATCH_PARTITION", "no-such")
    monkeypatch.setenv("SLURM_CLUSTERS", "mine")
    env = client.without_job_context({**os.environ, "SLURM_CONF": "/etc/other/slurm.conf"})
    assert "SLURM_JOB_ID" not in env and "SBATCH_PARTITION" not in env
    assert env["SLURM_CONF"] == "/etc/other/slurm.conf" and env["SLURM_CLUSTERS"] == "mine"


def test_a_slurm_conf_of_another_cluster_is_the_one_the_commands_read(slurm: None,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 30 S-3 as a user meets it: SLURM_CONF names another (here: no) cluster, and the runner's commands
    talk to that one, not to the default (on 213f931 it was stripped and sinfo answered from the default)."""
    monkeypatch.setenv("SLURM_CONF", "/nonexistent/slurm.conf")
    with pytest.raises(client.SlurmError):
        client.run(["sinfo", "--json"])


def test_a_dead_controller_is_said_in_words_not_scontrols_banner(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # issue 30 S-5: scontrol ping ends its answer with a line of asterisks; the error ended "does not answer: ****…"
    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir()
    stars = "*" * 41
    fake.write_text(f"#!/bin/sh\necho 'Slurmctld(primary) at vm is DOWN'\necho '{stars}'\n"
                    f"echo '** RESTORE SLURMCTLD DAEMON TO SERVICE **'\necho '{stars}'\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    with pytest.raises(client.SlurmError) as info:
        client.ping()
    assert str(info.value) == "the Slurm controller does not answer: Slurmctld(primary) at vm is DOWN"
