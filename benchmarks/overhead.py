"""Runner overhead per request vs a bare httpx loop, against the same reference server, in one run.

    .venv/bin/python benchmarks/overhead.py [--requests 12] [--steps 8] [--references 1] [--size 1024x1024]

All loops send the identical request to one running server (tiny preset), interleaved in rounds so drift
hits them alike. The runner's path is the real one: request building, the server-log window, meters
sampling beside it (server /metrics at 20 Hz, host RSS at 10 Hz), PNG decode, PSNR/SSIM against a
baseline, sanity checks and the atomic JSON + PNG writes — once with scoring inline (as before scoring moved
off the request path) and once with the run's scoring worker (score and write the previous step while the
next request is in flight; each round's time includes waiting for the last step's scoring).
Target: overhead ≤ 1 % of request time at 1024×1024 with requests of a few seconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runner import backends  # noqa: E402
from runner.meters import build_meters  # noqa: E402
from runner.plan.lanes import make_plan  # noqa: E402
from runner.plan.matrix import load_matrix  # noqa: E402
from runner.run.execute import Baselines, References, RunContext, SessionRunner, attempt_of  # noqa: E402
from runner.run.store import RunStore  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=12, help="requests per loop")
    ap.add_argument("--round", type=int, default=3, help="requests per loop per round (loops alternate)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--references", type=int, default=1)
    ap.add_argument("--size", default="128x128", help="output size WxH (1024x1024: the seed's size)")
    ap.add_argument("--server-args", default="--preset tiny",
                    help="reference server arguments; tiny stops at 512x512, so for 1024x1024 use e.g. "
                         "'--preset h200-24g --dim 96 --layers 4 --heads 4 --ref-tokens 64' (tiny compute, the "
                         "seed's token counts)")
    args = ap.parse_args()
    server_args = ", ".join(f'"{a}"' for a in args.server_args.split())
    refs = [str(ROOT / "examples" / "refs" / f"ref-{i}.png") for i in range(1, 5)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.toml"
        path.write_text(textwrap.dedent(f"""
            [run]
            name = "overhead"
            steps = {args.steps}
            size = "{args.size}"
            seeds = [1]
            repeats = 1
            determinism_check = false
            request_timeout_s = 600
            [servers.ref]
            command = ["{{python}}", "-m", "runner.refserver", "--port", "{{port}}", {server_args}]
            [cards.cpu]
            server = "ref"
            vram_gib = 1
            [flags.default]
            role = "default"
            [fixtures.shapes]
            prompt = "shapes on a table"
            references = {refs!r}
            [matrix]
            references = [{args.references}]
            """).replace("'", '"'))
        matrix = load_matrix(path)
        plan = make_plan(matrix)
        store = RunStore(Path(tmp) / "run")
        ctx = RunContext(matrix, plan, store, "overhead")
        session = plan.sessions[0]
        step = session.steps[0]
        server = backends.create(session.server, attempt_of(ctx, session, 0))
        server.start()
        bare: list[float] = []
        inline: list[float] = []
        worker: list[float] = []
        # per runner loop: [time on the request path beside the HTTP sends, Σ HTTP wall, time in the final drain]
        added = {"runner, scoring inline": [0.0, 0.0, 0.0], "runner, scoring worker": [0.0, 0.0, 0.0]}
        try:
            server.wait_ready(300)
            scorer = ThreadPoolExecutor(max_workers=1)
            refs_cache = References()
            inline_runner = SessionRunner(ctx, session, refs_cache, Baselines(matrix, store))
            worker_runner = SessionRunner(ctx, session, refs_cache, Baselines(matrix, store), scorer)
            call = inline_runner._request(step)
            with httpx.Client(timeout=600) as client:
                client.post(server.base_url + call.path, json=call.body).raise_for_status()  # warm-up
                meters = build_meters(matrix.cards["cpu"], server, matrix.run.sample_hz)
                for m in meters:
                    m.start()
                done = 0
                while done < args.requests:
                    n = min(args.round, args.requests - done)
                    t0 = time.perf_counter()
                    for _ in range(n):
                        r = client.post(server.base_url + call.path, json=call.body)
                        r.json()
                    bare.append((time.perf_counter() - t0) / n)
                    for name, runner, out in (("runner, scoring inline", inline_runner, inline),
                                              ("runner, scoring worker", worker_runner, worker)):
                        t0 = time.perf_counter()
                        walls = 0.0
                        for _ in range(n):
                            work = runner.run.execute(client, server, meters, step, 0, False)
                            walls += (work if hasattr(work, "wall_s") else work.record).wall_s
                            runner._submit(work)
                        t_drain = time.perf_counter()
                        runner.drain()
                        loop = time.perf_counter() - t0
                        out.append(loop / n)
                        drain = time.perf_counter() - t_drain
                        added[name][0] += loop - drain - walls
                        added[name][1] += walls
                        added[name][2] += drain
                    done += n
                for m in meters:
                    m.stop()
            scorer.shutdown()
            record = store.load_steps()[0]
            assert record.status == "ok" and record.scores is not None, record.failure
        finally:
            server.stop()
    b = statistics.fmean(bare)
    print(f"command: {' '.join(sys.argv)}")
    print(f"requests per loop: {args.requests} (rounds of {args.round}), steps {args.steps}, "
          f"references {args.references}, size {args.size}, server {args.server_args}")
    print("'on the request path': per request, the runner's time between and around its HTTP sends (request "
          "build, log window, parse, meters, and scoring when inline); 'last step': the scoring of a round's "
          f"last step that the worker had not finished (once per session in a real run; here once per {args.round})")
    print(f"{'loop':<24} {'mean s/request':>14} {'vs bare httpx':>24} {'on the request path':>30} "
          f"{'last step, per round':>22}")
    print(f"{'bare httpx':<24} {b:>14.3f}")
    rounds = -(-args.requests // args.round)
    for name, xs in (("runner, scoring inline", inline), ("runner, scoring worker", worker)):
        f = statistics.fmean(xs)
        path_s, walls, drain = added[name]
        print(f"{name:<24} {f:>14.3f} {(f - b) * 1000:>+10.1f} ms = {(f / b - 1) * 100:+7.2f}% "
              f"{path_s / args.requests * 1000:>+10.1f} ms = {path_s / walls * 100:+6.2f}% "
              f"{drain / rounds * 1000:>15.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
