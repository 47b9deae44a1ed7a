"""The slurm backend against the real local Slurm (scripts/slurm-local.sh): preflight, queueing, the
lifeline, a step cancelled from outside, ownership. Each test runs the real runner as a subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.backends import owner
from runner.backends import slurm as backend
from runner.slurm import client
from tests.slurm.conftest import wait_for
from tests.slurm.slurmkit import ROOT, a_step_is_ok, run_dir, runner_argv, session, start_runner, steps, write_matrix

HOLD = "#!/bin/sh\nexec sleep 600\n"


def active_jobs(prefix: str) -> list[client.Job]:
    return [j for j in client.jobs() if j.name.startswith(prefix) and j.active]


@pytest.mark.parametrize(("option", "value", "says"), [
    ("partition", "no-such-partition", "partition 'no-such-partition' does not exist on this cluster"),
    ("gres", "gpu:h100:1", "partition 'debug' offers no GPU of type 'h100' (offered: rtx3090, rtx5080)"),
    # issue 30 S-4: a count no node can supply, and none at all
    ("gres", "gpu:rtx3090:3", "asks for 3 GPU(s) of type 'rtx3090', but no node of partition 'debug' has more "
                              "than 2"),
    ("gres", "gpu:0", "'gpu:0' asks for no GPU"),
])
def test_an_unknown_partition_or_gpu_type_stops_in_preflight(tag: str, tmp_path: Path, option: str, value: str,
                                                            says: str) -> None:
    matrix = write_matrix(tmp_path, tag, **{option: value})
    proc = subprocess.run(runner_argv(matrix, tmp_path / "results"), capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and f"cards.c.{option}" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not [j for j in client.jobs(all_states=True) if tag in j.name], "preflight must submit nothing"


def test_a_bad_slurm_key_is_one_line_at_load(tmp_path: Path) -> None:
    matrix = write_matrix(tmp_path, "t-load", card_extra='time_limit_typo = 1\n')
    proc = subprocess.run(runner_argv(matrix, tmp_path / "r"), capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    matrix = write_matrix(tmp_path, "t-load", time_limit="soon")
    proc = subprocess.run(runner_argv(matrix, tmp_path / "r"), capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "cards.c.time_limit" in proc.stderr and "soon" in proc.stderr, proc.stderr


def test_a_lane_waiting_on_a_busy_gpu_shows_pending_then_runs_with_the_sidecar_beside_it(
        tag: str, tmp_path: Path) -> None:
    replay = tmp_path / "replay.txt"
    replay.write_text("0 1048576\n0.5 3145728\n1.0 2097152\n")
    blocker = client.sbatch([f"--job-name={tag}-blocker", "--gres=gpu:rtx5080:1", "--output=/dev/null"], HOLD)
    wait_for(lambda: client.job(blocker).state == "RUNNING")
    matrix = write_matrix(tmp_path, tag, card_extra=f'meters = ["sidecar", "server"]\n'
                                                    f'meter_args = ["--fake-replay", "{replay}", "--loop"]\n')
    log = tmp_path / "runner.log"
    proc = start_runner(matrix, tmp_path / "results", log)
    try:
        wait_for(lambda: "pending (Resources)" in log.read_text(), timeout_s=60)
        (job,) = wait_for(lambda: active_jobs(f"runner-{tag}"))
        assert job.pending and job.reason == "Resources"
        time.sleep(2)  # it keeps waiting while the GPU is busy
        assert client.job(job.job_id).pending
        client.scancel(blocker)
        assert proc.wait(timeout=400) == 0, log.read_text()[-3000:]
    finally:
        proc.kill()
    text = log.read_text()
    assert f"Slurm job {job.job_id} running on" in text
    run = run_dir(tmp_path / "results")
    (start,) = session(run)["starts"]
    info = start["info"]
    assert info["slurm_job_id"] == job.job_id and "Resources" in info["pending_reasons"]
    # recorded apart: the start's own time begins after the allocation. The job waited at least the 2 s this
    # test saw it pending; the runner's figure is at least the last moment it saw the job pending itself, which,
    # polling at 0.1 s for the first 5 s and then every POLL_S, is within POLL_S of the start
    assert info["queue_wait_s"] >= 2.0 - backend.POLL_S
    assert start["started_at"] >= info["allocated_at"]
    assert info["cuda_visible_devices"] == "2"  # the rtx5080 is the node's third GPU (scripts/slurm-local.sh)
    assert [s["status"] for s in steps(run)] == ["ok"]
    sidecar = next(m for m in session(run)["meters"] if m["source"] == "sidecar")
    assert sidecar["available"] and sidecar["samples"] > 0, sidecar  # the meter step, polled beside the server
    assert info["gpu"]["uuid"] == "GPU-REPLAY-replay"  # as the sidecar step's source reads it
    (fact,) = json.loads((run / "run.json").read_text())["cards"]["c"]["slurm"]
    assert (fact["job_id"], fact["node"], fact["gpu_uuid"]) == (job.job_id, info["slurm_node"], "GPU-REPLAY-replay")
    assert not active_jobs(f"runner-{tag}"), "the lane releases its allocation"


def test_kill_9_of_the_runner_leaves_no_job(tag: str, tmp_path: Path) -> None:
    matrix = write_matrix(tmp_path, tag, seeds="[1, 2, 3]", references="[1, 2]")
    log = tmp_path / "runner.log"
    proc = start_runner(matrix, tmp_path / "results", log)
    try:
        (job,) = wait_for(lambda: [j for j in active_jobs(f"runner-{tag}") if j.state == "RUNNING"], timeout_s=60)
        wait_for(lambda: any(s.name.startswith("runner-") for s in client.steps(job.job_id)), timeout_s=60)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        t0 = time.monotonic()
        wait_for(lambda: not active_jobs(f"runner-{tag}"), timeout_s=10)
        gone_after = time.monotonic() - t0
    finally:
        proc.kill()
    assert gone_after < 10
    assert client.job(job.job_id).state == "CANCELLED"


def test_scancel_of_the_step_from_outside_is_a_lost_server_and_resume_completes(tag: str, tmp_path: Path) -> None:
    # The scancel lands while a request hangs (request 3: the second step; the first is sent twice, the
    # determinism re-send), never between requests by luck. Two steps: the resume's new server gets two
    # requests, so its own hang@3 never comes.
    matrix = write_matrix(tmp_path, tag, seeds="[1, 2]", flag_args='["--fault", "hang@3"]')
    results = tmp_path / "results"
    log = tmp_path / "runner.log"
    proc = start_runner(matrix, results, log)
    try:
        wait_for(lambda: a_step_is_ok(results), timeout_s=300)
        (job,) = active_jobs(f"runner-{tag}")
        (step,) = [s for s in client.steps(job.job_id) if s.name.startswith("runner-")]
        server_log = run_dir(results) / "c" / "default" / "server.log"
        wait_for(lambda: "fault hang@3" in server_log.read_text(errors="replace"), timeout_s=60)
        client.scancel(step.step_id)
        assert proc.wait(timeout=120) == 1, log.read_text()[-3000:]  # steps left for a resume
    finally:
        proc.kill()
    run = run_dir(results)
    lost = [s for s in steps(run) if s["status"] == "failed"]
    assert lost, log.read_text()[-2000:]
    assert lost[0]["failure"]["kind"] == "cancelled" and lost[0]["lost"] is True
    assert f"STEP {step.step_id}" in lost[0]["failure"]["evidence"][0]
    assert all(s["failure"]["kind"] != "oom" for s in lost)
    assert not active_jobs(f"runner-{tag}")
    resumed = subprocess.run(runner_argv(matrix, results, "--resume", str(run)), capture_output=True, text=True,
                             timeout=400, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    done = steps(run)
    assert len(done) == 2 and all(s["status"] == "ok" for s in done), done  # the lost step was sent again
    jobs = {s["info"]["slurm_job_id"] for s in session(run)["starts"]}
    assert len(jobs) == 2, "the resume continues in a new allocation"
    assert not active_jobs(f"runner-{tag}")


def test_a_job_of_another_alive_run_is_never_cancelled_and_a_dead_ones_is(tag: str) -> None:
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_started = owner.started(dead.pid)
    dead.wait()
    try:
        host, boot = owner.me().host, owner.me().boot
        live_owner = owner.Owner(host, boot, alive.pid, owner.started(alive.pid))
        gone_owner = owner.Owner(host, boot, dead.pid, dead_started)
        other_host = owner.Owner("some-other-login-node", "another-boot", 1, 1.0)
        ids = {}
        for what, who in (("alive", live_owner), ("dead", gone_owner), ("remote", other_host)):
            ids[what] = client.sbatch([f"--job-name={tag}-{what}", f"--comment={backend.owner_comment(tag, what, who)}",
                                       "--output=/dev/null"], HOLD)
        notes = backend.reap()
        assert [n for n in notes if f"Slurm job {ids['dead']} " in n and f"PID {dead.pid}" in n and "is gone" in n]
        assert not [n for n in notes if f"job {ids['alive']} " in n or f"job {ids['remote']} " in n]
        wait_for(lambda: not client.job(ids["dead"]).active)
        time.sleep(1)
        assert client.job(ids["alive"]).active and client.job(ids["remote"]).active
    finally:
        alive.kill()


def _first_served_then(tag: str, tmp_path: Path, act) -> tuple[list[dict], str]:  # type: ignore[no-untyped-def]
    """Run a 4-step lane (no restarts); once a step is served, `act(job)`; the failures recorded, the log.
    The third request hangs (the first step is sent twice: the determinism re-send), so what `act` makes
    Slurm do lands during a request, not after a lane of 0.2 s requests has already ended."""
    matrix = write_matrix(tmp_path, tag, seeds="[1, 2]", references="[1, 2]", flag_args='["--fault", "hang@3"]')
    results, log = tmp_path / "results", tmp_path / "runner.log"
    proc = start_runner(matrix, results, log)
    try:
        wait_for(lambda: a_step_is_ok(results), timeout_s=300)
        (job,) = active_jobs(f"runner-{tag}")
        act(job)
        assert proc.wait(timeout=240) == 1, log.read_text()[-3000:]
    finally:
        proc.kill()
    assert not active_jobs(f"runner-{tag}")
    return [s for s in steps(run_dir(results)) if s["status"] == "failed"], log.read_text()


def test_preemption_is_its_own_failure_class(tag: str, tmp_path: Path) -> None:
    # scripts/slurm-local.sh: a job in partition 'urgent' preempts (cancels) what holds its GPU in 'debug'.
    def preempt(job: client.Job) -> None:
        client.sbatch([f"--job-name={tag}-urgent", "--partition=urgent", "--gres=gpu:rtx5080:1",
                       "--output=/dev/null"], "#!/bin/sh\nsleep 3\n")

    failed, _ = _first_served_then(tag, tmp_path, preempt)
    assert failed and failed[0]["failure"]["kind"] == "preempted" and failed[0]["lost"], failed
    assert "DUE TO PREEMPTION" in failed[0]["failure"]["evidence"][0]


def test_a_node_failure_is_its_own_failure_class(tag: str, tmp_path: Path) -> None:
    node = client.nodes()[0].name

    def fail_node(job: client.Job) -> None:
        client.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=runner-test"])

    try:
        failed, _ = _first_served_then(tag, tmp_path, fail_node)
    finally:
        with contextlib.suppress(client.SlurmError):  # ReturnToService=2 may have brought it back already
            client.run(["scontrol", "update", f"nodename={node}", "state=resume"])
        wait_for(lambda: client.nodes()[0].state in ("idle", "mixed", "allocated"))
    assert failed and failed[0]["failure"]["kind"] == "node_failure" and failed[0]["lost"], failed


def _hung_request_ended_then_resumed(tag: str, tmp_path: Path, end, **matrix) -> tuple[dict, str]:  # type: ignore[no-untyped-def]
    """Two steps; the second one's request hangs (request 3: the first step is sent twice, the determinism
    re-send) and `end(job, step)` makes the scheduler end it while it hangs. The run exits 1 with the step
    recorded lost; `--resume` (a new allocation, a new server: its request 3 never comes) sends that step
    and exits 0. Returns the lost record and the resume's output."""
    path = write_matrix(tmp_path, tag, seeds="[1, 2]", flag_args='["--fault", "hang@3"]', **matrix)
    results, log = tmp_path / "results", tmp_path / "runner.log"
    proc = start_runner(path, results, log)
    try:
        wait_for(lambda: a_step_is_ok(results), timeout_s=300)
        (job,) = active_jobs(f"runner-{tag}")
        (step,) = [s for s in client.steps(job.job_id) if s.name.startswith("runner-")]
        end(job, step)
        assert proc.wait(timeout=240) == 1, log.read_text()[-3000:]
    finally:
        proc.kill()
    run = run_dir(results)
    (lost,) = [s for s in steps(run) if s["status"] == "failed"]
    assert lost["lost"] is True, lost
    resumed = subprocess.run(runner_argv(path, results, "--resume", str(run)), capture_output=True, text=True,
                             timeout=400, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "nothing left to send" not in resumed.stdout + resumed.stderr
    done = {s["key"]: s for s in steps(run)}
    assert len(done) == 2 and all(s["status"] == "ok" for s in done.values()), done
    (verdict,) = json.loads((run / "verdict.json").read_text())["verdicts"]
    assert verdict["world"] == "fits-resident", verdict
    assert not active_jobs(f"runner-{tag}")
    return lost, resumed.stdout + resumed.stderr


def test_a_step_cancelled_during_its_request_is_sent_again_by_resume(tag: str, tmp_path: Path) -> None:
    # issue 30 S-1: the scancel lands while the request hangs, never after it
    def cancel_step(job: client.Job, step: client.Step) -> None:
        log = run_dir(tmp_path / "results") / "c" / "default" / "server.log"
        wait_for(lambda: "fault hang@3" in log.read_text(errors="replace"), timeout_s=60)
        client.scancel(step.step_id)

    lost, _ = _hung_request_ended_then_resumed(tag, tmp_path, cancel_step)
    assert lost["failure"]["kind"] == "cancelled", lost


@pytest.mark.slow
def test_a_step_ended_by_the_time_limit_is_sent_again_by_resume(tag: str, tmp_path: Path) -> None:
    # A two-minute allocation (one would not leave a loaded machine time for the first step); the second request
    # hangs until Slurm ends the job.
    def wait(job: client.Job, step: client.Step) -> None:
        pass

    # The time limit is its own failure class, with slurmstepd's words as the evidence; this trial is the
    # suite's only wait on Slurm's time limit (at least a minute, checked every ~30 s): one trial, not two.
    lost, _ = _hung_request_ended_then_resumed(tag, tmp_path, wait, time_limit="2", request_timeout_s=400)
    assert lost["failure"]["kind"] == "time_limit", lost
    assert "DUE TO TIME LIMIT" in lost["failure"]["evidence"][0], lost


def test_a_submission_sbatch_refuses_is_recorded_as_refused(tag: str, tmp_path: Path) -> None:
    # issue 30 S-4: what preflight cannot see (here: more memory than the node has) is the scheduler's refusal,
    # not a server that exited while loading
    matrix = write_matrix(tmp_path, tag, card_extra='sbatch_args = ["--mem=99999999"]\n')
    proc = subprocess.run(runner_argv(matrix, tmp_path / "results"), capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (start,) = session(run_dir(tmp_path / "results"))["starts"]
    assert start["failure"]["kind"] == "refused", start
    assert start["failure"]["message"].startswith("sbatch refused the allocation: "), start


LOSES_FIRST_PORT = """\
import os, socket, sys
port, marker, command = int(sys.argv[1]), sys.argv[2], sys.argv[4:]
if not os.path.exists(marker):  # the first step: another socket takes the step's port before the server binds
    open(marker, "w").close()
    other = socket.create_server(("", port))
    socket.create_server(("", port))  # OSError: [Errno 98] Address already in use, as a server's bind would
os.execv(command[0], command)
"""


def test_a_step_whose_port_was_taken_is_started_again_in_the_same_allocation(tag: str, tmp_path: Path) -> None:
    """The step picks a free port on the node; another process binds it first. That is not the server's load
    failure: the runner starts a new step (a new port) in the same allocation and the session is measured."""
    wrapper = tmp_path / "loses_first_port.py"
    wrapper.write_text(LOSES_FIRST_PORT)
    path = write_matrix(tmp_path, tag)
    text = path.read_text()
    path.write_text(text.replace('command = ["{python}", "-m"',
                                 f'command = ["{{python}}", "{wrapper}", "{{port}}", "{tmp_path / "lost"}", "--", '
                                 f'"{{python}}", "-m"', 1))
    proc = subprocess.run(runner_argv(path, tmp_path / "results"), capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    record = session(run_dir(tmp_path / "results"))
    (start,) = record["starts"]
    assert start["failure"] is None and start["ready_s"] is not None, start
    (lost,) = start["info"]["ports_lost"]
    assert "was taken before the server listened on it" in lost and "Address already in use" in lost, lost
    assert any("started again on another port" in note for note in record["notes"]), record["notes"]
    assert all(s["status"] == "ok" for s in steps(run_dir(tmp_path / "results")))
