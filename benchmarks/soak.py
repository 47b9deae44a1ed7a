"""The soak's cost, in one run: the runner's own time per soak request against a 1024x1024 request, and the soak
findings' cost on a 10,000-request soak record.

    .venv/bin/python benchmarks/soak.py [--requests 16] [--size 1024x1024] [--synthetic 10000]

1. A real soak (`runner` on a matrix with `[soak]`) of the reference server at the h200-24g token counts with tiny
   compute (a 1024^2 output is 4096 tokens; a request takes seconds on a CPU). Per request, from requests.jsonl: the
   time from one request's send to the next one's, less the request's own wall time, is what the runner adds
   between requests; the quiet window (`[run] quiet_s`, where the meters read the level the request left) is part
   of it and shown apart — it is a measurement the soak asked for, not overhead.
2. The soak findings (runner.judge.findings.soak.flag_soak) and the record load (RunStore.load_soak_requests, JSON
   lines validated) on a synthetic 10,000-request soak: the cost `runner report` pays per soaked flag set.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runner.core.records import Level, Peak, SoakRecord, SoakRequest, Status  # noqa: E402
from runner.judge.findings.soak import flag_soak  # noqa: E402

MATRIX = """
[run]
name = "soak-bench"
steps = {steps}
size = "{size}"
request_timeout_s = 600
ready_timeout_s = 300
diagnosis = "off"
quiet_s = {quiet}

[servers.ref]
command = ["{{python}}", "-m", "runner.refserver", "--host", "{{host}}", "--port", "{{port}}", "--preset", "h200-24g",
           "--dim", "96", "--layers", "4", "--heads", "4", "--ref-tokens", "64", "--model", "{{model}}"]

[cards.cpu]
server = "ref"
vram_gib = 64

[flags.default]
role = "default"

[fixtures.f]
prompt = "compose"
references = ["{ref}"]

[matrix]
references = [1]

[soak]
requests = {requests}
flags = ["default"]
"""


def real_soak(requests: int, size: str, steps: int, quiet: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        matrix = Path(tmp) / "m.toml"
        matrix.write_text(MATRIX.format(steps=steps, size=size, requests=requests, quiet=quiet,
                                        ref=ROOT / "examples" / "refs" / "ref-1.png"))
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "runner", str(matrix), "--results", tmp, "--no-progress"],
                              capture_output=True, text=True, cwd=ROOT)
        total = time.monotonic() - t0
        if proc.returncode != 0:
            print(proc.stderr[-3000:])
            raise SystemExit(proc.returncode)
        (run_dir,) = Path(tmp).glob("soak-bench-*")
        lines = (run_dir / "cpu" / "default" / "soak" / "requests.jsonl").read_text().splitlines()
        done = [json.loads(line) for line in lines]
    gaps = [(b["started_at"] - a["started_at"]) - a["wall_s"] for a, b in itertools.pairwise(done)]
    walls = [d["wall_s"] for d in done]
    wall, gap = statistics.mean(walls), statistics.mean(gaps)
    print(f"real soak: {len(done)} requests at {size}, {steps} steps (whole run {total:.1f} s)")
    print(f"  request wall time (mean)                 {wall:8.3f} s")
    print(f"  between requests (mean)                  {gap * 1000:8.1f} ms = {100 * gap / wall:5.2f} % of a request")
    print(f"    of which the quiet window (quiet_s)    {quiet * 1000:8.1f} ms = {100 * quiet / wall:5.2f} %")
    print(f"    the runner's own time                  {(gap - quiet) * 1000:8.1f} ms = "
          f"{100 * (gap - quiet) / wall:5.2f} %")


def synthetic(n: int) -> None:
    key = "c/default"
    rows = []
    for i in range(1, n + 1):
        floor = 2**30 + i * 4096
        rows.append(SoakRequest(
            key=key, number=i, attempt=0, references=1 + (i - 1) % 4, fixture="f", seed=i % 3,
            started_at=1e9 + i, wall_s=2.0 + (i % 7) * 0.01, status=Status.OK,
            peak=Peak(source="nvml", metric="device", bytes=floor + 3 * 2**30, samples=40, rate_hz=1000.0,
                      available=True),
            floor_after=Level(source="nvml", bytes=floor, samples=300, window_s=0.3, bound="upper-bound",
                              available=True)))
    record = SoakRecord(key=key, card="c", flags="default", role="default", requests=n, references=(1, 2, 3, 4),
                        order="cycle", chosen="named in [soak] flags", stopped="requests")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "requests.jsonl"
        path.write_text("".join(json.dumps(r.model_dump(mode="json")) + "\n" for r in rows))
        t0 = time.perf_counter()
        loaded = [SoakRequest.model_validate_json(line) for line in path.read_text().splitlines()]
        t_load = time.perf_counter() - t0
        size = path.stat().st_size
    t0 = time.perf_counter()
    found = flag_soak(record, loaded, 24 * 2**30)
    t_find = time.perf_counter() - t0
    print(f"synthetic soak record: {n} requests, requests.jsonl {size / 2**20:.1f} MiB")
    print(f"  load + validate                          {t_load * 1000:8.1f} ms")
    print(f"  findings (flag_soak)                     {t_find * 1000:8.1f} ms "
          f"(floor drift {found.floor_drift.per_request if found.floor_drift else None:.0f} B/request)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--size", default="1024x1024")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--quiet", type=float, default=0.3)
    ap.add_argument("--synthetic", type=int, default=10_000)
    args = ap.parse_args()
    synthetic(args.synthetic)
    real_soak(args.requests, args.size, args.steps, args.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
