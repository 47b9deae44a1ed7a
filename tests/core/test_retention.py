"""What a request leaves behind, and cached against cold, on records of simulated servers (the pure stage):
a server that keeps R per distinct reference and is faster on a repeat, one that leaks L per request, one that
frees everything; a whole-device source whose floor only follows the allocator's cache. The same shapes come
from the real reference server in tests/e2e/test_retention_e2e.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from runner.core.records import Level, Peak, RetentionProbe, SendTime, Status, StepRecord
from runner.judge.findings.retention import cached_speed, probe_step, retention
from runner.judge.verdict_text import retention_sentence

MIB = 2**20
LOAD = 400 * MIB
ORDER = [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (3, 2), (4, 1), (4, 2)]  # the matrix's order: count, seed


def level(source: str, value: int, bound: str = "exact") -> Level:
    return Level(source=source, bytes=value, samples=6, window_s=0.3, bound=bound, available=True)  # type: ignore[arg-type]


def session(floor: Callable[[int, int, int], int], wall: Callable[[int, bool], float], *, source: str = "server",
            bound: str = "exact", peak: Callable[[int], int] | None = None, sends: int = 1,
            order: list[tuple[int, int]] = ORDER) -> list[StepRecord]:
    """The records of one start sending ORDER: `floor(distinct, sent, refs)` the level after each request,
    `wall(refs, cached)` each send's seconds, `peak(refs)` the request's peak on the floor's source."""
    out, seen, sent, before = [], set(), 0, LOAD
    for i, (n, seed) in enumerate(order):
        refs = [f"ref{k}" for k in range(1, n + 1)]
        cached = all(r in seen for r in refs)
        seen.update(refs)
        sent += sends
        after = LOAD + floor(len(seen), sent, n)
        times = tuple(SendTime(started_at=10.0 * i + k, wall_s=wall(n, cached or k > 0), timed=True)
                      for k in range(sends))
        peaks = () if peak is None else (Peak(source=source, metric="device", bytes=peak(n), samples=5,
                                              rate_hz=20.0, available=True),)
        out.append(StepRecord(key=f"c/f/refs-{n}/x-seed-{seed}", card="c", flags="f", role="default", fixture="x",
                              references=n, seed=seed, status=Status.OK, started_at=10.0 * i, wall_s=times[0].wall_s,
                              sends=times, request={"references": refs}, peaks=peaks,
                              floor_before=(level(source, before, bound),), floor_after=(level(source, after, bound),)))
        before = after
    return out


def test_a_cross_request_cache_is_read_per_distinct_reference_and_faster_cached() -> None:
    r_bytes = 700 * MIB  # the seed's Diffusers keeps ~2.8 GiB per reference; a quarter of it here
    steps = session(lambda d, s, n: d * r_bytes + (s % 3) * 64 * 1024,  # allocator rounding on top
                    lambda n, cached: (1.0 + 0.5 * n) / (1.9 if cached else 1.0), sends=2)
    r = retention(steps, capacity_bytes=24 * 2**30)
    assert r is not None and r.kind == "per-reference", r
    assert r.per_bytes == pytest.approx(r_bytes, rel=0.1) and r.bound == "exact" and r.points == 8
    assert r.fills_card_at == (24 * 2**30 - LOAD) // r.per_bytes  # 34 distinct references
    assert list(r.also) == ["until-next-request"]  # ascending order: the last request carried every reference seen
    speed = cached_speed(steps)
    assert speed is not None and speed.faster and speed.ratio == pytest.approx(1.9, rel=0.1), speed
    line = retention_sentence("retain", r, speed)
    assert line is not None and "keeps 700.02 MiB per distinct reference sent" in line
    assert "runs 1.90× faster (cold / cached, the median over 3 reference count(s); medians cold " in line
    assert "would fill the card at 34 distinct references" in line


def test_a_leak_is_read_per_request_whatever_it_carries() -> None:
    leak = 48 * MIB
    steps = session(lambda d, s, n: s * leak, lambda n, cached: 1.0 + 0.5 * n)
    r = retention(steps, capacity_bytes=24 * 2**30)
    assert r is not None and r.kind == "per-request" and r.per_bytes == pytest.approx(leak, rel=0.1), r
    speed = cached_speed(steps)
    assert speed is not None and not speed.faster and speed.ratio == pytest.approx(1.0, abs=0.01)
    line = retention_sentence("leaky", r, speed)
    assert line is not None and "keeps 48.00 MiB per request sent, whatever it carries" in line
    assert "nothing is reused" not in line  # said only where everything is freed
    # the ratio said is the median of the per-count ratios; the two medians beside it are named as medians
    assert f"is no faster (cold / cached {speed.ratio:.2f}, the median over {speed.pairs} reference count(s); " \
           f"medians cold " in line


def test_a_server_that_frees_everything_says_so_and_no_faster() -> None:
    steps = session(lambda d, s, n: (s % 2) * 100 * 1024, lambda n, cached: 1.0 + 0.5 * n)
    r = retention(steps, capacity_bytes=None)
    assert r is not None and r.kind == "freed" and r.load_bytes == LOAD, r
    line = retention_sentence("default", r, cached_speed(steps))
    assert line is not None and line.startswith("'default': freed at request end")
    assert "no faster" in line and "nothing is reused across requests" in line


def test_a_whole_device_floor_that_follows_the_largest_request_is_an_upper_bound_not_retention() -> None:
    # NVML after requests of 1..4 references: the allocator keeps the largest request's blocks reserved
    steps = session(lambda d, s, n: n * 300 * MIB, lambda n, cached: 1.0, source="nvml", bound="upper-bound",
                    peak=lambda n: LOAD + n * 300 * MIB)
    r = retention(steps, capacity_bytes=24 * 2**30)
    assert r is not None and r.kind == "cannot-tell" and r.bound == "upper-bound", r
    assert r.why is not None and "largest request so far" in r.why
    line = retention_sentence("default", r, None)
    assert line is not None and "an upper bound" in line and "1.17 GiB above the load level" in line


def test_a_whole_device_floor_that_grows_on_repeats_is_retention() -> None:
    leak = 96 * MIB
    steps = session(lambda d, s, n: s * leak, lambda n, cached: 1.0, source="nvml", bound="upper-bound",
                    peak=lambda n: LOAD + 10 * 2**30)
    r = retention(steps, capacity_bytes=None)
    assert r is not None and r.kind == "per-request" and r.bound == "upper-bound"


def test_one_request_cannot_tell() -> None:
    steps = session(lambda d, s, n: 0, lambda n, cached: 1.0)[:1]
    r = retention(steps, capacity_bytes=None)
    assert r is not None and r.kind == "cannot-tell" and r.why is not None and "2 are needed" in r.why


def test_no_floor_no_finding() -> None:
    steps = [s.model_copy(update={"floor_before": (), "floor_after": ()})
             for s in session(lambda d, s, n: 0, lambda n, cached: 1.0)]
    assert retention(steps, capacity_bytes=None) is None


def probe_after(steps: list[StepRecord], level_after: int) -> RetentionProbe:
    return RetentionProbe(key=steps[0].key, references=1, attempt=0, started_at=100.0, wall_s=1.0, served=True,
                          floor_after=(level("server", LOAD + level_after),))


def test_the_probe_tells_the_last_requests_references_from_a_cache_of_every_reference() -> None:
    # vLLM-Omni 0.30.0 on the stand: each reference of the last request stays until the next (12.3 MiB each)
    per = 12 * MIB
    steps = session(lambda d, s, n: n * per, lambda n, cached: 1.0)
    assert probe_step(steps, None) is steps[0]  # ascending order: the records cannot tell, so ask
    r = retention(steps, None, probe_after(steps, per + 300 * 1024))
    assert r is not None and r.kind == "until-next-request" and not r.also, r
    assert r.fills_card_at is None and r.probe_floor_bytes == LOAD + per + 300 * 1024
    line = retention_sentence("default", r, None)
    assert line is not None and "per reference of the last request until the next one" in line
    assert "the 1 ref request left 412.29 MiB" in line
    # a cache of every distinct reference: the level stays where the last request left it
    kept = retention(steps, 64 * 2**30, probe_after(steps, 4 * per))
    assert kept is not None and kept.kind == "per-reference" and not kept.also
    assert kept.fills_card_at is not None
    # a probe that lands between the two says nothing
    unsure = retention(steps, None, probe_after(steps, 2 * per + per // 2))
    assert unsure is not None and unsure.kind == "per-reference" and "until-next-request" in unsure.also


ONE_SEED = [(1, 1), (2, 1), (3, 1), (4, 1)]  # every request brings exactly one new reference


def test_a_leak_where_every_request_brings_one_new_reference_is_told_by_the_probe() -> None:
    # The H100 run (docs/evidence/h200-retention): one seed, two sends a step, a 512 MiB leak per request: the
    # levels grow 1 GiB a step, one new reference a step; per reference, until the next and per request all fit
    leak = 512 * MIB
    steps = session(lambda d, s, n: s * leak, lambda n, cached: 1.0, sends=2, order=ONE_SEED)
    r = retention(steps, None)
    assert r is not None and r.kind == "per-reference" and r.per_bytes == pytest.approx(2 * leak, rel=0.01), r
    assert r.also == {"per-request": pytest.approx(leak, rel=0.01), "until-next-request": r.per_bytes}, r.also
    assert probe_step(steps, None) is steps[0]
    line = retention_sentence("leak", r, None)
    assert line is not None and "512.00 MiB kept per request sent, whatever it carries (a leak)" in line
    # the probe (the first request once more) grows by one more leak: per request, whatever the order said
    last = 8 * leak
    told = retention(steps, 40 * 2**30, probe_after(steps, last + leak + 100 * 1024))
    assert told is not None and told.kind == "per-request" and not told.also, told
    assert told.per_bytes == pytest.approx(leak, rel=0.01)
    assert told.fills_card_at == (40 * 2**30 - LOAD) // told.per_bytes
    line = retention_sentence("leak", told, None)
    assert line is not None and "keeps 512.00 MiB per request sent" in line
    assert "one request more, one leak more" in line
    # a cache of every reference: the probe's level stays at the last; kept until the next: back to its own
    cache = session(lambda d, s, n: d * 1600 * MIB, lambda n, cached: 1.0, sends=2, order=ONE_SEED)
    kept = retention(cache, None, probe_after(cache, 4 * 1600 * MIB))
    assert kept is not None and kept.kind == "per-reference" and not kept.also
    back = retention(cache, None, probe_after(cache, 1600 * MIB))
    assert back is not None and back.kind == "until-next-request"


def test_no_probe_where_the_records_already_tell() -> None:
    freed = session(lambda d, s, n: 0, lambda n, cached: 1.0)
    leak = session(lambda d, s, n: s * 48 * MIB, lambda n, cached: 1.0)
    assert probe_step(freed, None) is None and probe_step(leak, None) is None


def test_a_flag_set_whose_level_grew_gets_a_kept_pass_and_its_snapshot_names_what_stays() -> None:
    from runner.judge.findings.held import Reading
    from runner.judge.findings.retention import with_kept
    from runner.observe.snapshot import Held, Site
    from runner.plan.lanes import Session
    from runner.run.diagnose import targets

    steps = session(lambda d, s, n: d * 700 * MIB, lambda n, cached: 1.0)
    (kept,) = targets("oom", Session("c", "f", ()), steps, None, 4)  # nothing ran out: only the kept pass
    assert (kept.at, kept.step.references if kept.step else None) == ("kept", 4)
    freed = session(lambda d, s, n: 0, lambda n, cached: 1.0)
    assert targets("oom", Session("c", "f", ()), freed, None, 4) == []
    assert targets("off", Session("c", "f", ()), steps, None, 4) == []
    sites = (Site("diffusers/cache.py:88", "store", "request", 4 * 700 * MIB, 4),
             Site("runner/refserver/engine.py:10", "step", "request", 3 * MIB, 1),
             Site("diffusers/transformer.py:5", "load", "resident", 9 * 2**30, 400))
    held = Held(at="snapshot", exact="segments", active_bytes=0, resident_bytes=9 * 2**30, request_bytes=0,
                inactive_bytes=0, reserved_bytes=0, segments=1, blocks=405, tried_bytes=None, frames=True,
                by_site=sites)
    r = with_kept(retention(steps, None), [Reading("c/f", "kept", 4, "c/f/diagnosis/kept/s.pickle", held, None)])
    assert r is not None and r.kept_bytes == 4 * 700 * MIB + 3 * MIB and r.kept_references == 4
    assert [s.site for s in r.kept_sites] == ["diffusers/cache.py:88", "runner/refserver/engine.py:10"]
    line = retention_sentence("retain", r, None)
    assert line is not None and "left 2.74 GiB it allocated live at its end (700.75 MiB per reference)" in line
    assert "2.73 GiB at <code>diffusers/cache.py:88</code> in <code>store</code>" in line
    nothing = with_kept(retention(steps, None), [Reading("c/f", "kept", 4, None, None, "no allocator snapshot: x")])
    assert nothing is not None and nothing.kept_why == "no allocator snapshot: x"


def test_one_reference_count_does_not_tell_whether_cached_is_faster() -> None:
    """examples/local.toml's fp8-collapse and int8 served 1 ref only past the warm-up: one cold send against its
    cached ones said "runs 1.22× faster" on a CPU's noise. One pair decides nothing, either way."""
    steps = session(lambda d, s, n: 0, lambda n, cached: 1.0 / (1.5 if cached else 1.0), sends=2,
                    order=[(1, 1), (2, 1), (2, 2)])
    speed = cached_speed(steps)
    assert speed is not None and speed.pairs == 1 and speed.ratio == pytest.approx(1.5), speed
    assert not speed.faster and not speed.slower
    line = retention_sentence("f", retention(steps, capacity_bytes=None), speed)
    assert line is not None and "faster is not told by one reference count (cold 1.00 s, cached 0.67 s)" in line, line
    assert "runs 1.50× faster" not in line and "no faster" not in line
