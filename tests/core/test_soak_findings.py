"""The soak's findings, pure (runner.judge.findings.soak): the drift fit (slope, 95 % interval, "not
distinguishable from 0", one intercept per server start and reference count) checked against an independent
least-squares fit; what a soaked flag set's records make of its failure, levels, peaks and latency; which flag sets
profiles.json makes soak-able; each profile's soak outcome in words."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats
from soak_records import MIB, oom, request, series, soak_record

from runner.judge.findings.models import CardProfile, CountProfile, Drift, ProfileEntry
from runner.judge.findings.soak import ABOVE_TOLERANCE, drift, failure_words, flag_soak, outcome_words, profiled_flags

Point = tuple[tuple[int, int], int, float]


def reference_fit(points: list[Point]) -> tuple[float, float, float]:
    """(slope, low, high) by ordinary least squares on a design of one indicator column per group and x, with
    Student's t at 97.5 % on n − p degrees of freedom: the textbook fit `drift` must agree with."""
    groups = sorted({g for g, _, _ in points})
    design = np.array([[1.0 if g == h else 0.0 for h in groups] + [x] for g, x, _ in points])
    y = np.array([v for _, _, v in points])
    beta, *_ = np.linalg.lstsq(design, y, rcond=None)
    dof = len(points) - design.shape[1]
    sigma2 = float(np.sum((y - design @ beta) ** 2)) / dof
    se = (sigma2 * np.linalg.inv(design.T @ design)[-1, -1]) ** 0.5
    half = float(stats.t.ppf(0.975, dof)) * se
    return float(beta[-1]), float(beta[-1]) - half, float(beta[-1]) + half


def noisy(slope: float, n: int, seed: int, *, group: tuple[int, int] = (0, 1), base: float = 1000.0,
          spread: float = 5.0, first: int = 1) -> list[Point]:
    rng = np.random.default_rng(seed)
    return [(group, x, base + slope * x + float(rng.normal(0, spread))) for x in range(first, first + n)]


def test_drift_is_the_least_squares_slope_with_its_95_percent_interval() -> None:
    points = noisy(3.0, 30, seed=1)
    d = drift(points)
    line = stats.linregress([x for _, x, _ in points], [y for _, _, y in points])
    half = stats.t.ppf(0.975, len(points) - 2) * line.stderr
    assert d is not None and d.points == 30
    assert d.per_request == pytest.approx(line.slope, rel=1e-9)
    assert (d.low, d.high) == (pytest.approx(line.slope - half, rel=1e-9), pytest.approx(line.slope + half, rel=1e-9))
    assert d.low is not None and d.low > 0 and d.distinguishable  # 3 per request stands out of a spread of 5


def test_a_level_that_only_wanders_is_not_distinguishable_from_0() -> None:
    points = noisy(0.0, 30, seed=2)
    d = drift(points)
    assert d is not None and d.low is not None and d.high is not None
    assert d.low < 0 < d.high and not d.distinguishable
    assert d.per_request == pytest.approx(reference_fit(points)[0], rel=1e-9)


def test_the_fit_is_within_each_server_start_and_reference_count() -> None:
    """A 4-reference request sits higher than a 1-reference one, and a resumed soak's fresh server starts lower
    than the last one ended: neither is drift. Each (start, count) gets its own intercept and only what grows
    from request to request within one moves the slope."""
    per_request = 2.0
    points: list[Point] = []
    for n in range(1, 41):
        attempt, refs = (0 if n <= 20 else 1), (1 if n % 2 else 4)
        start_level = 100.0 if attempt == 0 else 40.0  # the restart frees what the first start had grown
        points.append(((attempt, refs), n, start_level + 300.0 * refs + per_request * (n - (20 if attempt else 0))))
    pooled = np.polyfit([x for _, x, _ in points], [y for _, _, y in points], 1)[0]
    assert abs(pooled - per_request) > 1.0  # one line over everything would misread it
    d = drift(points)
    assert d is not None and d.per_request == pytest.approx(per_request, rel=1e-9) and d.distinguishable
    flat = [(g, x, y - per_request * (x - (20 if g[0] else 0))) for g, x, y in points]
    still = drift(flat)
    assert still is not None and still.per_request == pytest.approx(0.0, abs=1e-9) and not still.distinguishable


def test_grouped_noisy_drift_agrees_with_a_fit_of_indicator_columns() -> None:
    points = [*noisy(1.5, 12, seed=3, group=(0, 1)), *noisy(1.5, 12, seed=4, group=(0, 2), base=3000.0),
              *noisy(1.5, 9, seed=5, group=(1, 1), base=600.0, first=13)]
    d = drift(points)
    slope, low, high = reference_fit(points)
    assert d is not None and d.points == 33
    assert (d.per_request, d.low, d.high) == (pytest.approx(slope, rel=1e-9), pytest.approx(low, rel=1e-9),
                                              pytest.approx(high, rel=1e-9))


def test_no_drift_where_no_group_has_two_requests() -> None:
    assert drift([]) is None
    assert drift([((0, 1), 1, 10.0), ((0, 2), 2, 20.0), ((1, 1), 3, 5.0)]) is None  # one request per group


def test_too_few_requests_for_an_interval_give_a_slope_without_one() -> None:
    d = drift([((0, 1), 1, 10.0), ((0, 1), 2, 14.0), ((0, 2), 3, 50.0)])  # 3 points, 2 groups: 0 dof
    assert d == Drift(per_request=4.0, low=None, high=None, points=3, distinguishable=False)


# --- a soaked flag set's findings from its records ------------------------------------------------------------------

def test_a_leak_reads_as_floor_and_peak_drift_and_the_requests_left_to_the_capacity() -> None:
    leak, capacity = 1 * MIB, 300 * MIB
    reqs = series(range(1, 12), counts=(1, 2), floor=lambda n, refs, a: 50 * MIB + leak * n,
                  peak=lambda n, refs, a: 100 * MIB * refs + leak * n)
    f = flag_soak(soak_record(requests=11, stopped="requests", references=(1, 2)), reqs, capacity)
    assert (f.outcome, f.sent, f.served, f.starts, f.failure) == ("held", 11, 11, 1, None)
    assert (f.floor_source, f.floor_bound) == ("server", "exact")
    assert (f.first_floor_bytes, f.last_floor_bytes) == (50 * MIB + leak, 50 * MIB + 11 * leak)
    assert f.floor_drift is not None and f.floor_drift.per_request == pytest.approx(leak)
    assert f.peak_drift is not None and f.peak_drift.per_request == pytest.approx(leak) and f.peak_drift.distinguishable
    assert f.highest_peak_bytes == 200 * MIB + 10 * leak
    # the last round's highest peak (request 10, 2 refs: 210 MiB; request 11 sent 1) reaches 300 MiB after 90 more
    assert f.to_capacity == (capacity - (200 * MIB + 10 * leak)) // leak == 90


def test_latency_p50_p95_max_and_its_drift() -> None:
    walls = [0.8 + 0.05 * n + (0.3 if n % 3 == 0 else 0.0) for n in range(1, 21)]
    reqs = series(range(1, 21), wall=lambda n, refs: walls[n - 1])
    f = flag_soak(soak_record(requests=20, stopped="requests"), reqs, None)
    assert f.latency_p50_s == pytest.approx(np.median(walls), abs=1e-4)
    assert f.latency_p95_s == pytest.approx(np.percentile(walls, 95), abs=1e-4)  # linear between order statistics
    assert f.latency_max_s == pytest.approx(max(walls))
    # the first request brought its reference (a cache's warm-up, not creep): the drift is read over 2..20
    slope, low, high = reference_fit([((0, 1), n, w) for n, w in enumerate(walls, start=1) if n > 1])
    d = f.latency_drift
    assert d is not None and d.distinguishable and (d.per_request, d.low, d.high) == (
        pytest.approx(slope), pytest.approx(low), pytest.approx(high))


def test_a_cache_that_fills_once_is_no_drift_and_a_leak_after_it_is() -> None:
    """Retain's soak (examples/local.toml): the level grows while references arrive (requests 1-4 of a cycle of
    1-4 references), then stays. Read over every request it was a drift that 'reaches the card within 76 more
    requests'; over the requests that brought nothing new it is none. A leak still drifts there."""
    cache = series(range(1, 13), counts=(1, 2, 3, 4), floor=lambda n, refs, a: 10 * MIB + min(n, 4) * 256 * 1024)
    f = flag_soak(soak_record(requests=12, stopped="requests", references=(1, 2, 3, 4)), cache, None)
    assert f.floor_drift is not None and f.floor_drift.per_request == 0 and f.floor_drift.points == 8
    leak = series(range(1, 13), counts=(1, 2, 3, 4), floor=lambda n, refs, a: 10 * MIB + n * MIB)
    f = flag_soak(soak_record(requests=12, stopped="requests", references=(1, 2, 3, 4)), leak, None)
    assert f.floor_drift is not None and f.floor_drift.per_request == pytest.approx(MIB)


def test_no_distance_to_the_capacity_without_a_drift_that_stands_out() -> None:
    reqs = series(range(1, 31), peak=lambda n, refs, a: 100 * MIB + (MIB if n % 2 else 0))
    f = flag_soak(soak_record(requests=30, stopped="requests"), reqs, 300 * MIB)
    assert f.peak_drift is not None and not f.peak_drift.distinguishable and f.to_capacity is None


def test_a_failure_names_its_request_and_the_floor_it_started_from_above_its_starts_first() -> None:
    """The failing request of a resumed soak (its second server start): the floor above the first request's is
    measured on the same start, from the request before it, not from the soak's very first request."""
    floors = {1: 10, 2: 12, 3: 14, 4: 16, 5: 11, 6: 14, 7: 17}  # MiB; requests 5.. on a fresh start
    reqs = series(range(1, 8), attempt=lambda n: 0 if n <= 4 else 1, floor=lambda n, refs, a: floors[n] * MIB)
    reqs.append(request(8, attempt=1, failure=oom()))
    f = flag_soak(soak_record(requests=200, stopped="failure", starts=2), reqs, 64 * MIB)
    assert (f.outcome, f.sent, f.served, f.starts) == ("failed", 8, 7, 2)
    x = f.failure
    assert x is not None and (x.number, x.references, x.kind) == (8, 1, "oom")
    assert (x.site, x.function, x.memory) == ("vllm_omni/diffusion/models/qwen_image/pipeline.py:737", "forward",
                                              "device")
    assert x.floor_above_first_bytes == (17 - 11) * MIB
    assert x.server_says == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 MiB"
    assert failure_words(f) == ("failed at request 8 of 200: out of memory in "
                                "`vllm_omni/diffusion/models/qwen_image/pipeline.py:737` (`forward`) with the floor "
                                "6.00 MiB above the first request's")
    assert failure_words(f, short=True) == "failed at request 8 of 200: out of memory"
    assert outcome_words(f) == "failed at request 8"


def test_a_failure_at_the_first_request_of_a_start_has_no_floor_to_compare() -> None:
    reqs = [*series(range(1, 4), floor=lambda n, refs, a: 10 * MIB), request(4, attempt=1, failure=oom())]
    f = flag_soak(soak_record(requests=9, stopped="failure", starts=2), reqs, None)
    assert f.failure is not None and f.failure.number == 4 and f.failure.floor_above_first_bytes is None
    assert failure_words(f) is not None and "above the first request's" not in (failure_words(f) or "")


def test_the_outcomes_in_profiles_json() -> None:
    served = series(range(1, 5))
    held = flag_soak(soak_record(requests=4, stopped="requests"), served, None)
    by_minutes = flag_soak(soak_record(requests=200, minutes=0.5, stopped="minutes"), served, None)
    cut = flag_soak(soak_record(requests=12, stopped="interrupted"), served, None)
    never = flag_soak(soak_record(requests=12, stopped="start failed", why="load_exit: the server exited (code 1)"),
                      [], None)
    assert [f.outcome for f in (held, by_minutes, cut, never)] == ["held", "held", "incomplete", "not run"]
    assert outcome_words(held) == outcome_words(by_minutes) == "held 4 requests"
    assert outcome_words(cut) == "incomplete: 4 of 12 requests (a resume continues it)"
    assert outcome_words(never) == "not soaked: load_exit: the server exited (code 1)"
    assert outcome_words(None) == "not soaked"
    assert failure_words(held) is None


# --- which flag sets profiles.json makes soak-able ---------------------------------------------------------------

def entry(flags: str) -> ProfileEntry:
    return ProfileEntry(flags=flags, role="default", peak_bytes=None, peak_source=None, headroom_bytes=None,
                        wall_s=None, psnr_db=None)


def profile(**serve: tuple[str, ...]) -> CardProfile:
    """`refs1=("a", "b")`: at 1 reference profiles.json lists a then b (fastest first)."""
    return CardProfile(card="c", capacity_bytes=None, counts=tuple(
        CountProfile(references=int(k.removeprefix("refs")), serve=tuple(entry(f) for f in v),
                     excluded={"slow": "too slow"}) for k, v in serve.items()))


def test_a_flag_set_is_soak_able_where_profiles_json_lists_it_at_every_count_the_soak_mixes() -> None:
    p = profile(refs1=("host-cache", "default", "cpu-offload"), refs2=("default", "host-cache"), refs3=("default",))
    assert profiled_flags(p, (1, 2, 3)) == ("default",)
    assert profiled_flags(p, (1, 2)) == ("host-cache", "default")  # profiles.json's first listing decides the order
    assert profiled_flags(p, (1,)) == ("host-cache", "default", "cpu-offload")
    assert profiled_flags(p, (3, 4)) == ()  # nothing serves 4 references
    assert "slow" not in profiled_flags(p, (1,))  # served but too slow: not listed, not soaked


def test_a_request_that_peaks_above_its_matrix_cell_in_service_is_named_with_the_level_it_started_from() -> None:
    """The real vLLM-Omni 0.30.0 (docs/evidence/stand-soak): it keeps the last request's references until the next
    one, so in service a 1-reference request after a 4-reference one peaks 36.75 MiB above the matrix's 1-reference
    cell. Modelled: each request peaks at its own work plus what the request before it left (R per reference)."""
    work, kept = 150 * MIB, 12 * MIB
    counts = (1, 2, 3, 4)
    reqs = series(range(1, 13), counts=counts, floor=lambda n, refs, a: kept * refs,
                  peak=lambda n, refs, a: work + 25 * MIB * refs + (kept * 4 if refs == 1 and n > 1 else
                                                                     kept * (refs - 1)))
    # the matrix's cells: each count after the same count (two seeds), the first 1-ref request on a fresh start
    cells = {("server", n): work + 25 * MIB * n + kept * (n - 1) for n in counts}
    f = flag_soak(soak_record(requests=12, stopped="requests", references=counts), reqs, None, cells)
    (above,) = f.above_cells
    assert (above.references, above.number) == (1, 5)  # the first 1-ref request after a 4-ref one
    assert above.peak_bytes - above.cell_peak_bytes == 4 * kept and above.level_before_bytes == 4 * kept
    # within the tolerance, or from another source, nothing is named
    near = {k: v + 4 * kept - ABOVE_TOLERANCE[0] for k, v in cells.items()}
    assert not flag_soak(soak_record(requests=12, stopped="requests", references=counts), reqs, None, near).above_cells
    other = {("nvml", n): v for (_, n), v in cells.items()}
    assert not flag_soak(soak_record(requests=12, stopped="requests", references=counts), reqs, None,
                         other).above_cells
