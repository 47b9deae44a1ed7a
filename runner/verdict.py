"""The verdict: a pure function of the records → per card one of the seed's three worlds, or undecided.

- fits-resident: a `default` flag set serves the target reference count;
- offload-works: a flag set whose role is an offload role serves it, with a latency ratio clearly within
  the limit (its whole interval at or under `max_latency_ratio`);
- not-built: neither, and every default and offload flag set was stopped by capacity (OOM at load or in a
  request) or quality (broken output, low PSNR, clearly too slow);
- undecided: neither, and some default or offload flag set was stopped by something that says nothing
  about memory (the server would not start or answer, a crash without OOM text, a latency interval that
  straddles the limit). The reason names the blocking record and the server's own last error lines.

"Serves n" means every step at n (each fixture and seed) returned an image that passes the sanity checks
and, where a baseline image exists, reaches the minimum PSNR: broken output does not count as served.

Latency: every timed send of a served step (`wall_samples_s`, repeats × seeds × fixtures) is a sample; a
cell's wall time is their median with the min–max spread. A latency ratio is median over median, with a
95% percentile-bootstrap interval (each side resampled on its own, fixed seed: still a pure function). With
two samples a side that interval is about the min–max pairing; more repeats narrow it, min–max would not.
"""

from __future__ import annotations

import itertools
import random
import statistics
from dataclasses import asdict, dataclass
from enum import StrEnum
from operator import attrgetter
from typing import Any

from runner.failures import error_lines, without_stamp
from runner.matrix import VerdictRules
from runner.records import Failure, FailureClass, SessionRecord, Status, StepRecord
from runner.units import clip, fmt_bytes, fmt_s


class World(StrEnum):
    FITS_RESIDENT = "fits-resident"
    OFFLOAD_WORKS = "offload-works"
    NOT_BUILT = "not-built"
    # The runner cannot tell: some flag set was stopped by something that is not capacity or quality (a
    # harness failure, a server that never became ready, noise straddling a threshold). Never a world.
    UNDECIDED = "undecided"


@dataclass(frozen=True)
class Cell:
    """One flag set at one reference count on one card, summarised over fixtures and seeds."""

    flags: str
    role: str
    references: int
    ok: int
    failed: int
    skipped: int
    served: bool
    why_not: str | None
    blocker: str | None  # what stopped it: "skipped", a failure class ("oom", ...), "broken", "low-psnr"
    peak_bytes: int | None
    peak_source: str | None
    host_peak_bytes: int | None
    wall_s: float | None  # median over every timed send of the cell's answered steps
    psnr_db: float | None  # mean; None for the baseline cell itself
    psnr_min_db: float | None
    steps: tuple[str, ...]
    # Defaults keep verdict.json files of earlier runs readable (runner compare).
    wall_min_s: float | None = None  # the spread of those sends
    wall_max_s: float | None = None
    wall_samples: int = 0  # how many timed sends
    baseline: bool = False  # the baseline cell: its images are the reference, not scored against themselves
    walls_s: tuple[float, ...] = ()  # the timed sends themselves, for latency intervals


@dataclass(frozen=True)
class Verdict:
    card: str
    world: World
    target_references: int
    flags: str | None  # the flag set that decided it
    reason: str
    evidence: dict[str, Any]
    cells: tuple[Cell, ...]
    notes: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _device_peak(step: StepRecord) -> tuple[int | None, str | None]:
    """The step's best device peak (a response's `peak_memory_mb` is one of its peaks already)."""
    peak = step.peak("device")
    return (peak.bytes, peak.source) if peak else (None, None)


def _usable(step: StepRecord, rules: VerdictRules) -> tuple[str, str] | None:
    """(blocker, why) when a step does not count as served; None when it does. The blocker is "skipped",
    a failure class, "broken" or "low-psnr", so readers need not parse the text."""
    if step.status == Status.SKIPPED:
        return "skipped", f"skipped: {step.skip_reason}"
    if step.status == Status.FAILED:
        if step.failure is None:
            return "failed", "failed"
        return step.failure.kind.value, f"{step.failure.kind}: {step.failure.message}"
    if step.scores and step.scores.sanity.broken:
        return "broken", "broken output: " + "; ".join(step.scores.sanity.reasons)
    if step.scores and step.scores.psnr_db is not None and step.scores.psnr_db < rules.min_psnr_db:
        return "low-psnr", f"PSNR {step.scores.psnr_db:.1f} dB < {rules.min_psnr_db:g} dB"
    return None


def summarise(steps: list[StepRecord], rules: VerdictRules) -> list[Cell]:
    cells = []
    keyfn = attrgetter("flags", "references")
    for (flags, n), group in itertools.groupby(sorted(steps, key=keyfn), key=keyfn):
        group = list(group)
        problems = [(s, *why) for s in group if (why := _usable(s, rules))]
        served = [s for s in group if s.status == Status.OK]
        peaks = [(b, src) for s in group if s.status != Status.SKIPPED for b, src in [_device_peak(s)]
                 if b is not None]
        host = [p.bytes for s in group if (p := s.peak("host")) and p.bytes is not None]
        is_baseline = bool(served) and all(s.scores and s.scores.baseline == s.key for s in served)
        psnrs = [] if is_baseline else [s.scores.psnr_db for s in served
                                        if s.scores and s.scores.psnr_db is not None]
        walls = [w for s in served for w in (s.wall_samples_s or (s.wall_s,)) if w is not None]
        top = max(peaks, default=(None, None))
        cells.append(Cell(
            flags=flags, role=group[0].role, references=n,
            ok=sum(s.status == Status.OK for s in group), failed=sum(s.status == Status.FAILED for s in group),
            skipped=sum(s.status == Status.SKIPPED for s in group), served=not problems,
            why_not=f"{problems[0][0].key}: {problems[0][2]}" if problems else None,
            blocker=problems[0][1] if problems else None,
            peak_bytes=top[0], peak_source=top[1], host_peak_bytes=max(host, default=None),
            wall_s=round(statistics.median(walls), 3) if walls else None,
            psnr_db=round(statistics.fmean(psnrs), 2) if psnrs else None,
            psnr_min_db=min(psnrs, default=None), steps=tuple(s.key for s in group),
            wall_min_s=round(min(walls), 3) if walls else None, wall_max_s=round(max(walls), 3) if walls else None,
            wall_samples=len(walls), baseline=is_baseline, walls_s=tuple(round(w, 4) for w in walls)))
    return cells


@dataclass(frozen=True)
class IdenticalPair:
    """Two flag sets whose images were byte-identical on every step they share."""

    a: str
    b: str
    steps: int
    same_memory: bool  # peaks within 1% on every shared step too: the difference reached nothing measured

    def note(self) -> str:
        head = f"flag sets '{self.a}' and '{self.b}' gave byte-identical images on all {self.steps} shared step(s)"
        if self.same_memory:
            return head + " with the same memory peaks: their difference never reached the output (inert flag?)"
        return head + ", with different memory peaks: their difference never reached the output, only memory"


def identical_pairs(steps: list[StepRecord]) -> list[IdenticalPair]:
    by_flags: dict[str, dict[tuple[str, int, int], StepRecord]] = {}
    for s in steps:
        if s.status == Status.OK and s.image_sha256:
            by_flags.setdefault(s.flags, {})[(s.fixture, s.references, s.seed)] = s
    pairs = []
    for a, b in itertools.combinations(sorted(by_flags), 2):
        shared = by_flags[a].keys() & by_flags[b].keys()
        if shared and all(by_flags[a][k].image_sha256 == by_flags[b][k].image_sha256 for k in shared):
            pairs.append(IdenticalPair(a, b, len(shared), all(_close(_device_peak(by_flags[a][k])[0],
                                                                      _device_peak(by_flags[b][k])[0])
                                                               for k in shared)))
    return pairs


def _close(x: int | None, y: int | None) -> bool:
    return x is not None and y is not None and abs(x - y) <= 0.01 * max(x, y)


class Stop(StrEnum):
    """What kept a default or offload flag set from serving the target."""

    CAPACITY = "capacity"  # out of memory at load or in a request (at the target or below it)
    QUALITY = "quality"  # broken output, low PSNR, clearly too slow
    UNKNOWN = "unknown"  # anything that says nothing about memory: the card is undecided


@dataclass(frozen=True)
class Blocked:
    flags: str
    role: str
    stop: Stop
    why: str
    record: str | None  # the deciding record: a step key, or the session key for a start failure
    server_says: tuple[str, ...] = ()  # the server's own last error lines, from the failure's evidence

    def text(self) -> str:
        where = f" [{self.record}]" if self.record else ""
        says = [_short(line) for line in self.server_says if without_stamp(line) not in self.why]
        return self.why + where + (f"; server log: {' / '.join(says)}" if says else "")

    def to_json(self) -> dict[str, Any]:
        return {"stop": self.stop.value, "why": self.why, "record": self.record,
                "server_says": list(self.server_says)}


@dataclass(frozen=True)
class Latency:
    """An offload flag set's latency over a reference: median ratio and the interval its samples allow."""

    ratio: float
    low: float
    high: float
    reference: str  # what it was compared with, in words
    reference_wall_s: float
    samples: tuple[int, int]  # timed sends: offload side, reference side
    references: int | None = None  # the count both sides were timed at (the console says it)

    def text(self) -> str:
        return f"latency ratio {self.ratio:.2f} [{self.low:.2f}–{self.high:.2f}] vs {self.reference}"


def server_says(failure: Failure) -> tuple[str, ...]:
    """The server's own last error lines in a failure's evidence; else its last log line."""
    return error_lines("\n".join(failure.evidence)) or failure.evidence[-1:]


def ratio_interval(num: tuple[float, ...], den: tuple[float, ...], *, level: float = 0.95, draws: int = 2000,
                   seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap of median(num) / median(den), each side resampled on its own with a fixed seed."""
    rng = random.Random(seed)
    med = statistics.median
    ratios = sorted(med(rng.choices(num, k=len(num))) / med(rng.choices(den, k=len(den))) for _ in range(draws))
    cut = int(draws * (1 - level) / 2)
    return ratios[cut], ratios[-cut - 1]


def _walls(cell: Cell) -> tuple[float, ...]:
    return cell.walls_s or ((cell.wall_s,) if cell.wall_s else ())  # verdict.json of earlier runs: no samples


def _ratio(off: Cell, ref: Cell | None, base_wall: float | None, what: str, n: int) -> Latency | None:
    """Median over median with its bootstrap interval (a recorded baseline wall time is one sample)."""
    num = _walls(off)
    den = _walls(ref) if ref is not None else (base_wall,) if base_wall else ()
    if not num or not den:
        return None
    ratio = statistics.median(num) / statistics.median(den)
    low, high = ratio_interval(num, den)
    return Latency(round(ratio, 3), round(low, 3), round(high, 3), what, round(statistics.median(den), 4),
                   (len(num), len(den)), n)


def latency(flags: str, cells: list[Cell], defaults: list[str], target: int,
            baseline_wall_s: float | None) -> Latency | None:
    """Offload at n vs default at n for the largest n both serve (the same workload on both sides); else
    the offload cell at the target vs the baseline's recorded wall time; else unknown."""
    served = {(c.flags, c.references): c for c in cells if c.served and c.wall_s}
    common = sorted(((n, d) for (f, n) in served if f == flags for d in defaults if (d, n) in served),
                    key=lambda x: x[0])
    if common:
        n, d = common[-1]
        return _ratio(served[(flags, n)], served[(d, n)], None,
                      f"default '{d}' at {n} reference(s), both sides at {n}", n)
    if (flags, target) in served and baseline_wall_s:
        return _ratio(served[(flags, target)], None, baseline_wall_s,
                      f"the baseline's recorded wall time ({baseline_wall_s:g} s) at {target} reference(s)", target)
    return None


def blocked(flags: str, role: str, target: int, steps: list[StepRecord], session: SessionRecord | None,
            rules: VerdictRules) -> Blocked:
    """Why a flag set does not serve the target, citing the record that decides it (the OOM at 3, not the
    step at 4 it implied), and whether that is capacity, quality or neither."""
    if session is not None and (f := session.start_failure) is not None:
        stop = Stop.CAPACITY if f.kind == FailureClass.OOM_AT_LOAD else Stop.UNKNOWN
        return Blocked(flags, role, stop, f"server did not start ({f.kind}: {f.message})", session.key,
                       server_says(f))
    mine = sorted((s for s in steps if s.flags == flags), key=attrgetter("references", "fixture", "seed"))
    at = [s for s in mine if s.references == target]
    if not at:
        return Blocked(flags, role, Stop.UNKNOWN, f"{target} reference(s) not in the run", None)
    by_key = {s.key: s for s in mine}
    # The deciding OOM: the one a skip at the target names (implied_by), else the first at or below it.
    named = [by_key[s.implied_by] for s in at if s.implied_by in by_key]
    oom = next((s for s in named + mine if s.references <= target and s.failure
                and s.failure.kind == FailureClass.OOM), None)
    if oom is not None and oom.failure is not None:
        implied = f" (which implies {target})" if oom.references < target else ""
        return Blocked(flags, role, Stop.CAPACITY, f"out of memory at {oom.references} reference(s){implied}: "
                       f"{oom.failure.message}", oom.key, server_says(oom.failure))
    problems = [(s, *why) for s in at if (why := _usable(s, rules))]
    quality = next(((s, why) for s, blocker, why in problems if blocker in ("broken", "low-psnr")), None)
    if quality:
        return Blocked(flags, role, Stop.QUALITY, quality[1], quality[0].key)
    if not problems:  # served: callers ask only about flag sets that do not serve the target
        return Blocked(flags, role, Stop.UNKNOWN, f"serves {target}", None)
    s, blocker, why = problems[0]
    if s.failure is not None:
        return Blocked(flags, role, Stop.UNKNOWN, why, s.key, server_says(s.failure))
    lost = next((x for x in reversed(mine) if x.lost and x.failure is not None), None)
    if blocker == "skipped" and lost is not None and lost.failure is not None:
        return Blocked(flags, role, Stop.UNKNOWN, f"{why}, after {lost.failure.kind}: {lost.failure.message}",
                       lost.key, server_says(lost.failure))
    return Blocked(flags, role, Stop.UNKNOWN, why, s.key)


def decide(card: str, steps: list[StepRecord], sessions: list[SessionRecord], rules: VerdictRules,
           baseline_wall_s: float | None = None) -> Verdict:
    target = rules.target_references
    cells = summarise(steps, rules)
    at = {c.flags: c for c in cells if c.references == target}
    roles = {s.flags: s.role for s in sessions} | {s.flags: s.role for s in steps}
    session_of = {s.flags: s for s in sessions}
    notes = [pair.note() for pair in identical_pairs(steps)]
    defaults = [f for f, r in roles.items() if r == "default"]

    def why_not(flags: str) -> Blocked:
        return blocked(flags, roles[flags], target, steps, session_of.get(flags), rules)

    for flags in defaults:
        cell = at.get(flags)
        if cell and cell.served:
            return Verdict(card, World.FITS_RESIDENT, target, flags,
                           f"default flag set '{flags}' serves {target} reference(s): peak "
                           f"{fmt_bytes(cell.peak_bytes)} ({cell.peak_source}), {_wall(cell)}, {_psnr(cell)}",
                           _evidence(cell, None), tuple(cells), tuple(notes))

    stopped = {f: why_not(f) for f in defaults}
    for flags, role in roles.items():
        if role not in rules.offload_roles:
            continue
        cell = at.get(flags)
        if not (cell and cell.served):
            stopped[flags] = why_not(flags)
            continue
        lat = latency(flags, cells, defaults, target, baseline_wall_s)
        if lat is not None and lat.low > rules.max_latency_ratio:
            stopped[flags] = Blocked(flags, role, Stop.QUALITY, f"serves {target} but too slow: {lat.text()}, "
                                     f"all above {rules.max_latency_ratio:g}", cell.steps[0])
            continue
        if lat is not None and lat.high > rules.max_latency_ratio:
            stopped[flags] = Blocked(flags, role, Stop.UNKNOWN, f"serves {target}, but {lat.text()} straddles "
                                     f"{rules.max_latency_ratio:g}: rerun with more repeats", cell.steps[0])
            continue
        if lat is not None and min(lat.samples) < 2:
            notes.append(f"latency of '{flags}' from a single timed send on one side: no spread was measured "
                         f"(raise [run] repeats or add seeds)")
        vs = ("; ".join(f"default '{f}' does not serve it: {stopped[f].text()}" for f in defaults)
              or "no default flag set in the matrix")
        judged = lat.text() if lat is not None else \
            "latency not judged (no reference: default served nothing, no baseline wall time)"
        return Verdict(card, World.OFFLOAD_WORKS, target, flags,
                       f"offload flag set '{flags}' serves {target} reference(s): peak {fmt_bytes(cell.peak_bytes)} "
                       f"({cell.peak_source}), host peak {fmt_bytes(cell.host_peak_bytes)}, {_wall(cell)}, "
                       f"{judged}, {_psnr(cell)}; {vs}",
                       {**_evidence(cell, lat), "flag_sets": {f: b.to_json() for f, b in stopped.items()}},
                       tuple(cells), tuple(notes))

    # Flag sets of other roles (quantization, ...) are part of the story but never decide the card.
    others = {f: ({"stop": "served", "why": f"serves {target}; its role ({roles[f]}) does not count",
                   "record": None, "server_says": []} if at.get(f) and at[f].served else why_not(f).to_json())
              for f in roles if roles[f] not in rules.offload_roles and roles[f] != "default"}
    served_elsewhere = [f for f in others if at.get(f) and at[f].served]
    if served_elsewhere:
        notes.append(f"served {target} only under non-offload flag set(s) {', '.join(served_elsewhere)}, "
                     f"which do not count for this verdict")
    evidence: dict[str, Any] = {"flag_sets": {**{f: b.to_json() for f, b in stopped.items()}, **others}}
    unknown = [b for b in stopped.values() if b.stop == Stop.UNKNOWN]
    if unknown:
        evidence["blocking"] = [{"flags": b.flags, **b.to_json()} for b in unknown]
        decided = [f"{_label(b)} stopped by {b.stop.value}: {b.text()}" for b in stopped.values()
                   if b.stop != Stop.UNKNOWN]
        reason = ("cannot tell — " + "; ".join(f"{_label(b)}: {b.text()}" for b in unknown)
                  + "".join(f"; {d}" for d in decided))
        return Verdict(card, World.UNDECIDED, target, None, reason, evidence, tuple(cells), tuple(notes))
    parts = [f"{_label(b)}: {b.text()}" for b in stopped.values()]
    if not defaults:
        parts.insert(0, "no default flag set")
    if not any(r in rules.offload_roles for r in roles.values()):
        parts.append("no offload flag set")
    return Verdict(card, World.NOT_BUILT, target, None, "; ".join(parts), evidence, tuple(cells), tuple(notes))


def _short(line: str) -> str:
    """A log line for a one-line reason: without its leading timestamp, about 200 characters, cut where
    units.clip cuts (never between a number and its unit; the evidence keeps it whole)."""
    return clip(without_stamp(line), 200)


def _label(b: Blocked) -> str:
    return f"default '{b.flags}'" if b.role == "default" else f"offload '{b.flags}'"


def _wall(cell: Cell) -> str:
    spread = (f" [{fmt_s(cell.wall_min_s)}–{fmt_s(cell.wall_max_s)}]" if cell.wall_samples > 1 else "")
    return f"{fmt_s(cell.wall_s)} s/request{spread} (median of {cell.wall_samples})"


def _psnr(cell: Cell) -> str:
    if cell.baseline:
        return "the baseline cell (its images are the reference)"
    return f"PSNR {cell.psnr_db} dB" if cell.psnr_db is not None else "no PSNR (no baseline image)"


def _evidence(cell: Cell, lat: Latency | None) -> dict[str, Any]:
    return {"steps": list(cell.steps), "peak_bytes": cell.peak_bytes, "peak_source": cell.peak_source,
            "host_peak_bytes": cell.host_peak_bytes, "wall_s": cell.wall_s,
            "wall_spread_s": [cell.wall_min_s, cell.wall_max_s], "wall_samples": cell.wall_samples,
            "psnr_db": cell.psnr_db, "psnr_min_db": cell.psnr_min_db, "baseline": cell.baseline,
            "latency_ratio": None if lat is None else lat.ratio,
            "latency_interval": None if lat is None else [lat.low, lat.high],
            "latency_reference": None if lat is None else {"wall_s": lat.reference_wall_s, "what": lat.reference,
                                                           "samples": list(lat.samples),
                                                           "references": lat.references}}


def decide_all(steps: list[StepRecord], sessions: list[SessionRecord], rules: VerdictRules,
               cards: list[str], baseline_wall_s: float | None = None) -> list[Verdict]:
    return [decide(card, [s for s in steps if s.card == card], [s for s in sessions if s.card == card], rules,
                   baseline_wall_s) for card in cards]
