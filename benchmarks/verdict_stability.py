"""Does the embedded default give the same verdicts run after run? Runs examples/local.toml N times
(default 5) and prints, per run and card, the verdict, the deciding flag set, the latency ratio with its
interval and how many timed sends each side had, and what `runner compare` finds changed between the first
run and this one (identical runs: ideally no changed cell); then each card's verdicts over all runs.

    python benchmarks/verdict_stability.py [--runs 5] [--matrix examples/local.toml]

Exit status 0 when every card gave one verdict in every run, 1 otherwise. Timing is whatever the machine
gives: run it on a quiet machine to measure the matrix, on a busy one to see the verdicts hold under noise.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_dir(results: Path) -> Path:
    return sorted(results.glob("*/verdict.json"), key=lambda p: p.stat().st_mtime)[-1].parent


def compare(first: Path, this: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "runner", "compare", str(first), str(this)], capture_output=True,
                          text=True)
    counts = next((ln for ln in proc.stdout.splitlines() if "changed beyond noise" in ln), proc.stderr.strip())
    changed = [ln for ln in proc.stdout.splitlines() if ln.startswith("| cpu") and ln.count("|") > 8]
    return "\n".join([f"  compare with run 1: {counts.split('. Wall')[0]}", *(f"    {ln}" for ln in changed)])


def one_run(matrix: Path, results: Path) -> tuple[float, int, list[dict]]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "runner", str(matrix), "--results", str(results), "--no-progress"],
                          capture_output=True, text=True)
    wall = time.monotonic() - t0
    runs = sorted(results.glob("*/verdict.json"), key=lambda p: p.stat().st_mtime)
    if not runs:
        sys.exit(f"no verdict.json after `runner {matrix}` (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return wall, proc.returncode, json.loads(runs[-1].read_text())["verdicts"]


def describe(v: dict) -> str:
    ev = v["evidence"]
    line = f"{v['card']:<12} {v['world']:<14} {v['flags'] or '–':<12}"
    if ev.get("latency_ratio") is not None:
        lo, hi = ev["latency_interval"]
        ref = ev["latency_reference"]
        line += f" ratio {ev['latency_ratio']:.3f} [{lo:.3f}–{hi:.3f}] sends {ref['samples'][0]}/{ref['samples'][1]}" \
                f" vs {ref['what']}"
    for b in ev.get("blocking", []):
        line += f"\n{'':<14}blocked: {b['flags']}: {b['why'][:160]}"
    for flags, b in ev.get("flag_sets", {}).items():
        if "latency ratio" in b["why"]:
            line += f"\n{'':<14}{flags}: {b['why'][:160]}"
    return line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--matrix", type=Path, default=ROOT / "examples" / "local.toml")
    args = ap.parse_args()
    seen: dict[str, list[str]] = collections.defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(1, args.runs + 1):
            wall, rc, verdicts = one_run(args.matrix, Path(tmp) / f"run-{i}")
            print(f"run {i}/{args.runs}: {wall:.0f} s, exit {rc}")
            for v in verdicts:
                seen[v["card"]].append(v["world"])
                print("  " + describe(v))
            if i > 1:
                print(compare(run_dir(Path(tmp) / "run-1"), run_dir(Path(tmp) / f"run-{i}")))
            sys.stdout.flush()
    print("\nverdicts over all runs:")
    stable = True
    for card, worlds in seen.items():
        counts = collections.Counter(worlds)
        stable &= len(counts) == 1
        print(f"  {card:<12} " + ", ".join(f"{w} {n}/{len(worlds)}" for w, n in counts.most_common()))
    return 0 if stable else 1


if __name__ == "__main__":
    sys.exit(main())
