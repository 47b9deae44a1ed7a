"""Sequential latency statistics for `repeats = "auto"`: an interval for a latency ratio that stays honest
while the runner keeps looking at it and adding sends until it clears the limit. Pure; verdict and policy
both call it, so the interval that stops the sending is the interval the verdict states.

The procedure (docs/matrix.md, "repeats"):
- a side's timed sends per step climb the schedule 1, 2, 4, … up to `max_repeats`, one side at a time
  (the side whose server is up goes first), so a ratio is looked at in at most `looks(max_repeats)`
  states: (1,1), (2,1), (2,2), (4,2), … (max,max);
- the noise of one send's log wall time is a property of the server session, not of one cell: it is pooled
  over every workload of the session (`pooled_noise`: each workload's sends — its seeds and repeats at one
  reference count and fixture — around their own mean, degrees of freedom Σ(nᵢ − 1)), and never taken below
  NOISE_FLOOR (identical wall times are the clock's luck, not a noiseless machine);
- at every look the interval is a t interval for the difference of the mean log wall times (a ratio of
  geometric means) with each side's pooled noise (Welch–Satterthwaite degrees of freedom), paired by seed
  where both sides sent the same (fixture, seed) steps — each seed's difference of means, so what a seed
  does to both sides cancels — at confidence 1 − ALPHA / looks: Bonferroni over the planned looks.
  Whatever the stopping rule, the chance that any look's interval misses the true ratio is at most ALPHA,
  so a ratio that sits exactly on the limit is called clear (either way) at most ALPHA of the time
  (tests/core/test_sequential_sim.py simulates it);
- a session without a workload of two sends gives no noise (no spread was measured): the ratio is open.

`interval_logs` is the arithmetic in numpy-friendly form: the simulation tests call the same function on
arrays of thousands of simulated sessions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

ALPHA = 0.02  # the whole procedure's error rate at the limit, both directions together (docs/matrix.md)
NOISE_FLOOR = 0.01  # the least spread (sd of log wall time, ≈ 1 %) a session's sends are taken to have
EXP_MAX = 700.0  # math.exp overflows past ~709.78: a bound beyond it is unbounded (inf), never an OverflowError


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


def exp(x: float) -> float:
    """exp that says inf (or 0) instead of raising past a double's range (issue 30, A-1)."""
    return math.inf if x > EXP_MAX else 0.0 if x < -EXP_MAX else math.exp(x)


@dataclass(frozen=True)
class Noise:
    """The spread of one send's log wall time in one server session, pooled over its workloads."""

    var: float  # variance of log wall time (≥ NOISE_FLOOR²)
    dof: int  # Σ(nᵢ − 1) over the workloads

    @property
    def sd(self) -> float:
        return math.sqrt(self.var)


def pooled_noise(workloads: Iterable[Sequence[float]]) -> Noise | None:
    """Each workload's log wall times around their own mean, pooled; None when no workload has two
    positive sends (a wall time ≤ 0 or not finite is no measurement)."""
    ss, dof = 0.0, 0
    for walls in workloads:
        logs = [math.log(w) for w in walls if math.isfinite(w) and w > 0]
        if len(logs) < 2:
            continue
        mean = math.fsum(logs) / len(logs)
        ss += math.fsum((x - mean) ** 2 for x in logs)
        dof += len(logs) - 1
    return Noise(max(ss / dof, NOISE_FLOOR**2), dof) if dof else None


@dataclass(frozen=True)
class Interval:
    ratio: float  # geometric mean over geometric mean (paired: the geometric mean of the per-seed ratios)
    low: float
    high: float
    confidence: float  # per look
    paired: bool = False
    dof: float = math.inf  # the t quantile's degrees of freedom

    def judge(self, limit: float) -> Judgement:
        if self.high <= limit:
            return Judgement.UNDER
        if self.low > limit:
            return Judgement.OVER
        return Judgement.OPEN


def quantile(dof: Any, confidence: float) -> Any:
    """Student's t two-sided quantile at `confidence` (scipy.special, not the far heavier scipy.stats);
    arrays in, arrays out."""
    from scipy.special import stdtrit

    return stdtrit(dof, 1 - (1 - confidence) / 2)


def interval_logs(d: Any, va: Any, dfa: Any, vb: Any, dfb: Any, confidence: float) -> tuple[Any, Any]:
    """(low, high) of log ratio d with variance contributions va (dof dfa) and vb (dof dfb; vb = 0: an exact
    reference): Welch–Satterthwaite. Scalars or numpy arrays alike."""
    se2 = va + vb
    dof = se2**2 / (va**2 / dfa + vb**2 / dfb)
    half = quantile(dof, confidence) * se2**0.5
    return d - half, d + half


Side = Mapping[tuple[str, int], Sequence[float]]  # one cell's timed sends per (fixture, seed)


def _logs(side: Side) -> dict[tuple[str, int], list[float]]:
    return {k: [math.log(w) for w in v] for k, v in side.items() if v}


def ratio_interval(num: Side, den: Side | float, num_noise: Noise | None, den_noise: Noise | None = None, *,
                   looks: int, alpha: float = ALPHA) -> Interval | None:
    """The interval of geometric mean(num) / geometric mean(den) at 1 − alpha/looks, each side's spread its
    session's pooled noise; `den` a number: one recorded figure taken as exact (a baseline's wall time).
    Paired by seed when both sides hold the same (fixture, seed) steps. None when a varying side's session
    measured no noise, or a wall time is not positive."""
    den_wall, den_side = (None, den) if isinstance(den, Mapping) else (float(den), {})
    exact = den_wall is not None
    walls = [w for v in num.values() for w in v] + ([den_wall] if den_wall is not None
                                                   else [w for v in den_side.values() for w in v])
    if not walls or min(walls) <= 0 or not all(math.isfinite(w) for w in walls) or num_noise is None \
            or (not exact and den_noise is None):
        return None
    x = _logs(num)
    y = {} if exact else _logs(den_side)
    if not x or (not exact and not y):
        return None
    paired = not exact and x.keys() == y.keys()
    if paired:  # each seed's difference of means, equally weighted
        k = len(x)
        d = math.fsum(math.fsum(x[s]) / len(x[s]) - math.fsum(y[s]) / len(y[s]) for s in x) / k
        va = num_noise.var * math.fsum(1 / len(x[s]) for s in x) / k**2
        vb = 0.0 if den_noise is None else den_noise.var * math.fsum(1 / len(y[s]) for s in y) / k**2
    else:
        xs, ys = [v for vs in x.values() for v in vs], [v for vs in y.values() for v in vs]
        mean_y = math.log(den_wall) if den_wall is not None else math.fsum(ys) / len(ys)
        d = math.fsum(xs) / len(xs) - mean_y
        va = num_noise.var / len(xs)
        vb = 0.0 if exact or den_noise is None else den_noise.var / len(ys)
    confidence = 1 - alpha / looks
    dfb = den_noise.dof if den_noise is not None and vb > 0 else 1
    low, high = interval_logs(d, va, num_noise.dof, vb, dfb, confidence)
    se2 = va + vb
    dof = se2**2 / (va**2 / num_noise.dof + vb**2 / dfb)
    return Interval(exp(d), exp(float(low)), exp(float(high)), confidence, paired, float(dof))


def judge(interval: Interval | None, limit: float) -> Judgement:
    return Judgement.OPEN if interval is None else interval.judge(limit)


def sends_to_decide(interval: Interval, limit: float, noise: Noise, sends: int, looks: int,
                    alpha: float = ALPHA) -> int | None:
    """About how many timed sends a side (both sides alike) would decide this ratio against the limit, at
    the measured ratio and noise: the least n whose half-width is under |log ratio − log limit|. None when
    the ratio sits on the limit (or beyond 10,000 sends: more sends will not decide it)."""
    gap = abs(math.log(interval.ratio) - math.log(limit)) if interval.ratio > 0 else 0.0
    if gap == 0 or not math.isfinite(gap):
        return None
    confidence = 1 - alpha / looks
    n = max(sends, 1)
    while n <= 10_000:
        dof = noise.dof + 2 * (n - sends)  # each added send to both sides' workloads adds to the pool
        if float(quantile(dof, confidence)) * math.sqrt(2 * noise.var / n) < gap:
            return n
        n = n + 1 if n < 16 else int(n * 1.25)
    return None
