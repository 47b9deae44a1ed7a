"""The Slurm commands the runner uses, run as subprocesses with a deadline; their output read by
`runner.slurm.parse`. Every failure is a `SlurmError` with one line (the command's own error line)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from runner.slurm import parse
from runner.slurm.parse import Job, Node, Step

TIMEOUT_S = 30.0
COMMANDS = ("sbatch", "srun", "squeue", "scancel", "scontrol", "sinfo")
# A controller that restarts (or fails over) does not answer for about a minute: a query waits that out,
# asking again every OUTAGE_POLL_S, for at most OUTAGE_S; then the error stands.
OUTAGE_S, OUTAGE_POLL_S = 120.0, 2.0
OUTAGE = re.compile(r"contact slurm controller|connect(ion)? (failure|refused)|timed out|zero bytes were transmitted"
                    r"|no answer within|slurmctld.*(down|not responding)", re.IGNORECASE)
# What configures the client (which slurm.conf, which clusters) is the user's and stays; what describes a
# surrounding job (SLURM_JOB_ID, SLURM_NTASKS, …) and the commands' own input options go.
CLIENT_CONFIG = frozenset({"SLURM_CONF", "SLURM_CLUSTERS"})
JOB_CONTEXT = ("SLURM_", "SQUEUE_", "SBATCH_", "SRUN_")
T = TypeVar("T")


class SlurmError(RuntimeError):
    """A Slurm command failed or could not be run; the message is one line."""


def missing_commands() -> list[str]:
    """The Slurm client commands not on PATH (a machine without Slurm has all of them missing)."""
    return [c for c in COMMANDS if shutil.which(c) is None]


def without_job_context(env: Mapping[str, str]) -> dict[str, str]:
    """An environment without a surrounding job's variables (a runner started inside an allocation would
    otherwise submit into it, or read its output format settings), the client's configuration kept."""
    return {k: v for k, v in env.items() if k in CLIENT_CONFIG or not k.startswith(JOB_CONTEXT)}


def _env() -> dict[str, str]:
    return without_job_context(os.environ)


def run(argv: Sequence[str], *, timeout_s: float = TIMEOUT_S, stdin: str | None = None) -> str:
    """Run one Slurm command; its stdout, or SlurmError with its last stderr line."""
    try:
        done = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=timeout_s,
                              env=_env(), errors="replace")
    except FileNotFoundError:
        raise SlurmError(f"{argv[0]}: not found (is Slurm's client installed on this host?)") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{argv[0]}: no answer within {timeout_s:.0f} s") from None
    if done.returncode != 0:
        # the last line that says something: scontrol's "*****…" banner around "RESTORE SLURMCTLD" says nothing
        lines = [ln.strip() for ln in (done.stderr or done.stdout).splitlines()
                 if any(c.isalnum() for c in ln) and "RESTORE SLURMCTLD" not in ln]
        raise SlurmError((lines[-1] if lines else f"{argv[0]} exited with {done.returncode}")[:300])
    return done.stdout[:8_000_000]


def _query(argv: Sequence[str], read: Callable[[str], T]) -> T:
    """A read-only command and its output read, asked again while the controller does not answer (an
    `errors` array from `--json`, a connect failure) for at most OUTAGE_S; every failure a SlurmError."""
    deadline = time.monotonic() + OUTAGE_S
    while True:
        try:
            return read(run(argv))
        except parse.SlurmParseError as exc:
            error = SlurmError(str(exc)[:300])
        except SlurmError as exc:
            error = exc
        if not OUTAGE.search(str(error)):
            raise error
        if time.monotonic() >= deadline:
            raise SlurmError(f"{error} (the controller did not answer for {OUTAGE_S:.0f} s)") from None
        time.sleep(OUTAGE_POLL_S)


def ping(timeout_s: float = 10.0) -> None:
    """Raises SlurmError unless the controller answers."""
    try:
        out = run(["scontrol", "ping"], timeout_s=timeout_s)
    except SlurmError as exc:
        raise SlurmError(f"the Slurm controller does not answer: {exc}") from None
    if not parse.controller_up(out):
        raise SlurmError(f"the Slurm controller does not answer: {out.strip().splitlines()[0][:200]}")


def nodes() -> list[Node]:
    return _query(["sinfo", "--json"], parse.nodes_from_sinfo_json)


def partition(name: str) -> dict[str, str] | None:
    """A partition's fields, or None when the controller has no partition of that name."""
    try:
        out = run(["scontrol", "show", "-o", "partition", name])
    except SlurmError as exc:
        if "not found" in str(exc):
            return None
        raise
    return parse.key_values(out.strip().splitlines()[0]) if out.strip() else None


def sbatch(args: Sequence[str], script: str) -> int:
    """Submit a batch script (on stdin); the job id. Returns at once: the job may still be pending."""
    return parse.job_id_from_sbatch(run(["sbatch", "--parsable", *args], stdin=script))


def jobs(*, job_ids: Sequence[int] = (), name: str | None = None, user: str | None = None,
         all_states: bool = False) -> list[Job]:
    """Jobs the controller still knows (finished ones for MinJobAge seconds too, with `all_states`)."""
    argv = ["squeue", "--json"]
    if job_ids:
        argv += ["--jobs", ",".join(str(j) for j in job_ids)]
    if name:
        argv += ["--name", name]
    if user:
        argv += ["--user", user]
    if all_states:
        argv += ["--states", "all"]
    try:
        return _query(argv, parse.jobs_from_squeue_json)
    except SlurmError as exc:
        if job_ids and "Invalid job id" in str(exc):
            return []  # purged from the controller's memory: long finished
        raise


def job(job_id: int) -> Job | None:
    found = [j for j in jobs(job_ids=[job_id], all_states=True) if j.job_id == job_id]
    return found[0] if found else None


def steps(job_id: int) -> list[Step]:
    return _query(["squeue", "-s", "-h", "-j", str(job_id), "-o", "%i|%j|%N"], parse.steps_from_squeue)


def scancel(target: str | int, *, signal: str | None = None, quiet: bool = True) -> None:
    """Cancel a job ("12") or a step ("12.3"); a job that is already gone is not an error."""
    argv = ["scancel", *(["--quiet"] if quiet else []), *([f"--signal={signal}"] if signal else []), str(target)]
    try:
        run(argv)
    except SlurmError as exc:
        if "Invalid job id" not in str(exc) and "already completing" not in str(exc):
            raise


def srun_argv(job_id: int, *, name: str, output: str, command: Sequence[str],
              extra: Sequence[str] = ()) -> list[str]:
    """A step in an existing allocation: it shares the allocation's GPU with the other steps (--overlap),
    one task on one node, its stdout and stderr into one file (the server log)."""
    return ["srun", f"--jobid={job_id}", "--overlap", "--nodes=1", "--ntasks=1", f"--job-name={name}",
            f"--output={output}", f"--error={output}", "--kill-on-bad-exit=1", *extra, *command]


def sacct(job_ids: Sequence[int]) -> list[dict[str, str]] | None:
    """Finished jobs from accounting; None when the cluster keeps no accounting (no slurmdbd)."""
    argv = ["sacct", "-P", "-n", "-o", "JobID,JobName,State,Start,End,NodeList,Reason",
            "-j", ",".join(str(j) for j in job_ids)]
    try:
        out = run(argv)
    except SlurmError as exc:
        if parse.accounting_disabled(str(exc)):
            return None
        raise
    if parse.accounting_disabled(out):
        return None
    return parse.jobs_from_sacct(out)
