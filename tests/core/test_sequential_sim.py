"""The promise of `repeats = "auto"` proved by simulation (issue 31): thousands of simulated card sessions
with known noise, driven through the planned looks with runner.plan.sequential's own arithmetic
(`interval_logs`, `levels`, `looks`, NOISE_FLOOR, ALPHA) on numpy arrays — the chance that any look misses the
true ratio stays at most ALPHA, so a ratio exactly on the limit is decided at most ALPHA of the time; and the
pooled noise decides a clear ratio from fewer sends than the one-cell Welch interval it replaced.

A simulated session: `workloads` reference counts served, `seeds` steps each, one timed send per step (auto's
first pass); the compared cell is one workload per side and climbs the levels, the offload side first
((1,1), (2,1), (2,2), (4,2), … (max,max)). Noise is log-normal (sd `sigma` of log wall time per side), or
heavy-tailed (Student's t with 3 degrees of freedom), or the issue's uniform ±60 % wall times. Fixed seeds:
the figures are the same on every run; docs/benchmarks.md has them (`python -m tests.core.test_sequential_sim`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runner.plan import sequential

TRIALS = 20_000


@dataclass(frozen=True)
class Shape:
    seeds: int  # steps per workload (one fixture)
    off_workloads: int  # reference counts the offload session serves (its pooled noise)
    def_workloads: int
    max_repeats: int = 8


SEED = Shape(seeds=4, off_workloads=4, def_workloads=3)  # matrix.toml: seeds 2301-2304, counts 1-4
LOCAL = Shape(seeds=2, off_workloads=4, def_workloads=2)  # examples/local.toml's cpu-tight


def states(max_repeats: int) -> list[tuple[int, int]]:
    """(offload level, default level) at each planned look, the offload side first."""
    lv = sequential.levels(max_repeats)
    out, i, j = [(lv[0], lv[0])], 0, 0
    while i < len(lv) - 1 or j < len(lv) - 1:
        if i <= j and i < len(lv) - 1:
            i += 1
        else:
            j += 1
        out.append((lv[i], lv[j]))
    assert len(out) == sequential.looks(max_repeats)
    return out


def _draw(rng: np.random.Generator, noise: str, size: tuple[int, ...], sigma: float) -> np.ndarray:
    """log wall times around 0."""
    if noise == "lognormal":
        return rng.normal(0.0, sigma, size)
    if noise == "t3":  # heavy tails, scaled to the same sd
        return rng.standard_t(3, size) * sigma / np.sqrt(3.0)
    if noise == "uniform60":  # wall times uniform on ±60 % of their centre (issue 31's card), centred in log
        logs = np.log(rng.uniform(0.4, 1.6, size))
        return logs - _uniform60_mean()
    raise ValueError(noise)


def _uniform60_mean() -> float:
    a, b = 0.4, 1.6
    return float((b * np.log(b) - b - a * np.log(a) + a) / (b - a))  # E log U(a, b)


def simulate(shape: Shape, log_ratio: float, log_limit: float, sigma_off: float, sigma_def: float,
             noise: str = "lognormal", pooled: bool = True, trials: int = TRIALS, seed: int = 0
             ) -> dict[str, float]:
    """Every trial through every planned look: the share decided (and decided wrongly), the share where any
    look's interval misses the true log ratio, and the median timed sends of the two cells at the decision."""
    rng = np.random.default_rng(seed)
    top = shape.max_repeats
    s = shape.seeds
    looks = sequential.looks(top)
    confidence = 1 - sequential.ALPHA / looks
    # the compared cells' sends at the most repeats, (trials, seeds, top); each look takes the first `level`
    off = log_ratio + _draw(rng, noise, (trials, s, top), sigma_off)
    ref = _draw(rng, noise, (trials, s, top), sigma_def)
    # the sessions' other workloads: one send per step, around their own mean
    def other_ss(n_work: int, sigma: float) -> tuple[np.ndarray, int]:
        if n_work <= 1:
            return np.zeros(trials), 0
        x = _draw(rng, noise, (trials, n_work - 1, s), sigma)
        return ((x - x.mean(axis=2, keepdims=True)) ** 2).sum(axis=(1, 2)), (n_work - 1) * (s - 1)
    off_ss, off_df0 = other_ss(shape.off_workloads, sigma_off)
    ref_ss, ref_df0 = other_ss(shape.def_workloads, sigma_def)
    decided = np.zeros(trials, bool)
    wrong = np.zeros(trials, bool)
    missed = np.zeros(trials, bool)
    sends = np.full(trials, float(s * 2 * top))
    for lo, ld in states(top):
        a, b = off[:, :, :lo].reshape(trials, -1), ref[:, :, :ld].reshape(trials, -1)
        d = a.mean(axis=1) - b.mean(axis=1)
        if pooled:  # the session's noise: every workload around its own mean, floored
            va_ss = off_ss + ((a - a.mean(axis=1, keepdims=True)) ** 2).sum(axis=1)
            vb_ss = ref_ss + ((b - b.mean(axis=1, keepdims=True)) ** 2).sum(axis=1)
            dfa, dfb = off_df0 + a.shape[1] - 1, ref_df0 + b.shape[1] - 1
            if dfa == 0 or dfb == 0:
                continue
            va = np.maximum(va_ss / dfa, sequential.NOISE_FLOOR**2) / a.shape[1]
            vb = np.maximum(vb_ss / dfb, sequential.NOISE_FLOOR**2) / b.shape[1]
        else:  # before issue 31: Welch on the two cells alone
            if a.shape[1] < 2 or b.shape[1] < 2:
                continue
            va, vb = a.var(axis=1, ddof=1) / a.shape[1], b.var(axis=1, ddof=1) / b.shape[1]
            dfa, dfb = a.shape[1] - 1, b.shape[1] - 1
        with np.errstate(divide="ignore", invalid="ignore"):
            low, high = sequential.interval_logs(d, va, dfa, vb, dfb, confidence)
        low, high = np.nan_to_num(low, nan=-np.inf), np.nan_to_num(high, nan=np.inf)
        missed |= (low > log_ratio) | (high < log_ratio)
        now = ~decided & ((high <= log_limit) | (low > log_limit))
        wrong |= now & ((high <= log_limit) != (log_ratio <= log_limit))
        sends[now] = s * (lo + ld)
        decided |= now
    return {"decided": float(decided.mean()), "wrong": float(wrong.mean()), "missed": float(missed.mean()),
            "median_sends": float(np.median(sends)), "undecided": float(1 - decided.mean())}


def test_a_ratio_on_the_limit_is_decided_at_most_alpha_of_the_time() -> None:
    at = np.log(2.5)
    for shape, sd_off, sd_def in ((SEED, 0.05, 0.05), (LOCAL, 0.3, 0.1), (LOCAL, 0.02, 0.02)):
        r = simulate(shape, at, at, sd_off, sd_def)
        assert r["decided"] <= sequential.ALPHA, (shape, r)
        assert r["missed"] <= sequential.ALPHA, (shape, r)


def test_heavy_tailed_noise_keeps_the_promise() -> None:
    at = np.log(2.5)
    for shape in (SEED, LOCAL):
        r = simulate(shape, at, at, 0.15, 0.15, noise="t3", seed=1)
        assert r["decided"] <= sequential.ALPHA, (shape, r)


def test_the_issues_noisy_offload_is_not_called_too_slow() -> None:
    # Issue 31: offload 0.5 s ± 60 % (uniform) against a 0.2 s default, limit 2.5: the ratio of geometric
    # means is ≈ 2.33; one of three real runs said not-built. The verdict "over 2.5" is a miss.
    true = np.log(0.5 / 0.2) + _uniform60_mean()
    assert 2.2 < np.exp(true) < 2.45
    r = simulate(Shape(seeds=3, off_workloads=4, def_workloads=2), true, np.log(2.5), 0.0, 0.02,
                 noise="uniform60", seed=2)
    assert r["wrong"] <= sequential.ALPHA, r


def test_a_clear_ratio_is_decided_from_fewer_sends_than_before() -> None:
    clear = (np.log(1.2), np.log(3.0))  # examples/local.toml's cpu-tight: ≈ 1.2 against a limit of 3
    before = simulate(LOCAL, *clear, 0.15, 0.15, pooled=False, trials=4000)
    after = simulate(LOCAL, *clear, 0.15, 0.15, trials=4000)
    assert after["median_sends"] < before["median_sends"]
    assert after["median_sends"] == LOCAL.seeds * 2  # decided at the first look: one send a step
    assert after["wrong"] <= sequential.ALPHA


def main() -> None:
    """The figures docs/benchmarks.md quotes."""
    at = np.log(2.5)
    rows = [("at the limit, seed shape, log-normal sd 0.05", SEED, at, at, 0.05, 0.05, "lognormal"),
            ("at the limit, local shape, sd 0.3 / 0.1", LOCAL, at, at, 0.3, 0.1, "lognormal"),
            ("at the limit, seed shape, t(3) sd 0.15", SEED, at, at, 0.15, 0.15, "t3"),
            ("at the limit, local shape, t(3) sd 0.15", LOCAL, at, at, 0.15, 0.15, "t3"),
            ("issue 31's card (2.33 vs 2.5, ±60 % uniform)", Shape(3, 4, 2), np.log(2.5) + _uniform60_mean(), at,
             0.0, 0.02, "uniform60"),
            ("clear: 1.2 vs 3, local shape, sd 0.15", LOCAL, np.log(1.2), np.log(3.0), 0.15, 0.15, "lognormal"),
            ("clear: 1.3 vs 2.5, seed shape, sd 0.1", SEED, np.log(1.3), at, 0.1, 0.1, "lognormal"),
            ("near: 2.0 vs 2.5, local shape, sd 0.1", LOCAL, np.log(2.0), at, 0.1, 0.1, "lognormal")]
    print(f"{TRIALS} simulated sessions per row, ALPHA = {sequential.ALPHA}, max_repeats 8 (7 looks)")
    print("| case | before: decided / wrong / any look missed / median sends | after: the same |")
    print("|---|---|---|")
    for name, shape, r, lim, so, sd, noise in rows:
        cells = []
        for pooled in (False, True):
            x = simulate(shape, r, lim, so, sd, noise, pooled=pooled)
            cells.append(f"{100 * x['decided']:.1f}% / {100 * x['wrong']:.2f}% / {100 * x['missed']:.2f}% / "
                         f"{x['median_sends']:.0f}")
        print(f"| {name} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
