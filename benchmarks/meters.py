"""NVML meter figures on a real GPU: call cost, achieved sample rate per target, overhead on a GPU workload.

    python3 benchmarks/meters.py [--seconds 2] [--rounds 6] [--json OUT.json]

The workload (a bf16 matmul loop) runs in a separate process that owns the CUDA context, as a server does;
the meter runs here and never creates a context. Rounds alternate meter off / on (1 kHz) in the same run,
and the ratio of medians is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runner.meters.nvml import NvmlMeter, NvmlSource, open_source

PLANTER = Path(__file__).resolve().parents[1] / "tests" / "meters" / "gpu_planter.py"


def call_cost(source: NvmlSource, n: int = 20000) -> dict:
    t0 = time.perf_counter()
    for _ in range(n):
        source.sample()
    mem_us = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for _ in range(50):
        source.processes()
    proc_ms = (time.perf_counter() - t0) / 50 * 1e3
    return {"memory_info_v2_us": round(mem_us, 2), "process_list_ms": round(proc_ms, 3)}


def rates(source: NvmlSource, targets: list[float], seconds: float) -> list[dict]:
    out = []
    me = psutil.Process(os.getpid())
    for hz in targets:
        meter = NvmlMeter(source, hz=hz)
        cpu0 = sum(me.cpu_times()[:2])
        meter.start()
        time.sleep(seconds)
        meter.stop()
        cpu = sum(me.cpu_times()[:2]) - cpu0
        p = meter.provenance()
        out.append({"target_hz": hz, "achieved_hz": p["achieved_hz"], "max_gap_ms": round(p["max_gap_s"] * 1e3, 2),
                    "samples": p["samples"], "cpu_percent_of_core": round(100 * cpu / seconds, 1)})
    return out


def overhead(uuid: str, planter: subprocess.Popen, rounds: int, n: int, iters: int) -> dict:
    def run_matmul() -> float:
        planter.stdin.write(f"matmul {n} {iters}\n")
        planter.stdin.flush()
        return json.loads(planter.stdout.readline())["seconds"]

    run_matmul()  # warm-up: allocation, cuBLAS heuristics
    off, on = [], []
    for _ in range(rounds):
        off.append(run_matmul())
        meter = NvmlMeter(open_source(uuid), hz=1000)
        meter.start()
        on.append(run_matmul())
        meter.stop()
    flops = 2 * n**3 * iters
    return {"n": n, "iters": iters, "rounds": rounds, "off_s": [round(x, 4) for x in off],
            "on_1khz_s": [round(x, 4) for x in on], "median_off_s": round(statistics.median(off), 4),
            "median_on_s": round(statistics.median(on), 4),
            "ratio_on_off": round(statistics.median(on) / statistics.median(off), 4),
            "tflops_off": round(flops / statistics.median(off) / 1e12, 1)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    planter = subprocess.Popen([sys.executable, str(PLANTER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    try:
        hello = json.loads(planter.stdout.readline())
        source = open_source(hello["uuid"])
        result = {"gpu": source.info().to_json(), "memory_api": source.memory_api,
                  "call_cost": call_cost(source),
                  "rates": rates(source, [100, 500, 1000, 2000, 5000], args.seconds),
                  "overhead": overhead(hello["uuid"], planter, args.rounds, args.n, args.iters)}
    finally:
        planter.stdin.write("quit\n")
        planter.stdin.flush()
        planter.wait(30)
    g = result["gpu"]
    print(f"GPU {g['name']} {g['uuid']} driver {g['driver']} total {g['total_bytes'] / 2**30:.1f} GiB "
          f"(memory API {result['memory_api']})")
    c = result["call_cost"]
    print(f"nvmlDeviceGetMemoryInfo v2: {c['memory_info_v2_us']} us/call; process list: {c['process_list_ms']} ms/call")
    print(f"{'target Hz':>10} {'achieved Hz':>12} {'max gap ms':>11} {'CPU % core':>11}")
    for r in result["rates"]:
        print(f"{r['target_hz']:>10g} {r['achieved_hz']:>12} {r['max_gap_ms']:>11} {r['cpu_percent_of_core']:>11}")
    o = result["overhead"]
    print(f"matmul {o['n']}x{o['n']} bf16 x{o['iters']} ({o['tflops_off']} TFLOP/s): off {o['off_s']} | "
          f"on@1kHz {o['on_1khz_s']}")
    print(f"median off {o['median_off_s']} s, on {o['median_on_s']} s, ratio on/off {o['ratio_on_off']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
