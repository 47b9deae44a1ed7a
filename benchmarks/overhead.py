"""Runner overhead per request vs a bare httpx loop, against the same reference server, in one run.

    .venv/bin/python benchmarks/overhead.py [--requests 30] [--steps 8] [--references 1]

Both loops send the identical request to one running server (tiny preset), interleaved in rounds so drift
hits both alike. The runner's path is the real one: request building, the server-log window, meters
sampling beside it (server /metrics at 20 Hz, host RSS at 10 Hz), PNG decode, PSNR/SSIM against a
baseline, sanity checks and the atomic JSON + PNG writes. Target: overhead ≤ 5% of request time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runner import backends  # noqa: E402
from runner.execute import Baselines, References, RunContext, SessionRunner, server_spec  # noqa: E402
from runner.matrix import load_matrix  # noqa: E402
from runner.meters import build_meters  # noqa: E402
from runner.plan import make_plan  # noqa: E402
from runner.store import RunStore  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--references", type=int, default=1)
    args = ap.parse_args()
    refs = [str(ROOT / "examples" / "refs" / f"ref-{i}.png") for i in range(1, 5)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.toml"
        path.write_text(textwrap.dedent(f"""
            [run]
            name = "overhead"
            steps = {args.steps}
            size = "128x128"
            seeds = [1]
            [servers.ref]
            command = ["{{python}}", "-m", "runner.refserver", "--port", "{{port}}", "--preset", "tiny"]
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
        runner = SessionRunner(ctx, session, References(), Baselines(matrix, store))
        step = session.steps[0]
        server = backends.create("local", server_spec(ctx, matrix.cards["cpu"], matrix.flags["default"], 0))
        server.start()
        try:
            server.wait_ready(120)
            call = runner._request(step)
            bare, full = [], []
            with httpx.Client(timeout=120) as client:
                # warm-up, and a baseline image so the runner path computes PSNR/SSIM as in a real run
                first = client.post(server.base_url + call.path, json=call.body)
                first.raise_for_status()
                meters = build_meters(matrix.cards["cpu"], server, matrix.run.sample_hz)
                for m in meters:
                    m.start()
                for _ in range(args.requests):
                    t0 = time.perf_counter()
                    r = client.post(server.base_url + call.path, json=call.body)
                    r.json()
                    bare.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    record, png = runner.execute(client, server, meters, step, 0, False)
                    runner._emit(record, png)
                    full.append(time.perf_counter() - t0)
                    assert record.status == "ok", record.failure
                for m in meters:
                    m.stop()
        finally:
            server.stop()
    b, f = statistics.median(bare), statistics.median(full)
    print(f"command: {' '.join(sys.argv)}")
    print(f"requests per loop: {args.requests}, steps {args.steps}, references {args.references}, size 128x128")
    print(f"bare httpx loop : median {b * 1000:8.1f} ms  mean {statistics.fmean(bare) * 1000:8.1f} ms")
    print(f"runner execute  : median {f * 1000:8.1f} ms  mean {statistics.fmean(full) * 1000:8.1f} ms")
    print(f"overhead        : {(f - b) * 1000:+.1f} ms per request = {(f / b - 1) * 100:+.2f}% (target <= 5%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
