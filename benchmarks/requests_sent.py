"""Requests sent for the seed's matrix shape, before and after "an OOM at n also implies the other seeds at n".

    .venv/bin/python benchmarks/requests_sent.py [--flag-sets 6] [--references 1 2 3 4] [--seeds 4] [--oom-at 3]

Drives the real session policy (runner.run.policy.next_action) with a card that runs out of memory at every
request with >= --oom-at references (on real hardware each such OOM costs tens of seconds). "before" is the
policy with `oom_implies_seeds = false` (what the runner did until this change), "after" the default. Counts
are HTTP requests: timed sends × [run] repeats, plus the first step's determinism re-send when repeats = 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runner.core.records import FailureClass
from runner.plan.lanes import Step
from runner.run import policy


def session_requests(refs: list[int], seeds: int, oom_at: int, implies_seeds: bool, repeats: int) -> tuple[int, int]:
    """(requests sent, of which OOM) for one card × flag set session."""
    steps = tuple(Step("card", "flags", "fx", n, s) for n in refs for s in range(seeds))
    rules = policy.Rules(restarts=1, stop_after_oom=True, oom_implies_seeds=implies_seeds,
                         determinism_resend=repeats == 1, gpu_gate=False)
    state, outcome = policy.initial(rules, steps, [], attempt=0), policy.Begin()
    sent = ooms = 0
    while True:
        state, action = policy.next_action(state, outcome)
        match action:
            case policy.Start():
                outcome = policy.Started(None)
            case policy.Send(step=step, determinism_resend=resend):
                oom = step.references >= oom_at
                # an OOM ends the step at its first send; a served step is sent `repeats` (+ re-send) times
                sent += 1 if oom else repeats + int(resend)
                ooms += int(oom)
                outcome = policy.Sent(step, FailureClass.OOM if oom else None, False)
            case policy.Skip():
                outcome = policy.Skipped()
            case policy.Finish():
                return sent, ooms


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flag-sets", type=int, default=6)
    ap.add_argument("--references", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--oom-at", type=int, default=3)
    args = ap.parse_args()
    print(f"command: {' '.join(sys.argv)}")
    print(f"shape: {args.flag_sets} flag sets x references {args.references} x {args.seeds} seeds on one card "
          f"that runs out of memory at >= {args.oom_at} references")
    print(f"{'repeats':>7} | {'before: requests (OOMs)':>24} | {'after: requests (OOMs)':>23} | saved")
    for repeats in (1, 2, 3):
        b, bo = session_requests(args.references, args.seeds, args.oom_at, False, repeats)
        a, ao = session_requests(args.references, args.seeds, args.oom_at, True, repeats)
        n = args.flag_sets
        print(f"{repeats:>7} | {b * n:>14} ({bo * n:>3} OOM) | {a * n:>13} ({ao * n:>3} OOM) | "
              f"{(b - a) * n} request(s), all of them OOMs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
