"""The soak's findings, a pure function of its records (runner.plan.soak, runner.run.soak): per soaked flag set the
requests served, the first failure (its request number, its class and site, and the level it started from above
the first request's), the drift per request of the level after a request and of a request's peak (least squares
with a 95 % interval; "not distinguishable from 0" when the interval holds 0), and latency p50 / p95 / max and
its drift. Which flag sets a card's soak takes when [soak] names none (profiled_flags), each profile's soak
outcome (outcome_words), and the verdict with its deciding flag set's soak failure named (with_soak).

A drift is fitted within each server start and reference count (its own intercept each), over the served
requests: a mix of counts (a 4-reference request peaks higher than a 1-reference one) and a restart (a resume
starts a fresh server) move no line; only what grows from request to request at the same count does.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace

from runner.core.records import FailureClass, SoakRecord, SoakRequest, Status, StepRecord
from runner.judge.decision import Verdict
from runner.judge.findings.models import AboveCell, CardProfile, CardSoak, Drift, SoakFailure, SoakFindings
from runner.judge.verdict_text import size
from runner.observe.failures import server_lines, without_stamp
from runner.plan.matrix import Soak
from runner.plan.sequential import quantile

CONFIDENCE = 0.95
# An in-service peak above the matrix cell's by more than this (the larger of 1 MiB and 1 % of the cell's) is
# named: less is a figure's own noise between two starts of one server.
ABOVE_TOLERANCE = (2**20, 0.01)


def drift(points: Sequence[tuple[tuple[int, int], int, float]]) -> Drift | None:
    """Least squares y = a_group + b · x over (group, x, y): b with its interval (Student's t on the residuals,
    n − groups − 1 degrees of freedom); None when no group has two different x."""
    groups: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for g, x, y in points:
        groups.setdefault(g, []).append((x, y))
    sxx = sxy = 0.0
    means = {}
    for g, xy in groups.items():
        mx = sum(x for x, _ in xy) / len(xy)
        my = sum(y for _, y in xy) / len(xy)
        means[g] = (mx, my)
        sxx += sum((x - mx) ** 2 for x, _ in xy)
        sxy += sum((x - mx) * (y - my) for x, y in xy)
    if sxx <= 0:
        return None
    slope = sxy / sxx
    dof = len(points) - len(groups) - 1
    if dof < 1:
        return Drift(per_request=slope, points=len(points), distinguishable=False)
    ssr = sum((y - means[g][1] - slope * (x - means[g][0])) ** 2 for g, x, y in points)
    half = float(quantile(dof, CONFIDENCE)) * (ssr / dof / sxx) ** 0.5
    low, high = slope - half, slope + half
    return Drift(per_request=slope, low=low, high=high, points=len(points), distinguishable=not low <= 0 <= high)


def _source(figures: Sequence[tuple[str, str] | None]) -> tuple[str, str] | None:
    """The (source, bound) most requests have a figure from: one source per line."""
    seen = Counter(f for f in figures if f is not None)
    return seen.most_common(1)[0][0] if seen else None


def _floor(r: SoakRequest, source: str) -> int | None:
    lv = r.floor_after
    return lv.bytes if lv is not None and lv.available and lv.source == source else None


def _peak(r: SoakRequest, source: str) -> int | None:
    p = r.peak
    return p.bytes if p is not None and p.available and p.source == source else None


def _percentile(values: Sequence[float], q: int) -> float:
    """The q-th percentile, linear between order statistics (the inclusive method); the value itself for one."""
    return values[0] if len(values) == 1 else statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def _failure(requests: Sequence[SoakRequest], floor_source: str | None) -> SoakFailure | None:
    failed = next((r for r in requests if r.status == Status.FAILED and r.failure is not None), None)
    if failed is None or failed.failure is None:
        return None
    f = failed.failure
    above = None
    same = [r for r in requests if r.attempt == failed.attempt and r.number < failed.number]
    if floor_source is not None and same:
        first, before = _floor(same[0], floor_source), _floor(same[-1], floor_source)
        above = None if first is None or before is None else before - first
    says = next(iter(server_lines(f)), None)
    oom = f.oom
    return SoakFailure(number=failed.number, references=failed.references, kind=str(f.kind), message=f.message,
                       memory=oom.memory if oom is not None else None, site=oom.site if oom else None,
                       function=oom.function if oom else None,
                       server_says=without_stamp(says) if says else None, floor_above_first_bytes=above)


def _outcome(record: SoakRecord, requests: Sequence[SoakRequest], failure: SoakFailure | None) -> str:
    if failure is not None:
        return "failed"
    if not requests:
        return "not run"
    return "held" if record.stopped in ("requests", "minutes") else "incomplete"


def _in_service(served: Sequence[SoakRequest]) -> set[int]:
    """The requests a drift is read over: each after the first arrival of every reference it carries in its
    start. A request that brings a reference its server has not seen fills what a cache keeps, once; growth there
    is the cache's warm-up, not creep (a fixture's references are its first `references` pictures, so a request
    brings a new one where its count passes the most its start has sent of that fixture)."""
    most: dict[tuple[int, str], int] = {}
    out = set()
    for r in served:
        key = (r.attempt, r.fixture)
        if r.references <= most.get(key, 0):
            out.add(r.number)
        most[key] = max(most.get(key, 0), r.references)
    return out


def above_cells(served: Sequence[SoakRequest], source: str | None, floor_source: str | None,
                cell_peaks: Mapping[tuple[str, int], int]) -> tuple[AboveCell, ...]:
    """Per reference count, the in-service request whose peak passed the matrix cell's (`cell_peaks`: by
    (source, references), the cell's highest) by more than ABOVE_TOLERANCE, with the level it started from: a
    request after others can carry what they left (vLLM-Omni 0.30.0 keeps the last request's references until
    the next one: in service its 1-reference request peaks above the matrix's, whose 1-reference cell ran first)."""
    if source is None:
        return ()
    before = {}
    prev: SoakRequest | None = None
    for r in served:
        if prev is not None and prev.attempt == r.attempt and prev.number == r.number - 1 and floor_source:
            before[r.number] = _floor(prev, floor_source)
        prev = r
    out = []
    for n in sorted({r.references for r in served}):
        cell = cell_peaks.get((source, n))
        peaks = [(b, r) for r in served if r.references == n and (b := _peak(r, source)) is not None]
        if cell is None or not peaks:
            continue
        top, r = max(peaks, key=lambda x: (x[0], -x[1].number))
        if top - cell > max(ABOVE_TOLERANCE[0], ABOVE_TOLERANCE[1] * cell):
            out.append(AboveCell(references=n, number=r.number, peak_bytes=top, cell_peak_bytes=cell,
                                 level_before_bytes=before.get(r.number)))
    return tuple(out)


def flag_soak(record: SoakRecord, requests: Sequence[SoakRequest], capacity_bytes: int | None,
              cell_peaks: Mapping[tuple[str, int], int] | None = None) -> SoakFindings:
    """One soaked flag set's findings from its soak.json and its request records (in request order);
    `cell_peaks`: its matrix cells' highest peak by (source, references)."""
    served = [r for r in requests if r.status == Status.OK]
    floor = _source([(r.floor_after.source, r.floor_after.bound) for r in served
                     if r.floor_after is not None and r.floor_after.available])
    peak = _source([(r.peak.source, "") for r in served if r.peak is not None and r.peak.available])
    failure = _failure(requests, floor[0] if floor else None)
    floors = [(r, b) for r in served if floor and (b := _floor(r, floor[0])) is not None]
    peaks = [(r, b) for r in served if peak and (b := _peak(r, peak[0])) is not None]
    walls = sorted(r.wall_s for r in served)
    seen = _in_service(served)
    floor_drift = drift([((r.attempt, r.references), r.number, float(b)) for r, b in floors if r.number in seen])
    peak_drift = drift([((r.attempt, r.references), r.number, float(b)) for r, b in peaks if r.number in seen])
    highest = max((b for _, b in peaks), default=None)
    to_capacity = None
    if capacity_bytes is not None and peak_drift is not None and peak_drift.distinguishable \
            and peak_drift.per_request > 0:
        latest = max(b for _, b in peaks[-len({r.references for r, _ in peaks}):])  # the last round's highest
        to_capacity = max(0, int((capacity_bytes - latest) // peak_drift.per_request))
    return SoakFindings(
        chosen=record.chosen, planned=record.requests, minutes=record.minutes, sent=len(requests), served=len(served),
        starts=len(record.starts), stopped=record.stopped, outcome=_outcome(record, requests, failure),
        failure=failure, floor_source=floor[0] if floor else None,
        floor_bound=floor[1] if floor else None,
        first_floor_bytes=floors[0][1] if floors else None, last_floor_bytes=floors[-1][1] if floors else None,
        floor_drift=floor_drift, peak_source=peak[0] if peak else None, highest_peak_bytes=highest,
        peak_drift=peak_drift, to_capacity=to_capacity,
        above_cells=above_cells(served, peak[0] if peak else None, floor[0] if floor else None, cell_peaks or {}),
        latency_p50_s=round(statistics.median(walls), 4) if walls else None,
        latency_p95_s=round(_percentile(walls, 95), 4) if walls else None,
        latency_max_s=round(walls[-1], 4) if walls else None,
        latency_drift=drift([((r.attempt, r.references), r.number, r.wall_s) for r in served if r.number in seen]),
        capacity_bytes=capacity_bytes, why=record.why)


def cell_peaks(steps: list[StepRecord]) -> dict[str, dict[tuple[str, int], int]]:
    """By flag set, each served cell's highest device peak by (source, references): what the soak's are held
    against."""
    out: dict[str, dict[tuple[str, int], int]] = {}
    for s in steps:
        if s.status != Status.OK:
            continue
        for p in s.peaks:
            if p.available and p.bytes is not None and p.metric == "device":
                cell = out.setdefault(s.flags, {})
                cell[(p.source, s.references)] = max(cell.get((p.source, s.references), 0), p.bytes)
    return out


def card_soak(soak: Soak, soaked: Mapping[str, tuple[SoakRecord, Sequence[SoakRequest]]],
              capacity_bytes: int | None, not_soaked: str | None = None,
              cell_peaks: Mapping[str, Mapping[tuple[str, int], int]] | None = None) -> CardSoak:
    """A card's soak from its soaked flag sets' records (by flag set, in the order to show them); `cell_peaks`:
    by flag set, its matrix cells' highest peak by (source, references)."""
    return CardSoak(requests=soak.requests, minutes=soak.minutes, references=soak.counts, order=soak.order,
                    flag_sets={f: flag_soak(rec, reqs, capacity_bytes, (cell_peaks or {}).get(f))
                               for f, (rec, reqs) in soaked.items()},
                    not_soaked=None if soaked else not_soaked)


def profiled_flags(profile: CardProfile, counts: Sequence[int]) -> tuple[str, ...]:
    """The flag sets profiles.json lists for a card at every count the soak mixes (each served it once within
    the quality and latency rules), in the order profiles.json first lists them."""
    serving = {c.references: {e.flags for e in c.serve} for c in profile.counts}
    listed = dict.fromkeys(e.flags for c in profile.counts for e in c.serve)
    return tuple(f for f in listed if all(f in serving.get(n, ()) for n in counts))


def why_none(counts: Sequence[int], named: bool) -> str:
    """Why a card's soak took no flag set, in one line."""
    if named:
        return "[soak] flags names no flag set this card runs"
    return (f"profiles.json lists no flag set for this card at every count the soak mixes "
            f"({', '.join(str(n) for n in counts)} reference(s))")


def outcome_words(f: SoakFindings | None) -> str:
    """A profile's soak outcome: 'held N requests', 'failed at request k', 'incomplete: …', 'not soaked'."""
    if f is None or f.outcome == "not run":
        return "not soaked" if f is None else f"not soaked: {f.why or f.stopped or 'no request sent'}"
    if f.failure is not None:
        return f"failed at request {f.failure.number}"
    if f.outcome == "incomplete":
        return f"incomplete: {f.sent} of {f.planned} requests (a resume continues it)"
    return f"held {f.served} requests"


def failure_words(f: SoakFindings, short: bool = False) -> str | None:
    """"failed at request 137 of 200: out of memory in `x.py:12` (`forward`) with the floor 1.20 GiB above the
    first request's" — what the verdict's reason says (None: no failure); `short`: up to the class, for the
    one-line summary."""
    x = f.failure
    if x is None:
        return None
    if x.kind == FailureClass.OOM:
        what = "out of host memory" if x.memory == "host" else "out of memory"
        where = f" in `{x.site}`" + (f" (`{x.function}`)" if x.function else "") if x.site else ""
    else:
        what, where = x.kind, f": {x.server_says}" if x.server_says else ""
    if short:
        return f"failed at request {x.number} of {f.planned}: {what}"
    floor = "" if x.floor_above_first_bytes is None else \
        f" with the floor {size(x.floor_above_first_bytes)} above the first request's"
    return f"failed at request {x.number} of {f.planned}: {what}{where}{floor}"


def with_soak(v: Verdict, card: CardSoak | None) -> Verdict:
    """The verdict with the card's soak in its findings; the world stays the single-request rule's, and the
    reason (and the one-line summary) name a soak failure of the deciding flag set."""
    if card is None:
        return v
    findings = v.findings.model_copy(update={"soak": card}) if v.findings is not None else None
    mine = card.flag_sets.get(v.flags) if v.flags else None
    words = failure_words(mine) if mine is not None else None
    if mine is None or words is None:
        return replace(v, findings=findings)
    return replace(v, findings=findings, soak=failure_words(mine, short=True),
                   reason=f"{v.reason}; in service (the soak) '{v.flags}' {words}")
