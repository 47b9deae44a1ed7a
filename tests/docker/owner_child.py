"""One "run" for the concurrent-runs test: starts a container through DockerServer (so it carries this
process's owner labels), then obeys lines on stdin: `reap` prints reap()'s notes as JSON, `stop` stops.

    python owner_child.py IMAGE RUN_ID LOG_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from runner.backends.base import Attempt
from runner.backends.docker import DockerServer, reap
from runner.core.registry import DockerOptions
from runner.plan.lanes import ServerPlan
from runner.plan.matrix import ServerProfile

image, run_id, log_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
plan = ServerPlan(backend="docker", profile=ServerProfile(name="t", image=image, port=8000), argv=("sleep", "300"),
                  env={}, labels={"runner.managed": "true", "runner.run": run_id, "runner.card": "c",
                                  "runner.flags": "t", "runner.attempt": "0"}, options=DockerOptions())
attempt = Attempt(name=f"runner-{run_id}-c-t-0", log_path=log_dir / f"{run_id}.log")
server = DockerServer(plan, attempt)
server.start()
print(json.dumps({"started": attempt.name}), flush=True)
for line in sys.stdin:
    if line.strip() == "reap":
        print(json.dumps({"notes": reap(None)}), flush=True)
    elif line.strip() == "stop":
        break
server.stop()
