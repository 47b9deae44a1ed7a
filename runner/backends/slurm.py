"""The slurm backend: a card's servers run as job steps in one allocation per lane.

- **One allocation per lane** (`lane`, entered by the executor around a lane's sessions): the first session
  of a card submits a holding batch job (`sbatch`, the card's partition/gres/account/qos/time/constraint)
  and waits while it is pending, telling the progress display the pending reason; every flag set of the card
  then runs on the same GPU of the same node. The lane cancels its allocations when it ends.
- **A session is a job step** (`srun --jobid --overlap`): `runner.slurm.step` picks the port on the node and
  becomes the server; the step's output file (on the shared filesystem) is the server log. Stopped by
  cancelling the step; the allocation stays for the next session.
- **The sidecar** (`runner meter`) is a step beside the servers, once per allocation, when the card lists
  the `sidecar` meter; its /info gives the GPU's UUID and name as NVML reads them on the node.
- **Ownership**: the job's name and comment carry the run id, the runner's host, PID and start time;
  `reap` cancels only jobs whose runner is provably gone (same host, PID not running with that start time).
  `runner.slurm.lifeline` cancels this runner's allocations when it dies, `kill -9` included.
- **The scheduler's own ends** (scancel, preemption, time limit, node failure) are found by
  runner.observe.failures in slurmstepd's line in the step log and recorded as their own classes, never as OOM; a
  lost allocation is replaced by a new one at the next start (and `--resume` always submits new ones).

Time in the queue is recorded in each start's `info` (`queue_wait_s`), apart from the measured times.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.backends import owner
from runner.backends.base import Attempt, ExitInfo, RunningServer, StartFailed
from runner.core.errors import UserError
from runner.core.records import Failure, FailureClass
from runner.core.registry import SlurmOptions
from runner.core.secrets import resolve_env
from runner.observe import bounded, quote
from runner.observe.failures import CLUSTER_CLASS, START_LOG_BYTES
from runner.observe.quote import LIMIT as QUOTE_LIMIT
from runner.observe.scheduler import cluster_end
from runner.plan.lanes import Plan, ServerPlan
from runner.plan.matrix import Matrix
from runner.slurm import client, parse
from runner.slurm.client import SlurmError

COMMENT = "runner:"  # the comment of every job this backend submits starts with it
POLL_S = 1.0  # how often a pending allocation is asked about
WHERE_S = 120.0  # a step has this long to start on its node and say which port it took
STEP_STOP_S = 20.0  # a cancelled step's srun is given this long to exit (Slurm's KillWait and a margin)
HOLD_SCRIPT = "#!/bin/sh\n# runner: holds the lane's allocation; the servers are job steps in it\nexec sleep infinity\n"


# --- ownership -------------------------------------------------------------------------------------------


def owner_comment(run_id: str, card: str, me: owner.Owner | None = None) -> str:
    who = me or owner.me()
    return (f"{COMMENT}run={run_id};card={card};host={who.host};boot={who.boot};pid={who.pid};"
            f"since_boot={who.started:.2f}")


def owner_labels(comment: str) -> dict[str, str] | None:
    """A job comment this backend wrote → owner labels (as owner.owner_state reads them); None otherwise."""
    if not comment.startswith(COMMENT):
        return None
    fields = dict(kv.split("=", 1) for kv in comment[len(COMMENT):].split(";") if "=" in kv)
    return {owner.HOST: fields.get("host", ""), owner.BOOT: fields.get("boot", ""), owner.PID: fields.get("pid", ""),
            owner.STARTED: fields.get("since_boot", ""), "run": fields.get("run", ""), "card": fields.get("card", "")}


def _me_user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def reap(options: object = ()) -> list[str]:
    """The registry's cleanup before a run: this user's runner jobs whose runner is provably gone are
    cancelled, each with its reason; a live runner's (or one on another host) are kept."""
    if client.missing_commands():
        return []
    notes = []
    try:
        jobs = client.jobs(user=_me_user())
    except SlurmError as exc:
        return [f"slurm: could not list jobs to clean up ({exc})"]
    for job in jobs:
        labels = owner_labels(job.comment)
        if labels is None or not job.active:
            continue
        dead, why = owner.owner_state(labels)
        if dead:
            try:
                client.scancel(job.job_id)
                notes.append(f"cancelled Slurm job {job.job_id} ({job.name}, {job.state.lower()}): {why}")
            except SlurmError as exc:
                notes.append(f"could not cancel Slurm job {job.job_id} ({job.name}): {exc}")
    return notes


# --- the lifeline: this runner's allocations end with it ---------------------------------------------------


class _Lifeline:
    """One `runner.slurm.lifeline` per runner process, told about every allocation held."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None

    def _send(self, line: str) -> None:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                # Its own session: a Ctrl-C or a signal to the runner's group does not reach it; stdin is
                # the pipe only this process holds (close_fds keeps it out of every other child).
                self._proc = subprocess.Popen([sys.executable, "-m", "runner.slurm.lifeline"], stdin=subprocess.PIPE,
                                              stdout=subprocess.DEVNULL, text=True, start_new_session=True)
            assert self._proc.stdin is not None
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()

    def hold(self, job_id: int) -> None:
        self._send(f"+{job_id}")

    def release(self, job_id: int) -> None:
        self._send(f"-{job_id}")


LIFELINE = _Lifeline()


# --- allocations and lanes -------------------------------------------------------------------------------


@dataclass
class MeterStep:
    """`runner meter` as a step of the allocation (when the card lists the sidecar meter)."""

    proc: subprocess.Popen[bytes]
    log: Path
    where: Path
    url: str | None = None
    problem: str | None = None


@dataclass
class Allocation:
    job_id: int
    card: str
    options: SlurmOptions
    submitted_at: float
    allocated_at: float
    node: str
    address: str
    reasons: tuple[str, ...]  # the pending reasons seen while it waited, in order
    log: Path
    sessions: int = 0  # server starts in it so far
    meter: MeterStep | None = None

    @property
    def queue_wait_s(self) -> float:
        return round(self.allocated_at - self.submitted_at, 3)


def _gone(job: parse.Job | None) -> bool:
    return job is None or not job.active


class SlurmLane:
    """What one lane holds: an allocation per card (its flag sets run one after another in it)."""

    def __init__(self, name: str, run_id: str, events: Any = None, stop: threading.Event | None = None,
                 meters_of: dict[str, tuple[str, ...]] | None = None) -> None:
        self.name, self.run_id, self.events = name, run_id, events
        self.stop = stop or threading.Event()
        self.meters_of = meters_of or {}
        self.allocations: dict[str, Allocation] = {}

    def _say(self, card: str, text: str) -> None:
        waiting = getattr(self.events, "waiting", None)
        if waiting is not None:
            waiting(card, text)

    def allocation(self, card: str, options: SlurmOptions, folder: Path) -> Allocation:
        """The card's allocation, submitted (and waited for) when it has none or lost it."""
        held = self.allocations.get(card)
        if held is not None:
            try:
                job = client.job(held.job_id)
            except SlurmError as exc:  # the controller stayed away past client.OUTAGE_S: give the job back
                self._release(held)
                del self.allocations[card]
                raise StartFailed(Failure(kind=FailureClass.LOAD_EXIT, message=f"could not ask Slurm about job "
                                          f"{held.job_id} ({exc}); the allocation is released")) from None
            if not _gone(job) and job is not None and job.state == "RUNNING":
                return held
            self._release(held)
        alloc = self._submit(card, options, folder)
        self.allocations[card] = alloc
        return alloc

    def _submit(self, card: str, options: SlurmOptions, folder: Path) -> Allocation:
        folder.mkdir(parents=True, exist_ok=True)
        name = f"runner-{self.run_id}-{card}"
        args = [f"--job-name={name}", f"--comment={owner_comment(self.run_id, card)}",
                f"--partition={options.partition}", f"--gres={options.gres_request}", "--nodes=1", "--ntasks=1",
                "--no-requeue", f"--output={folder}/slurm-%j.log", f"--chdir={folder}"]
        for flag, value in (("--account", options.account), ("--qos", options.qos),
                            ("--time", options.time_limit), ("--constraint", options.constraint)):
            if value:
                args.append(f"{flag}={value}")
        submitted = time.time()
        try:
            job_id = client.sbatch([*args, *options.sbatch_args], HOLD_SCRIPT)
        except SlurmError as exc:
            raise StartFailed(Failure(kind=FailureClass.REFUSED,
                                      message=f"sbatch refused the allocation: {exc}")) from None
        LIFELINE.hold(job_id)
        reasons: list[str] = []
        seen_pending = submitted  # the last moment the runner itself saw the job wait
        while True:
            try:
                job = client.job(job_id)
            except SlurmError as exc:
                job, problem = None, str(exc)
            else:
                problem = "the controller no longer knows the job"
            if job is not None and job.state == "RUNNING":
                break
            if job is not None and job.pending:
                seen_pending = time.time()
            if job is None or not job.active:
                self._cancel(job_id)
                why = f"{job.state.lower()} ({job.reason})" if job else problem
                kind = CLUSTER_CLASS.get(parse.ENDED_BY_CLUSTER.get(job.state, "") if job else "",
                                         FailureClass.CANCELLED if job and job.state == "CANCELLED"
                                         else FailureClass.LOAD_EXIT)
                raise StartFailed(Failure(kind=kind, message=f"Slurm job {job_id} ended before it ran: {why}"))
            if self.stop.is_set():
                self._cancel(job_id)
                raise StartFailed(Failure(kind=FailureClass.LOAD_EXIT,
                                          message="run interrupted while waiting in the queue"))
            if job.reason != "None" and (not reasons or reasons[-1] != job.reason):
                reasons.append(job.reason)
                self._say(card, f"queued as Slurm job {job_id}: pending ({job.reason})")
            # Often granted within a second: asked quickly at first, then every POLL_S (a queue may take hours).
            time.sleep(0.1 if time.time() - submitted < 5 else POLL_S)
        # Slurm's start time is in whole seconds, so it can fall up to a second before a moment the runner saw
        # the job still pending: the later of the two (a clean-clone run recorded 1.39 s for a 2 s wait)
        allocated = job.start_time if job.start_time and job.start_time <= time.time() + 1 else time.time()
        allocated = max(allocated, seen_pending)
        node = job.nodes.split(",")[0]
        try:
            address = next((n.address for n in client.nodes() if n.name == node), node)
        except SlurmError as exc:  # granted, then the controller went away: the job is not left held to exit
            self._cancel(job_id)
            raise StartFailed(Failure(kind=FailureClass.LOAD_EXIT, message=f"could not ask Slurm about node {node} "
                                      f"of job {job_id} ({exc}); the allocation is released")) from None
        alloc = Allocation(job_id, card, options, submitted, max(allocated, submitted), node, address,
                           tuple(reasons), folder / f"slurm-{job_id}.log")
        self._say(card, f"Slurm job {job_id} running on {node} after {alloc.queue_wait_s:.1f} s in the queue")
        if "sidecar" in self.meters_of.get(card, ()):
            alloc.meter = _start_meter(alloc, folder)
        return alloc

    def _cancel(self, job_id: int) -> None:
        try:
            client.scancel(job_id)
        except SlurmError:
            return  # the lifeline keeps it: cancelled when this runner exits, if not before
        LIFELINE.release(job_id)

    def _release(self, alloc: Allocation) -> None:
        if alloc.meter is not None:
            _stop_step(alloc.meter.proc, alloc.meter.where, alloc.job_id)
        self._cancel(alloc.job_id)

    def release_all(self) -> None:
        for alloc in self.allocations.values():
            self._release(alloc)
        self.allocations.clear()


_current = threading.local()


@contextlib.contextmanager
def lane(plan_lane: Any, ctx: Any) -> Iterator[SlurmLane]:
    """The registry's lane scope: the executor enters it around a lane's sessions (in the lane's thread)."""
    meters = {name: tuple(ctx.matrix.cards[name].meters) for name in plan_lane.cards}
    held = SlurmLane(plan_lane.name, ctx.run_id, ctx.events, ctx.stop, meters)
    _current.lane = held
    try:
        yield held
    finally:
        _current.lane = None
        held.release_all()


# --- steps -----------------------------------------------------------------------------------------------


def _step_env(extra: dict[str, str]) -> dict[str, str]:
    # The step gets the runner's environment (srun's default --export=ALL) with the server's own on top; the
    # GPU is Slurm's to choose (gres), never a leftover CUDA_VISIBLE_DEVICES of the runner's host.
    env = {k: v for k, v in client.without_job_context(os.environ).items() if k != "CUDA_VISIBLE_DEVICES"}
    return {**env, **extra}


def _launch(alloc: Allocation, *, name: str, log: Path, where: Path, command: list[str],
            env: dict[str, str]) -> subprocess.Popen[bytes]:
    python = alloc.options.python or sys.executable
    where.unlink(missing_ok=True)
    argv = client.srun_argv(alloc.job_id, name=name, output=str(log),
                            command=[python, "-m", "runner.slurm.step", "--port-file", str(where), "--", *command],
                            extra=("--open-mode=append", *alloc.options.srun_args))
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        # srun's own messages ("step aborted", "task 0: Killed") go to the same log, after the server's.
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=_step_env(env), start_new_session=True)


def _read_where(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text()[:4096])
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("port"), int) else None


def _stop_step(proc: subprocess.Popen[bytes], where: Path, job_id: int) -> None:
    """Cancel the step (Slurm signals every process of it on the node), then wait for its srun."""
    if proc.poll() is None:
        doc = _read_where(where)
        step = doc.get("step_id") if doc else None
        with contextlib.suppress(SlurmError):
            if step is not None:
                client.scancel(f"{job_id}.{step}")
            else:
                proc.terminate()  # srun forwards it to the step and cancels it
        try:
            proc.wait(STEP_STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _start_meter(alloc: Allocation, folder: Path) -> MeterStep:
    log, where = folder / f"meter-{alloc.job_id}.log", folder / f"meter-{alloc.job_id}.where.json"
    python = alloc.options.python or sys.executable
    # The step's GPU as Slurm gave it (CUDA_VISIBLE_DEVICES, filled in on the node): the meter reads that one.
    command = [python, "-m", "runner", "meter", "--host", "0.0.0.0", "--port", "{port}", "--gpu", "{gpu}",
               *alloc.options.meter_args]
    proc = _launch(alloc, name="runner-meter", log=log, where=where, command=command, env={})
    meter = MeterStep(proc, log, where)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        doc = _read_where(where)
        if doc is not None and "serving" in _tail(log):
            meter.url = f"http://{alloc.address}:{doc['port']}"
            return meter
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    lines = [ln for ln in _tail(log).splitlines() if ln.startswith("runner meter")]
    meter.problem = (lines[-1] if lines else "the meter step did not start")[:300]
    return meter


def _tail(path: Path, size: int = 8192) -> str:
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - size))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


class SlurmServer(RunningServer):
    """One server start: a job step in the lane's allocation for this card. The allocation is obtained when
    the start is created (before its meters exist, so the sidecar step is there for them, and outside the
    measured start time); a failure to allocate surfaces as the start's failure."""

    def __init__(self, plan: ServerPlan, attempt: Attempt) -> None:
        super().__init__(plan, attempt)
        assert isinstance(plan.options, SlurmOptions), "the registry pairs slurm with SlurmOptions"
        self.options: SlurmOptions = plan.options
        self.card = plan.labels.get("runner.card", attempt.name)
        self.proc: subprocess.Popen[bytes] | None = None
        self.where_path = attempt.log_path.with_name(attempt.log_path.stem + ".where.json")
        self.where: dict[str, Any] | None = None
        self.problem: Failure | None = None
        self.first_in_allocation = False
        self._stopped_at: int | None = None  # log size when this runner cancelled the step itself
        self._gpu: dict[str, str] | None = None
        self._own_lane: SlurmLane | None = None
        lane_ = getattr(_current, "lane", None)
        if lane_ is None:  # used outside a lane (a test, a one-off start): its own, released at stop
            lane_ = self._own_lane = SlurmLane(attempt.name, attempt.labels.get("runner.run", "adhoc"))
        self.alloc: Allocation | None = None
        try:
            self.alloc = lane_.allocation(self.card, self.options, attempt.log_path.parent.parent)
        except StartFailed as exc:
            self.problem = exc.failure
        except SlurmError as exc:
            self.problem = Failure(kind=FailureClass.LOAD_EXIT, message=f"slurm: {exc}")
        if self.alloc is not None:
            self.first_in_allocation = self.alloc.sessions == 0
            self.alloc.sessions += 1

    @property
    def sidecar_url(self) -> str | None:
        return self.alloc.meter.url if self.alloc and self.alloc.meter else None

    def meter_url(self, meter: str) -> tuple[str | None, str | None]:
        if meter != "sidecar":
            return None, None
        if self.alloc is None or self.alloc.meter is None:
            return None, "no allocation, so no sidecar step" if self.alloc is None else "no sidecar step"
        return self.alloc.meter.url, self.alloc.meter.problem

    @property
    def base_url(self) -> str:
        host = self.alloc.address if self.alloc else "127.0.0.1"
        return f"http://{host}:{self.port or 0}"

    def read_log(self, start: int = 0, end: int | None = None, limit: int = QUOTE_LIMIT) -> str:
        # A request sent after the scheduler ended the step (between two requests) has only a refused
        # connection in its window: the scheduler's line, written before it, is what explains it.
        text = super().read_log(start, end, limit)
        if start > 0 and self.proc is not None and self.proc.poll() is not None and cluster_end(text) is None:
            before = cluster_end(super().read_log(max(0, start - 16_384), start))
            if before is not None and self._stopped_at is None:
                text = f"{before.line}\n{text}"
        return text

    def log_tail(self, size: int = START_LOG_BYTES) -> str:
        # A step this runner cancelled (ready timeout, end of session) ends with slurmstepd's CANCELLED line
        # too: that one is ours, not the scheduler's, so the classifier sees the log as it was before it.
        end = self._stopped_at if self._stopped_at is not None else self.log_size()
        return self.read_log(max(0, end - size), end, limit=size)

    def start(self) -> None:
        if self.problem is not None:
            raise StartFailed(self.problem)
        assert self.alloc is not None
        self.where, self.port, self._stopped_at = None, None, None  # a new try is a new step
        env = resolve_env(self.plan.env, os.environ)
        self.proc = _launch(self.alloc, name=self.name, log=self.log_path, where=self.where_path,
                            command=list(self.plan.argv), env=env)
        # The port is known once the step wrote where it is (it runs on the node within a second or two);
        # the readiness probes need it. A step that exits first is the start's failure (wait_ready says why).
        deadline = time.monotonic() + WHERE_S
        while self.where is None and self.proc.poll() is None and time.monotonic() < deadline:
            self.where = _read_where(self.where_path)
            if self.where is None:
                time.sleep(0.1)
        if self.where is not None:
            self.port = int(self.where["port"])

    def foreign_answer(self) -> str | None:
        # The port was the node's free one when the step took it; the step must be ours and this start's.
        if self.where is None or self.alloc is None:
            return None
        if str(self.where.get("job_id")) != str(self.alloc.job_id):
            return f"the port file names job {self.where.get('job_id')}, not this allocation's {self.alloc.job_id}"
        return None

    def exited(self) -> ExitInfo | None:
        if self.proc is None:
            return ExitInfo(None)
        code = self.proc.poll()
        return None if code is None else ExitInfo(code)

    @property
    def port_picked(self) -> bool:
        return True  # by the step on the node, a moment before the server binds it

    def end_try(self) -> None:
        if self.proc is not None and self.alloc is not None:
            if self.proc.poll() is None and self._stopped_at is None:
                self._stopped_at = self.log_size()
            _stop_step(self.proc, self.where_path, self.alloc.job_id)

    def stop(self) -> None:
        self.end_try()
        if self._own_lane is not None:
            self._own_lane.release_all()

    def info(self) -> dict[str, Any]:
        a = self.alloc
        if a is None:
            return {"slurm": None}
        w = self.where or {}
        return {"slurm_job_id": a.job_id, "slurm_step_id": w.get("step_id"), "slurm_node": a.node,
                "node_address": a.address, "partition": a.options.partition, "gres": a.options.gres_request,
                "queue_wait_s": a.queue_wait_s if self.first_in_allocation else 0.0,
                "allocation_queue_wait_s": a.queue_wait_s, "pending_reasons": list(a.reasons),
                "submitted_at": a.submitted_at, "allocated_at": a.allocated_at,
                "cuda_visible_devices": w.get("cuda_visible_devices"), "port": w.get("port"),
                "argv": list(self.plan.argv), "sidecar_url": self.sidecar_url, "gpu": self._sidecar_gpu()}

    def _sidecar_gpu(self) -> dict[str, Any] | None:
        """The GPU as the sidecar step's NVML reads it on the node (UUID, name), when there is one."""
        url = self.sidecar_url
        if url is None:
            return None
        if self._gpu is None:
            import httpx

            try:
                with bounded.client() as client:  # what a node's sidecar sends is bounded like any answer
                    doc = bounded.exchange(client, "GET", f"{url}/info", deadline_s=3.0, max_bytes=64 * 1024).json()
                gpu = doc.get("gpu") if isinstance(doc, dict) else None
                self._gpu = {k: quote.console(str(gpu.get(k)))[:200] for k in ("index", "uuid", "name", "driver")
                             if gpu.get(k) is not None} if isinstance(gpu, dict) else {}
            except (httpx.HTTPError, bounded.Overdue, bounded.TooLarge, ValueError):
                return None
        return self._gpu or None


# --- preflight -------------------------------------------------------------------------------------------


def preflight(matrix: Matrix, plan: Plan) -> None:
    """Before anything is submitted: the commands exist, the controller answers, each slurm card's partition
    exists and offers its GPU type, and no slurm server has a fixed port. One line, exit 2, otherwise."""
    cards = dict.fromkeys(s.card for s in plan.sessions if s.server is not None and s.server.backend == "slurm")
    if not cards:
        return
    missing = client.missing_commands()
    if missing:
        raise UserError(f"{matrix.path}: backend 'slurm': the Slurm commands {', '.join(missing)} are not on PATH "
                        f"here (run the runner on a login node of the cluster)")
    try:
        client.ping()
        nodes = client.nodes()
    except SlurmError as exc:
        raise UserError(f"{matrix.path}: backend 'slurm': {exc}") from None
    for name in cards:
        card = matrix.cards[name]
        options = card.options
        assert isinstance(options, SlurmOptions)
        port = matrix.servers[card.server].port
        if port:
            raise UserError(f"{matrix.path}: key 'servers.{card.server}.port' is fixed ({port}) but card "
                            f"'{name}' runs under slurm, where the port is chosen on the node: use port = 0")
        try:
            part = client.partition(options.partition)
        except SlurmError as exc:
            raise UserError(f"{matrix.path}: key 'cards.{name}.partition': {exc}") from None
        if part is None:
            known = sorted({p for n in nodes for p in n.partitions})
            raise UserError(f"{matrix.path}: key 'cards.{name}.partition': partition '{options.partition}' does "
                            f"not exist on this cluster (known: {', '.join(known) or 'none'})")
        members = [n for n in nodes if options.partition in n.partitions]
        wanted = parse.requested_gpu_type(options.gres_request)
        offered = set().union(*(parse.gres_types(n.gres) for n in members)) if members else set()
        has_gpus = any(g.split(":")[0] == "gpu" for n in members for g in n.gres)
        if wanted is not None and wanted not in offered:
            raise UserError(f"{matrix.path}: key 'cards.{name}.gres': partition '{options.partition}' offers no "
                            f"GPU of type '{wanted}' (offered: {', '.join(sorted(offered)) or 'none'})")
        if wanted is None and not has_gpus:
            raise UserError(f"{matrix.path}: key 'cards.{name}.gres': partition '{options.partition}' has no "
                            f"GPU GRES on any node")
        count = parse.requested_gpu_count(options.gres_request)
        most = max((parse.gpus_offered(n.gres, wanted) for n in members), default=0)
        what = f"GPU(s) of type '{wanted}'" if wanted else "GPU(s)"
        if count is None or count < 1:
            raise UserError(f"{matrix.path}: key 'cards.{name}.gres': '{options.gres}' asks for no GPU: a server "
                            "needs at least one (e.g. gpu:1)")
        if count > most:  # one node per allocation: the count must fit on one node
            raise UserError(f"{matrix.path}: key 'cards.{name}.gres': '{options.gres}' asks for {count} {what}, "
                            f"but no node of partition '{options.partition}' has more than {most}")
