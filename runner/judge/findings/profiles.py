"""Serving profiles (profiles.json), a pure function of the verdicts: per card and reference count, the flag
sets that serve it within the quality rule (sanity, minimum PSNR: the cell is served) and the latency rule
(the bootstrap interval of its median over a default flag set's median at the same count not wholly above
`max_latency_ratio`), fastest first, with peak, headroom, median latency and PSNR, and its soak's outcome
(runner.judge.findings.soak: 'held N requests', 'failed at request k', 'not soaked')."""

from __future__ import annotations

import statistics

from runner.judge.decision import Verdict
from runner.judge.findings.models import CardProfile, CountProfile, ProfileEntry, Profiles
from runner.judge.findings.soak import outcome_words
from runner.judge.verdict import ratio_interval, timed_walls
from runner.plan.matrix import VerdictRules


def card_profile(v: Verdict, rules: VerdictRules, capacity_bytes: int | None) -> CardProfile:
    counts = []
    for n in sorted({c.references for c in v.cells}):
        here = [c for c in v.cells if c.references == n and c.served]
        defaults = [(c, walls) for c in here if c.role == "default" and (walls := timed_walls(c))]
        serve, excluded = [], {}
        for c in here:
            ratio = None
            if c.role != "default" and defaults and (mine := timed_walls(c)):
                d, theirs = defaults[0]
                ratio = round(statistics.median(mine) / statistics.median(theirs), 3)
                low, _ = ratio_interval(mine, theirs)
                if low > rules.max_latency_ratio:
                    excluded[c.flags] = (f"latency {ratio:.2f}× '{d.flags}' at {n} (interval from {low:.2f}) > "
                                         f"{rules.max_latency_ratio:g}")
                    continue
            model = v.findings.flag_sets.get(c.flags) if v.findings else None
            cap = model.memory.capacity_bytes if model and model.memory.capacity_bytes else capacity_bytes
            room = None if cap is None or c.peak_bytes is None else cap - c.peak_bytes
            soaked = v.findings.soak.flag_sets.get(c.flags) if v.findings and v.findings.soak else None
            serve.append(ProfileEntry(flags=c.flags, role=c.role, peak_bytes=c.peak_bytes, peak_source=c.peak_source,
                                      headroom_bytes=room, wall_s=c.wall_s, psnr_db=c.psnr_db, latency_ratio=ratio,
                                      soak=outcome_words(soaked)))
        serve.sort(key=lambda e: (e.wall_s is None, e.wall_s or 0.0, e.peak_bytes or 0))
        counts.append(CountProfile(references=n, serve=tuple(serve), excluded=excluded))
    return CardProfile(card=v.card, capacity_bytes=capacity_bytes, counts=tuple(counts))


def profiles(run_id: str, verdicts: list[Verdict], rules: VerdictRules, capacities: dict[str, int]) -> Profiles:
    return Profiles(run_id=run_id, cards=tuple(card_profile(v, rules, capacities.get(v.card)) for v in verdicts))
