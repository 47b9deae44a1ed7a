"""What a request leaves behind, a pure function of one card × flag set's records: the level each request left
(its `floor_after`) against the level after the load, over one server start's requests in order, and whether a
request whose references were sent before runs faster than one that brings a new reference.

What stays, one of:
- freed: every floor is back at the load level, within the tolerance;
- per reference: the floor grows by R with each distinct reference sent (a cross-request cache). In the matrix's
  order (counts ascending) the references seen so far are also the last request's, so this reads as well "the
  last request's references are kept until the next one" — said where the records cannot tell them apart;
- until the next request: per reference of the last request, told from "per reference" by the retention probe
  (the session's first request sent once more after its last: the level falls back to that request's);
- per request: the floor grows with every request sent, whatever it carries (a leak);
- cannot tell: too few floors, none from a device source, or (a whole-device source only) growth that the
  allocator's cache explains: PyTorch keeps freed blocks reserved, so after requests of 1…4 references a whole-
  device floor climbs to the largest request so far even when nothing is kept.
Each line is a least-squares slope through the load level (x: distinct references, or requests sent), its worst
residual must be within the tolerance; the line with the smaller residual is the finding.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from runner.core.records import Level, RetentionProbe, Status, StepRecord
from runner.judge.findings.held import Reading
from runner.judge.findings.models import MIN_PAIRS, CachedSpeed, HeldSite, Retention

KEEPS = ("per-reference", "until-next-request", "per-request")  # kinds where something stays after a request
KIND = {"distinct": "per-reference", "sent": "per-request"}  # each line's x and the reading it stands for
MIN_TOLERANCE = 256 * 1024  # bytes: below this a floor's change is the allocator's rounding, not a kept tensor
TOLERANCE_SHARE = 0.01  # of the load level
FASTER = 1.15  # a cached request this many times faster than a cold one, in every pair, is "faster"


@dataclass(frozen=True)
class _Point:
    distinct: int  # distinct references sent so far in this start, this request's included
    sent: int  # requests sent so far in this start (each send), this one's included
    floor: int  # the level after it
    peak_so_far: int | None  # the source's highest request peak so far (whole-device sources)
    repeat: bool  # every reference it carried was sent before
    refs: int  # the references it carried


def _refs(s: StepRecord) -> list[str]:
    """The digests of the references a request carried (its record's `request.references`)."""
    return [str(r) for r in s.request.get("references", ())]


def _level(levels: tuple[Level, ...], source: str) -> int | None:
    return next((lv.bytes for lv in levels if lv.source == source and lv.available), None)


def _source(steps: Sequence[StepRecord]) -> Level | None:
    """The source the floors are read from: an exact one where any step has its floor, else an upper bound."""
    seen = [lv for s in steps for lv in (*s.floor_before, *s.floor_after) if lv.available]
    return next((lv for lv in seen if lv.bound == "exact"), seen[0] if seen else None)


def _start(steps: Sequence[StepRecord]) -> list[StepRecord]:
    """The requests of the server start that sent the most, in send order (floors compare within one start)."""
    sent = sorted((s for s in steps if s.status != Status.SKIPPED and s.started_at is not None),
                  key=lambda s: (s.started_at or 0.0, s.key))
    by_attempt: dict[int, list[StepRecord]] = {}
    for s in sent:
        by_attempt.setdefault(s.attempt, []).append(s)
    return max(by_attempt.values(), key=len) if by_attempt else []


def _slope(points: Sequence[_Point], x: str) -> tuple[float, float]:
    """Least squares through the load level (y = slope · x) and the worst residual."""
    xs = [float(getattr(p, x)) for p in points]
    ys = [float(p.floor) for p in points]
    sxx = sum(v * v for v in xs)
    slope = sum(a * b for a, b in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return slope, max(abs(b - slope * a) for a, b in zip(xs, ys, strict=True))


def retention(steps: Sequence[StepRecord], capacity_bytes: int | None,
              probe: RetentionProbe | None = None) -> Retention | None:
    """What stays after a request, from the floors of one start's requests and the retention probe sent after
    them (None: no step has a floor)."""
    start = _start(steps)
    chosen = _source(start)
    if chosen is None:
        return None
    src, bound = chosen.source, chosen.bound
    load = _level(start[0].floor_before, src) if start else None
    common = {"source": src, "bound": bound, "attempt": start[0].attempt if start else 0,
              "quiet_s": chosen.window_s}
    if load is None:
        return Retention(kind="cannot-tell", tolerance_bytes=MIN_TOLERANCE, points=0,
                         why=f"no level after the load from {src}", **common)
    tol = max(MIN_TOLERANCE, int(TOLERANCE_SHARE * load))
    points: list[_Point] = []
    seen: set[str] = set()
    sent, top = 0, None
    for s in start:
        refs = _refs(s)
        repeat = bool(refs) and all(r in seen for r in refs)
        seen.update(refs)
        sent += max(1, len(s.sends))
        peak = next((p.bytes for p in s.peaks if p.source == src and p.available and p.bytes is not None), None)
        top = peak if top is None or (peak is not None and peak > top) else top
        floor = _level(s.floor_after, src)
        if floor is not None:
            points.append(_Point(len(seen), sent, floor - load, top, repeat, len(refs)))
    common |= {"load_bytes": load, "tolerance_bytes": tol, "points": len(points)}
    if len(points) < 2:
        return Retention(kind="cannot-tell", why=f"{len(points)} request(s) with a level after them from {src}; "
                                                 "2 are needed", **common)
    last = points[-1].floor
    common["last_floor_bytes"] = load + last
    if all(abs(p.floor) <= tol for p in points):
        return Retention(kind="freed", **common)
    if bound == "upper-bound" and _cache_explains(points, load, tol):
        return Retention(kind="cannot-tell", why="the floor follows the largest request so far (the allocator "
                                                 "keeps freed blocks reserved): an upper bound of what is kept",
                         **common)
    limit = max(tol, 0.1 * abs(last))
    fits = {KIND[x]: _slope(points, x) for x in ("distinct", "sent")}
    lines = {k: f for k, f in fits.items() if f[1] <= limit and f[0] > 0}
    if not lines:
        worst = int(min(f[1] for f in fits.values()))
        return Retention(kind="cannot-tell", residual_bytes=worst,
                         why="the floors follow neither a line per distinct reference nor one per request "
                             f"(worst residual {worst} bytes)", **common)
    kind = min(lines, key=lambda k: lines[k][1])
    # Lines whose residuals differ by no more than the tolerance fit alike (every request here brought one new
    # reference): the records cannot tell them apart. Nor "per reference" from "until the next request" where
    # every request carried every reference before it (the matrix's ascending order).
    rivals = [k for k in lines if k != kind and lines[k][1] <= lines[kind][1] + tol]
    if "per-reference" in (kind, *rivals) and _distinct_is_last(start):
        rivals.append("until-next-request")
    per = {k: int(lines[_line(k)][0]) for k in (kind, *rivals)}
    own = next((p.floor for p in points if probe is not None and p.refs == probe.references), None)
    # the probe's level is told against the levels' own scatter (the best line's worst residual), not the
    # tolerance: an exact source tells 190 KiB apart where the tolerance is 256 KiB
    scatter = max(int(lines[kind][1]), 4096)
    told = _probed(probe, start[0].attempt, src, load, {k: _predicts(k, per[k], own, last) for k in per},
                   scatter) if rivals else None
    if told is not None:
        kind, probe_floor = told
        common |= {"probe_floor_bytes": load + probe_floor, "probe_references": probe.references if probe else None}
        rivals = []
    room = (capacity_bytes - load) if capacity_bytes is not None else None
    fills = int(room // per[kind]) if room is not None and room > 0 and kind != "until-next-request" else None
    also = {k: per[k] for k in rivals}
    return Retention(kind=kind, per_bytes=per[kind], residual_bytes=int(lines[_line(kind)][1]), fills_card_at=fills,
                     also=also, **common)


def _line(kind: str) -> str:
    """The line a reading stands on ("until the next request" is the per-reference line told by the probe)."""
    return "per-reference" if kind == "until-next-request" else kind


def _predicts(kind: str, per: int, own: int | None, last: int) -> int | None:
    """Where each reading puts the level after the probe (the session's first request sent once more after its
    last): a cache of every distinct reference stays at the last level; the last request's references kept until
    the next fall back to the level the probe's own request left the first time; a leak grows by one more."""
    return {"per-reference": last, "until-next-request": own, "per-request": last + per}[kind]


def _probed(probe: RetentionProbe | None, attempt: int, src: str, load: int, predicted: dict[str, int | None],
            scatter: int) -> tuple[str, int] | None:
    """The reading the probe's level agrees with: the nearest prediction, where it is within a quarter of the
    least gap between two predictions and that quarter is past the levels' scatter; None: it cannot say."""
    if probe is None or not probe.served or probe.attempt != attempt:
        return None
    floor = _level(probe.floor_after, src)
    known = {k: v for k, v in predicted.items() if v is not None}
    if floor is None or len(known) < 2:
        return None
    y = floor - load
    values = sorted(known.values())
    gap = min(b - a for a, b in itertools.pairwise(values))
    kind = min(known, key=lambda k: abs(y - known[k]))
    return (kind, y) if gap / 4 > scatter and abs(y - known[kind]) <= gap / 4 else None


def probe_step(steps: Sequence[StepRecord], capacity_bytes: int | None) -> StepRecord | None:
    """The step to send again after a session's last (the first it served, at the fewest references), where the
    levels read per distinct reference and every request carried all the references before it: only a request
    with fewer references after them tells "every distinct reference stays" from "the last request's stay until
    the next". None where the records already tell (or cannot say anything)."""
    r = retention(steps, capacity_bytes)
    if r is None or not r.also:
        return None
    start = [s for s in _start(steps) if s.status == Status.OK and s.references > 0]
    first = min(start, key=lambda s: (s.references, s.started_at or 0.0), default=None)
    top = max((s.references for s in start), default=0)
    return first if first is not None and first.references < top else None


def _cache_explains(points: Sequence[_Point], load: int, tol: int) -> bool:
    """A whole-device floor that never rises above the largest request so far, and never rises on a request
    that brought nothing new and peaked no higher: the allocator's cache explains it."""
    prev = 0
    for p in points:
        if p.peak_so_far is not None and p.floor + load > p.peak_so_far + tol:
            return False
        if p.repeat and p.floor > prev + tol:
            return False
        prev = p.floor
    return True


def _distinct_is_last(start: Sequence[StepRecord]) -> bool:
    """Every request carried every reference sent before it: 'kept per distinct reference' and 'the last
    request's references kept until the next' predict the same floors."""
    seen: set[str] = set()
    for s in start:
        refs = set(_refs(s))
        if not seen <= refs:
            return False
        seen |= refs
    return True


def cached_speed(steps: Sequence[StepRecord]) -> CachedSpeed | None:
    """Whether a request whose references were all sent before runs faster than the first that brought one, at
    the same reference count: per count, the cold request's first send against the median of the later sends at
    that count (its repeats, the other seeds). The start's first request is left out: its time is the warm-up's."""
    start = _start(steps)
    seen: set[str] = set()
    cold: dict[int, float] = {}
    warm: dict[int, list[float]] = {}
    for i, s in enumerate(start):
        refs = _refs(s)
        walls = [t.wall_s for t in s.sends] or ([s.wall_s] if s.wall_s else [])
        new = bool(refs) and not all(r in seen for r in refs)
        seen.update(refs)
        if s.status != Status.OK or not refs or not walls:
            continue
        if new and s.references not in cold:
            if i > 0:
                cold[s.references] = walls[0]
            warm.setdefault(s.references, []).extend(walls[1:])
        else:
            warm.setdefault(s.references, []).extend(walls)
    pairs = [(cold[n], statistics.median(warm[n])) for n in sorted(cold) if warm.get(n)]
    if not pairs:
        return CachedSpeed(pairs=0, why="no reference count has both a request that brought a new reference "
                                        "(after the first request) and a later one at that count")
    ratios = [c / w for c, w in pairs if w > 0]
    ratio = statistics.median(ratios) if ratios else None
    return CachedSpeed(pairs=len(pairs), cold_s=round(statistics.median(c for c, _ in pairs), 4),
                       cached_s=round(statistics.median(w for _, w in pairs), 4),
                       ratio=None if ratio is None else round(ratio, 3),
                       faster=len(ratios) >= MIN_PAIRS and min(ratios) >= FASTER,
                       slower=len(ratios) >= MIN_PAIRS and max(ratios) <= 1 / FASTER)


KEPT_SITES = 5


def with_kept(r: Retention | None, readings: Sequence[Reading]) -> Retention | None:
    """The retention finding with what the `kept` diagnosis pass's snapshot shows: the blocks its request
    allocated (after /start_profile) that were still live when it ended (/stop_profile), by site."""
    reading = next((x for x in readings if x.at == "kept"), None)
    if r is None or reading is None:
        return r
    if reading.held is None:
        return r.model_copy(update={"kept_references": reading.references, "kept_why": reading.why or "no snapshot"})
    if reading.held.history_full:
        return r.model_copy(update={"kept_references": reading.references, "kept_why": next(
            n for n in reading.held.notes if n.startswith("the allocator's history is full"))})
    live = sorted((s for s in reading.held.by_site if s.phase == "request"), key=lambda s: -s.bytes)
    sites = tuple(HeldSite(site=s.site, function=s.function, phase="request", bytes=s.bytes, blocks=s.blocks,
                           part=s.part) for s in live[:KEPT_SITES])
    return r.model_copy(update={"kept_references": reading.references, "kept_bytes": sum(s.bytes for s in live),
                                "kept_sites": sites})
