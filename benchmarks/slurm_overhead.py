"""The runner's own overhead per session under Slurm (submit → ready) against the local backend, same machine.

    .venv/bin/python benchmarks/slurm_overhead.py [--rounds 5] [--sessions 3]

The server is a trivial HTTP server answering /health at once, so what is timed is the runner's path, not
a model loading: local = LocalServer start (supervisor, free port) → ready; slurm = the lane's allocation
(sbatch → RUNNING, the scheduler's latency included) once per lane, then per session a job step (srun
--overlap, runner.slurm.step picks the port on the node) → ready; stop = cancelling the step vs stopping the
process group. Rounds interleave the two so load on the machine hits both alike. Needs the local Slurm of
scripts/slurm-local.sh (or a cluster: --partition/--gres).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runner import backends  # noqa: E402
from runner.backends import slurm  # noqa: E402
from runner.backends.base import Attempt  # noqa: E402
from runner.plan.lanes import make_plan  # noqa: E402
from runner.plan.matrix import load_matrix  # noqa: E402

SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.HTTPServer((sys.argv[1], int(sys.argv[2])), H).serve_forever()
"""

MATRIX = """
[run]
name = "bench"
seeds = [1]
[servers.tiny]
command = ["{{python}}", "{server}", "{{host}}", "{{port}}"]
[cards.local]
server = "tiny"
vram_gib = 1
[cards.slurm]
server = "tiny"
backend = "slurm"
partition = "{partition}"
gres = "{gres}"
vram_gib = 1
[flags.default]
role = "default"
[fixtures.f]
prompt = "x"
[matrix]
references = [0]
"""


def stats(xs: list[float]) -> str:
    return f"{statistics.mean(xs) * 1000:8.1f} {statistics.median(xs) * 1000:8.1f} {min(xs) * 1000:8.1f} " \
           f"{max(xs) * 1000:8.1f}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5, help="lanes (allocations) per backend")
    ap.add_argument("--sessions", type=int, default=3, help="sessions (server starts) per lane")
    ap.add_argument("--partition", default="debug")
    ap.add_argument("--gres", default="gpu:rtx3090:1")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "server.py").write_text(textwrap.dedent(SERVER))
        (folder / "m.toml").write_text(MATRIX.format(server=folder / "server.py", partition=args.partition,
                                                     gres=args.gres))
        matrix = load_matrix(folder / "m.toml")
        plans = {s.card: s.server for s in make_plan(matrix).sessions}
        t = {k: [] for k in ("local start→ready", "local stop", "slurm allocation (sbatch→running)",
                             "slurm step start→ready", "slurm first session (submit→ready)", "slurm stop step",
                             "slurm release allocation")}
        for r in range(args.rounds):
            for i in range(args.sessions):
                attempt = Attempt(f"bench-local-{r}-{i}", folder / f"local-{r}/{i}/server.log")
                t0 = time.monotonic()
                server = backends.create(plans["local"], attempt)
                server.start()
                server.wait_ready(30, poll_s=0.02)
                t1 = time.monotonic()
                server.stop()
                t["local start→ready"].append(t1 - t0)
                t["local stop"].append(time.monotonic() - t1)
            lane = slurm.SlurmLane(f"bench-{r}", "bench")
            slurm._current.lane = lane
            try:
                for i in range(args.sessions):
                    attempt = Attempt(f"bench-slurm-{r}-{i}", folder / f"slurm-{r}/s{i}/server.log",
                                      {"runner.run": "bench"})
                    t0 = time.monotonic()
                    server = backends.create(plans["slurm"], attempt)  # the lane's allocation, when it has none
                    t1 = time.monotonic()
                    server.start()
                    server.wait_ready(60, poll_s=0.02)
                    t2 = time.monotonic()
                    server.stop()
                    t["slurm stop step"].append(time.monotonic() - t2)
                    t["slurm step start→ready"].append(t2 - t1)
                    if i == 0:
                        t["slurm allocation (sbatch→running)"].append(t1 - t0)
                        t["slurm first session (submit→ready)"].append(t2 - t0)
            finally:
                slurm._current.lane = None
                t3 = time.monotonic()
                lane.release_all()
                t["slurm release allocation"].append(time.monotonic() - t3)
    print(f"{args.rounds} lane(s) × {args.sessions} session(s) per backend, trivial /health server")
    print(f"{'ms':38} {'mean':>8} {'median':>8} {'min':>8} {'max':>8}   n")
    for k, xs in t.items():
        print(f"{k:38} {stats(xs)}   {len(xs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
