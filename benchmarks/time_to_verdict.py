"""Time to verdict: `repeats = 2` against `repeats = "auto"`, end to end through the runner and the reference
server, on a double of the seed's matrix and on examples/local.toml.

    .venv/bin/python benchmarks/time_to_verdict.py [--only seed|local] [--repeats 2|auto] [--keep DIR [--reuse]]
    .venv/bin/python benchmarks/time_to_verdict.py --at-limit-trials N

The seed's double is examples/seed-emulated.toml (matrix.toml's flag sets, axes, seeds and rules on emulated
CPU cards) with the seed's costs scaled down 100×: every server start sleeps 0.9 s before it opens its port
(`--fault slow-load=0.9`; the seed: one to two minutes per start) and every request 0.34–0.45 s on top of its
compute (`--fault jitter=0.34:0.45:pid`; the seed: 34–45 s per request). Each run is a real run (`runner
MATRIX --results DIR`); the figures come from its records: sends (every HTTP send, determinism re-sends and
auto's top-ups included), server starts, and GPU time weighted by the seed's real costs (starts × 90 s +
sends × 40 s), beside the GPU-busy time measured here. The verdicts of both modes are printed and compared.

`--at-limit-trials N`: the error rate of auto's procedure at the limit, by the pure simulation of
tests/core/test_sequential.py (the runner's policy.topups / verdict / runner.plan.sequential, jitter-drawn sends,
the offload exactly twice the default against a limit of 2): how often N seeded trials end decided.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runner.present import cost  # noqa: E402
from runner.run.store import RunStore  # noqa: E402

SEED_LOAD_S, SEED_SEND_S = 90.0, 40.0  # the seed: a start takes one to two minutes, a request 34-45 s
SEED_FAULTS = '"--fault", "slow-load=0.9", "--fault", "jitter=0.34:0.45:pid"'


def matrix_text(name: str, repeats: str) -> str:
    if name == "seed":
        text = (ROOT / "examples" / "seed-emulated.toml").read_text()
        text, n = re.subn(r'("--threads", "1")\]', rf"\1, {SEED_FAULTS}]", text)
        assert n == 1, "examples/seed-emulated.toml: its server command changed; adapt SEED_FAULTS"
    else:
        text = (ROOT / "examples" / "local.toml").read_text()
    text = re.sub(r"(?m)^repeats\s*=.*\n|^max_repeats\s*=.*\n", "", text)
    return text.replace("[run]\n", f"[run]\nrepeats = {repeats}\n", 1)


def run_one(name: str, repeats: str, results: Path, reuse: bool) -> dict:
    exit_code: int | None = None
    if not (reuse and list(results.glob("*-*"))):
        # Next to the example, so its relative paths (refs/) hold; removed afterwards.
        path = ROOT / "examples" / f".time-to-verdict-{name}-{repeats.strip(chr(34))}.toml"
        path.write_text(matrix_text(name, repeats))
        try:
            exit_code = subprocess.run([sys.executable, "-m", "runner", str(path), "--results", str(results),
                                        "--no-progress"], capture_output=True, text=True, timeout=3600).returncode
        finally:
            path.unlink(missing_ok=True)
    run_dir = max(results.glob("*-*"), key=lambda p: p.stat().st_mtime)
    store = RunStore(run_dir)
    steps, sessions = store.load_steps(), store.load_sessions()
    sends = sum(len(cost.sends_of(r)) for r in steps)
    starts = sum(len(s.starts) for s in sessions)
    busy = sum((st.stopped_at or st.started_at) - st.started_at for s in sessions for st in s.starts)
    doc = json.loads((run_dir / "verdict.json").read_text())
    verdicts = {v["card"]: (v["world"], v["flags"]) for v in doc["verdicts"]}
    run = store.load_run()
    wall = (run.get("finished_at") or run["started_at"]) - run["started_at"]
    return {"name": name, "repeats": repeats, "exit": exit_code, "wall_s": wall, "sends": sends,
            "starts": starts, "busy_s": busy, "weighted_s": starts * SEED_LOAD_S + sends * SEED_SEND_S,
            "verdicts": verdicts, "run_dir": str(run_dir)}


def at_limit(trials: int) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "core"))
    from test_sequential import Lane  # the procedure as the executor drives it, without processes

    worlds = Counter(Lane(f"1:1.4:{s}", f"2:2.8:{s + 100_000}").run().value for s in range(trials))
    decided = trials - worlds["undecided"]
    print(f"at the limit (offload = 2 × default, limit 2), {trials} seeded trials: {dict(worlds)}; decided "
          f"{decided} = {100 * decided / trials:.1f}% (the procedure's bound: 2%)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=("seed", "local"))
    ap.add_argument("--keep", type=Path, help="keep the run folders here (default: a temporary folder)")
    ap.add_argument("--reuse", action="store_true",
                    help="with --keep: take a run already in its folder (<matrix>-<repeats>/) instead of running it")
    ap.add_argument("--repeats", choices=("2", "auto"), help="run only this mode")
    ap.add_argument("--at-limit-trials", type=int, default=0)
    args = ap.parse_args()
    print(f"command: {' '.join(sys.argv)}")
    if args.at_limit_trials:
        at_limit(args.at_limit_trials)
        return 0
    base = args.keep or Path(tempfile.mkdtemp(prefix="time-to-verdict-"))
    rows = []
    for name in ([args.only] if args.only else ["seed", "local"]):
        for repeats in ("2", '"auto"'):
            if args.repeats and repeats.strip(chr(34)) != args.repeats:
                continue
            row = run_one(name, repeats, base / f"{name}-{repeats.strip(chr(34))}", args.reuse)
            rows.append(row)
            print(f"  {name} repeats={repeats}: exit {row['exit']}, {row['sends']} sends, {row['starts']} starts, "
                  f"{row['wall_s']:.0f} s here ({row['run_dir']})", flush=True)
    print()
    print("| matrix | repeats | sends | server starts | GPU time at the seed's costs | GPU busy here | wall here "
          "| verdicts |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        v = "; ".join(f"{c} {w}" + (f" ({f})" if f else "") for c, (w, f) in sorted(r["verdicts"].items()))
        print(f"| {r['name']} | {r['repeats']} | {r['sends']} | {r['starts']} | {cost._clock(r['weighted_s'])} | "
              f"{cost._clock(r['busy_s'])} | {cost._clock(r['wall_s'])} | {v} |")
    print()
    ok = True
    for name in dict.fromkeys(r["name"] for r in rows if not args.repeats):
        two, auto = (next(r for r in rows if r["name"] == name and r["repeats"] == x) for x in ("2", '"auto"'))
        same = two["verdicts"] == auto["verdicts"]
        ok &= same
        print(f"{name}: auto made {auto['sends']} of the {two['sends']} sends of repeats = 2 "
              f"({100 * auto['sends'] / two['sends']:.0f}%), GPU time at the seed's costs "
              f"{100 * auto['weighted_s'] / two['weighted_s']:.0f}%; verdicts {'identical' if same else 'DIFFER'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
