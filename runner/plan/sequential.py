"""Sequential latency statistics for `repeats = "auto"`: an interval for a latency ratio that stays honest
while the runner keeps looking at it and adding sends until it clears the limit. Pure; verdict and policy
both call it, so the interval that stops the sending is the interval the verdict states.

The procedure (docs/matrix.md, "repeats"):
- a side's timed sends per step climb the schedule 1, 2, 4, … up to `max_repeats`, one side at a time
  (the side whose server is up goes first), so a ratio is looked at in at most `looks(max_repeats)`
  states: (1,1), (2,1), (2,2), (4,2), … (max,max);
- at every look the interval is Welch's t interval for the difference of the mean log wall times (a
  ratio of geometric means), at confidence 1 − ALPHA / looks: Bonferroni over the planned looks. Whatever
  the stopping rule, the chance that any look's interval misses the true ratio is at most ALPHA, so a ratio
  that sits exactly on the limit is called clear (either way) at most ALPHA of the time;
- fewer than two timed sends on a side give no interval (no spread was measured): the ratio is open.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from enum import StrEnum

ALPHA = 0.02  # the whole procedure's error rate at the limit, both directions together (docs/matrix.md)


class Judgement(StrEnum):
    UNDER = "under"  # the whole interval at or under the limit
    OVER = "over"  # the whole interval above it
    OPEN = "open"  # straddles it, or no interval yet: more sends could decide it


def levels(max_repeats: int) -> tuple[int, ...]:
    """Timed sends per step a side climbs through: 1, 2, 4, … and max_repeats itself last."""
    out, n = [], 1
    while n < max_repeats:
        out.append(n)
        n *= 2
    return (*out, max_repeats)


def looks(max_repeats: int) -> int:
    """How many times one ratio can be looked at: every level of one side, then of the other."""
    return 2 * len(levels(max_repeats)) - 1


def next_level(current: int, max_repeats: int) -> int | None:
    """The next level above `current` sends per step, or None at max_repeats."""
    return next((n for n in levels(max_repeats) if n > current), None)


@dataclass(frozen=True)
class Interval:
    ratio: float  # geometric mean over geometric mean
    low: float
    high: float
    confidence: float  # per look

    def judge(self, limit: float) -> Judgement:
        if self.high <= limit:
            return Judgement.UNDER
        if self.low > limit:
            return Judgement.OVER
        return Judgement.OPEN


def ratio_interval(num: tuple[float, ...], den: tuple[float, ...], *, looks: int, alpha: float = ALPHA,
                   den_exact: bool = False) -> Interval | None:
    """Welch's interval for mean(log num) − mean(log den) at 1 − alpha/looks, as a ratio. `den_exact`: the
    reference is one recorded figure taken as exact (a baseline's wall time), so only `num` varies.
    None when a varying side has fewer than two samples, or a wall time is not positive."""
    if not num or not den or min(num) <= 0 or min(den) <= 0 or len(num) < 2 or (len(den) < 2 and not den_exact):
        return None
    x, y = [math.log(v) for v in num], [math.log(v) for v in den]
    d = statistics.fmean(x) - statistics.fmean(y)
    vx = statistics.variance(x) / len(x)
    vy = 0.0 if den_exact else statistics.variance(y) / len(y)
    confidence = 1 - alpha / looks
    se = math.sqrt(vx + vy)
    if se == 0:
        half = 0.0
    else:
        from scipy.special import stdtrit  # Student's t quantile; scipy.special, not the far heavier scipy.stats

        parts = [(vx, len(x))] + ([] if den_exact else [(vy, len(y))])
        dof = se**4 / sum(v**2 / (n - 1) for v, n in parts if v > 0)
        half = float(stdtrit(dof, 1 - (1 - confidence) / 2)) * se
    return Interval(math.exp(d), math.exp(d - half), math.exp(d + half), confidence)


def judge(interval: Interval | None, limit: float) -> Judgement:
    return Judgement.OPEN if interval is None else interval.judge(limit)
