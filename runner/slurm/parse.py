"""What the Slurm commands print, read: pure functions over their text and JSON (Slurm 22.05 and later).

Nothing here runs a command; `runner.slurm.client` does, and hands the output to these functions, so each
format is tested against what the real daemons print.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# `squeue --json` job states a lane can be in; anything else (COMPLETED, CANCELLED, ...) means it is over.
PENDING_STATES = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING"})
ACTIVE_STATES = PENDING_STATES | {"RUNNING", "SUSPENDED", "COMPLETING", "STAGE_OUT", "SIGNALING"}
# Why a job ended, as `squeue`/`scontrol` name the state: the ones that are not the job's own doing.
ENDED_BY_CLUSTER = {"PREEMPTED": "preempted", "NODE_FAIL": "node_failure", "TIMEOUT": "time_limit",
                    "BOOT_FAIL": "node_failure", "DEADLINE": "time_limit"}


class SlurmParseError(ValueError):
    """A command printed something this module cannot read (a version or site difference)."""


@dataclass(frozen=True)
class Job:
    job_id: int
    name: str
    state: str  # RUNNING, PENDING, COMPLETED, CANCELLED, PREEMPTED, NODE_FAIL, TIMEOUT, ...
    reason: str  # the pending (or end) reason: Resources, Priority, None, ...
    nodes: str  # node list ("" while pending)
    comment: str
    partition: str
    gres: str  # what the job asked per node (gres:gpu:rtx3090:1)
    submit_time: float | None
    start_time: float | None  # epoch seconds; while pending a forecast, so only meaningful once started
    end_time: float | None

    @property
    def pending(self) -> bool:
        return self.state in PENDING_STATES

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES


@dataclass(frozen=True)
class Step:
    step_id: str  # "12.3", "12.batch"
    name: str
    nodes: str


@dataclass(frozen=True)
class Node:
    name: str
    address: str  # where the runner reaches a server on it
    state: str
    partitions: tuple[str, ...]
    gres: tuple[str, ...]  # "gpu:rtx3090:1", one per configured GRES


def _state(value: Any) -> str:
    # 22.05 prints a string; later versions a list of flags (["RUNNING"], ["PENDING", "..."]).
    if isinstance(value, list):
        return str(value[0]) if value else ""
    return str(value or "")


def _number(value: Any) -> float | None:
    # 23.x wraps numbers as {"set": true, "infinite": false, "number": N}.
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        return None
    return float(value)


def _document(text: str, command: str) -> dict[str, Any]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SlurmParseError(f"{command} --json printed no JSON ({exc.msg})") from None
    if not isinstance(doc, dict):
        raise SlurmParseError(f"{command} --json printed {type(doc).__name__}, not an object")
    errors = doc.get("errors") or []
    if errors:
        first = errors[0]
        what = first.get("error") or first.get("description") if isinstance(first, dict) else first
        raise SlurmParseError(f"{command}: {what}")
    return doc


def jobs_from_squeue_json(text: str) -> list[Job]:
    doc = _document(text, "squeue")
    out = []
    for j in doc.get("jobs", []):
        try:
            job_id = int(_number(j["job_id"]) or 0)
        except (KeyError, TypeError):
            raise SlurmParseError("squeue --json: a job without job_id") from None
        gres = str(j.get("tres_per_node") or j.get("gres_detail") or "")
        out.append(Job(job_id=job_id, name=str(j.get("name", "")), state=_state(j.get("job_state")),
                       reason=str(j.get("state_reason") or "None"), nodes=str(j.get("nodes") or ""),
                       comment=str(j.get("comment") or ""), partition=str(j.get("partition") or ""),
                       gres=gres, submit_time=_number(j.get("submit_time")),
                       start_time=_number(j.get("start_time")), end_time=_number(j.get("end_time"))))
    return out


def nodes_from_sinfo_json(text: str) -> list[Node]:
    doc = _document(text, "sinfo")
    out = []
    for n in doc.get("nodes", []):
        gres = str(n.get("gres") or "")
        out.append(Node(name=str(n.get("name", "")), address=str(n.get("address") or n.get("name", "")),
                        state=_state(n.get("state")), partitions=tuple(str(p) for p in n.get("partitions", [])),
                        gres=tuple(g for g in split_gres(gres))))
    return out


def split_gres(text: str) -> list[str]:
    """`gpu:rtx3090:1,gpu:rtx5080:2(S:0)` → ["gpu:rtx3090:1", "gpu:rtx5080:2"] (socket affinity dropped)."""
    return [re.sub(r"\(.*?\)$", "", g.strip()) for g in re.split(r",(?![^()]*\))", text) if g.strip()
            and g.strip() != "(null)"]


def gres_types(gres: tuple[str, ...] | list[str], name: str = "gpu") -> set[str]:
    """The types a node offers of one GRES name: ("gpu:rtx3090:1", "gpu:2") → {"rtx3090"} (untyped: none)."""
    types = set()
    for g in gres:
        parts = g.split(":")
        if parts[0] == name and len(parts) == 3:
            types.add(parts[1])
    return types


def requested_gpu_type(gres: str) -> str | None:
    """The GPU type a request names: "gpu:rtx3090:1" → "rtx3090", "gpu:1" → None, "rtx3090" → "rtx3090"."""
    parts = gres.removeprefix("gres:").split(":")
    if len(parts) == 1:
        return None if parts[0].isdigit() or parts[0] == "gpu" else parts[0]
    if parts[0] != "gpu":
        return None
    return None if parts[1].isdigit() else parts[1]


def requested_gpu_count(gres: str) -> int | None:
    """How many GPUs a request asks for: "gpu:rtx3090:3" → 3, "gpu:2" → 2, "gpu" or "rtx3090" → 1; None when
    the count is not a number."""
    parts = gres.removeprefix("gres:").split(":")
    last = parts[-1].split("(")[0]
    if len(parts) == 1 or (len(parts) == 2 and not last.isdigit()):
        return 1
    return int(last) if last.isdigit() else None


def gpus_offered(gres: tuple[str, ...] | list[str], gpu_type: str | None) -> int:
    """A node's GPUs of a type (any type: None), from sinfo's gres ("gpu:rtx3090:2", "gpu:4(S:0-1)")."""
    total = 0
    for g in gres:
        parts = g.split("(")[0].split(":")
        if parts[0] != "gpu" or not parts[-1].isdigit():
            continue
        if gpu_type is None or (len(parts) == 3 and parts[1] == gpu_type):
            total += int(parts[-1])
    return total


def steps_from_squeue(text: str) -> list[Step]:
    """`squeue -s -h -o '%i|%j|%N'` (steps have no --json in 22.05) → steps."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = line.split("|")
        if len(fields) != 3:
            raise SlurmParseError(f"squeue -s: unexpected line {line[:120]!r}")
        out.append(Step(*(f.strip() for f in fields)))
    return out


def job_id_from_sbatch(text: str) -> int:
    """`sbatch --parsable` → the job id ("123" or "123;cluster")."""
    head = text.strip().split(";", 1)[0]
    if not head.isdigit():
        raise SlurmParseError(f"sbatch --parsable printed {text.strip()[:120]!r}, not a job id")
    return int(head)


def key_values(line: str) -> dict[str, str]:
    """One `scontrol show -o` record (`PartitionName=debug Nodes=vm State=UP ...`) → its fields."""
    out: dict[str, str] = {}
    for m in re.finditer(r"(\S+?)=(\S*)", line):
        out[m.group(1)] = m.group(2)
    return out


def controller_up(text: str) -> bool:
    """`scontrol ping`: "Slurmctld(primary) at vm is UP" (a backup may be DOWN while the primary answers)."""
    return bool(re.search(r"\bis UP\b", text))


def accounting_disabled(text: str) -> bool:
    """sacct on a cluster without slurmdbd answers this line instead of jobs."""
    return "accounting storage is disabled" in text.lower()


def jobs_from_sacct(text: str) -> list[dict[str, str]]:
    """`sacct -P -n -o JobID,JobName,State,Start,End,NodeList,Reason` → one dict per line (job and steps)."""
    cols = ("job_id", "name", "state", "start", "end", "nodes", "reason")
    out = []
    for line in text.splitlines():
        if line.strip():
            fields = line.split("|")
            if len(fields) != len(cols):
                raise SlurmParseError(f"sacct: unexpected line {line[:120]!r}")
            out.append(dict(zip(cols, fields, strict=True)))
    return out
