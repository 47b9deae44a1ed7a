"""What a scheduler wrote into a server's log when it ended the server itself: slurmstepd's end-of-step line
(and srun's node-failure line), read into a cause. It sits with the other readers of server text because the
failure classifier reads it from the same log window as an OOM, for every backend."""

from __future__ import annotations

import re
from dataclasses import dataclass

# slurmstepd writes this line into a step's output when the cluster ends it:
#   slurmstepd-vm: error: *** STEP 12.0 ON vm CANCELLED AT 2026-12-01T09:20:58 ***
#   slurmstepd: error: *** JOB 12 ON vm CANCELLED AT 2026-12-01T09:20:58 DUE TO TIME LIMIT ***
#   ... DUE TO PREEMPTION ***, ... DUE TO NODE FAILURE ***, ... DUE TO JOB REQUEUE ***
#   ... DUE TO NODE FAILURE, SEE SLURMCTLD LOG FOR DETAILS ***   (and srun's own "srun: error: Node failure on vm")
STEPD_END = re.compile(r"\*\*\* (?P<what>STEP|JOB) (?P<id>[\w.+]+) ON (?P<node>\S+) CANCELLED AT \S+"
                       r"(?: DUE TO (?P<why>[A-Z][A-Z ]*[A-Z]))?(?:,[^*]*)? \*\*\*")
SRUN_NODE_FAIL = re.compile(r"^srun: error: Node failure on \S+")
_WHY = {"TIME LIMIT": "time_limit", "PREEMPTION": "preempted", "NODE FAILURE": "node_failure",
        "JOB REQUEUE": "preempted"}


@dataclass(frozen=True)
class ClusterEnd:
    """Slurm ended the step itself: cancelled (by someone), or the cluster's own reason."""

    cause: str  # "cancelled", "time_limit", "preempted", "node_failure"
    line: str  # the slurmstepd line, verbatim (clipped)


def cluster_end(log_text: str) -> ClusterEnd | None:
    """The last slurmstepd end-of-step line in a server log, or None when Slurm did not end it."""
    found = None
    for line in log_text.splitlines():
        if SRUN_NODE_FAIL.match(line.strip()):
            found = ClusterEnd("node_failure", line.strip()[:400])
            continue
        m = STEPD_END.search(line)
        if m:
            why = m.group("why")
            found = ClusterEnd(_WHY.get(why.strip(), "cancelled") if why else "cancelled", line.strip()[:400])
    return found
