"""`python -m runner.slurm.step --port-file F -- COMMAND...`: runs on the compute node as the first process of
a job step. It picks the step's port there (the kernel's free port on that node, so two steps on one node
never get the same one), puts it where COMMAND and its environment say `{port}` (and the step's GPU where
they say `{gpu}`), writes where it is to F (on the shared filesystem the runner reads), then becomes COMMAND.

F is written atomically: {"port", "node", "job_id", "step_id", "cuda_visible_devices", "pid"}.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

PORT, GPU = "{port}", "{gpu}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def fill(text: str, port: int, gpu: str) -> str:
    return text.replace(PORT, str(port)).replace(GPU, gpu)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.slurm.step")
    parser.add_argument("--port-file", type=Path, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command")
    port = free_port()
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    env = {k: fill(v, port, gpu) for k, v in os.environ.items()}
    filled = [fill(a, port, gpu) for a in command]
    where = {"port": port, "node": socket.gethostname(), "job_id": os.environ.get("SLURM_JOB_ID"),
             "step_id": os.environ.get("SLURM_STEP_ID"), "cuda_visible_devices": gpu or None, "pid": os.getpid()}
    tmp = args.port_file.with_name(args.port_file.name + ".tmp")
    tmp.write_text(json.dumps(where))
    tmp.replace(args.port_file)
    print(f"runner slurm step {where['job_id']}.{where['step_id']} on {where['node']}: port {port}, "
          f"CUDA_VISIBLE_DEVICES={gpu or '(none)'}", flush=True)
    try:
        os.execvpe(filled[0], filled, env)
    except OSError as exc:
        print(f"runner slurm step: cannot run {filled[0]!r}: {exc.strerror}", file=sys.stderr, flush=True)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
