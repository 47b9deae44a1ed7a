"""The verdict: a pure function of the records → per card exactly one of the seed's three worlds.

- fits-resident: a `default` flag set serves the target reference count;
- offload-works: a flag set whose role is an offload role serves it, within the latency ratio;
- not-built: neither — with the reason per flag set (start failure, OOM at n, broken output, low PSNR, slow).

"Serves n" means every step at n (each fixture and seed) returned an image that passes the sanity checks
and, where a baseline image exists, reaches the minimum PSNR: broken output does not count as served.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import asdict, dataclass
from enum import StrEnum
from operator import attrgetter
from typing import Any

from runner.matrix import VerdictRules
from runner.records import SessionRecord, Status, StepRecord
from runner.units import fmt_bytes


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
    wall_s: float | None  # mean over served steps
    psnr_db: float | None  # mean
    psnr_min_db: float | None
    steps: tuple[str, ...]


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
        psnrs = [s.scores.psnr_db for s in served if s.scores and s.scores.psnr_db is not None]
        walls = [s.wall_s for s in served if s.wall_s is not None]
        top = max(peaks, default=(None, None))
        cells.append(Cell(
            flags=flags, role=group[0].role, references=n,
            ok=sum(s.status == Status.OK for s in group), failed=sum(s.status == Status.FAILED for s in group),
            skipped=sum(s.status == Status.SKIPPED for s in group), served=not problems,
            why_not=f"{problems[0][0].key}: {problems[0][2]}" if problems else None,
            blocker=problems[0][1] if problems else None,
            peak_bytes=top[0], peak_source=top[1], host_peak_bytes=max(host, default=None),
            wall_s=round(statistics.fmean(walls), 3) if walls else None,
            psnr_db=round(statistics.fmean(psnrs), 2) if psnrs else None,
            psnr_min_db=min(psnrs, default=None), steps=tuple(s.key for s in group)))
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


def decide(card: str, steps: list[StepRecord], sessions: list[SessionRecord], rules: VerdictRules,
           baseline_wall_s: float | None = None) -> Verdict:
    target = rules.target_references
    cells = summarise(steps, rules)
    at = {c.flags: c for c in cells if c.references == target}
    roles = {s.flags: s.role for s in sessions} | {s.flags: s.role for s in steps}
    notes = [pair.note() for pair in identical_pairs(steps)]

    def ceiling(flags: str) -> int | None:
        served = [c.references for c in cells if c.flags == flags and c.served]
        return max(served, default=None)

    def failure_story(flags: str) -> str:
        session = next((s for s in sessions if s.flags == flags), None)
        if session and session.start_failure:
            f = session.start_failure
            return f"server did not start ({f.kind}: {f.message})"
        cell = at.get(flags)
        top = ceiling(flags)
        served_text = f"serves up to {top} reference(s)" if top is not None else "serves no reference count"
        if cell is None:
            return f"{served_text}; {target} reference(s) not in the matrix"
        return f"{served_text}; at {target}: {cell.why_not or 'served'}"

    defaults = [f for f, r in roles.items() if r == "default"]
    for flags in defaults:
        cell = at.get(flags)
        if cell and cell.served:
            return Verdict(card, World.FITS_RESIDENT, target, flags,
                           f"default flag set '{flags}' serves {target} reference(s): peak "
                           f"{fmt_bytes(cell.peak_bytes)} ({cell.peak_source}), {cell.wall_s} s/request, "
                           f"PSNR {cell.psnr_db} dB",
                           _evidence(cell, None, None), tuple(cells), tuple(notes))

    reference = _reference_latency(cells, defaults, target, baseline_wall_s)
    rejected = []
    for flags, role in roles.items():
        if role not in rules.offload_roles:
            continue
        cell = at.get(flags)
        if not (cell and cell.served):
            rejected.append(f"'{flags}': {failure_story(flags)}")
            continue
        ratio = None if reference is None or not cell.wall_s else round(cell.wall_s / reference[0], 3)
        if ratio is not None and ratio > rules.max_latency_ratio:
            rejected.append(f"'{flags}': serves {target} but latency ratio {ratio} > {rules.max_latency_ratio:g} "
                            f"(vs {reference[1]})")
            continue
        default_cell = next((at[f] for f in defaults if f in at), None)
        vs = (f"default peak {fmt_bytes(default_cell.peak_bytes)}" if default_cell and default_cell.served
              else "default does not serve it: " + "; ".join(failure_story(f) for f in defaults)
              if defaults else "no default flag set in the matrix")
        latency = (f"latency ratio {ratio} vs {reference[1]}" if ratio is not None
                   else "latency ratio unknown (no reference latency: default served nothing, no baseline wall time)")
        return Verdict(card, World.OFFLOAD_WORKS, target, flags,
                       f"offload flag set '{flags}' serves {target} reference(s): peak {fmt_bytes(cell.peak_bytes)} "
                       f"({cell.peak_source}), host peak {fmt_bytes(cell.host_peak_bytes)}, {cell.wall_s} s/request, "
                       f"{latency}, PSNR {cell.psnr_db} dB; {vs}",
                       _evidence(cell, ratio, reference), tuple(cells), tuple(notes))

    others = [f"'{f}' [{roles[f]}]: {failure_story(f)}" for f in roles
              if roles[f] not in rules.offload_roles and roles[f] != "default"]
    parts = [f"default '{f}': {failure_story(f)}" for f in defaults] or ["no default flag set"]
    parts += [f"offload {r}" for r in rejected] or ["no offload flag set served it"]
    served_elsewhere = [f for f in roles if at.get(f) and at[f].served]
    if served_elsewhere:
        notes.append(f"served {target} only under non-offload flag set(s) {', '.join(served_elsewhere)}, "
                     f"which do not count for this verdict")
    return Verdict(card, World.NOT_BUILT, target, None, "; ".join(parts),
                   {"flag_sets": {f: failure_story(f) for f in roles}, "others": others}, tuple(cells),
                   tuple(notes))


def _reference_latency(cells: list[Cell], defaults: list[str], target: int,
                       baseline_wall_s: float | None) -> tuple[float, str] | None:
    """What an offload flag set's latency is compared with: default at the target, else the baseline's
    recorded wall time, else default at the largest count it served."""
    for c in cells:
        if c.flags in defaults and c.references == target and c.served and c.wall_s:
            return c.wall_s, f"default '{c.flags}' at {target} refs"
    if baseline_wall_s:
        return baseline_wall_s, "the baseline's recorded wall time"
    served = [c for c in cells if c.flags in defaults and c.served and c.wall_s]
    if served:
        best = max(served, key=lambda c: c.references)
        return best.wall_s, f"default '{best.flags}' at {best.references} refs"  # type: ignore[return-value]
    return None


def _evidence(cell: Cell, ratio: float | None, reference: tuple[float, str] | None) -> dict[str, Any]:
    return {"steps": list(cell.steps), "peak_bytes": cell.peak_bytes, "peak_source": cell.peak_source,
            "host_peak_bytes": cell.host_peak_bytes, "wall_s": cell.wall_s, "psnr_db": cell.psnr_db,
            "psnr_min_db": cell.psnr_min_db, "latency_ratio": ratio,
            "latency_reference": None if reference is None else {"wall_s": reference[0], "what": reference[1]}}


def decide_all(steps: list[StepRecord], sessions: list[SessionRecord], rules: VerdictRules,
               cards: list[str], baseline_wall_s: float | None = None) -> list[Verdict]:
    return [decide(card, [s for s in steps if s.card == card], [s for s in sessions if s.card == card], rules,
                   baseline_wall_s) for card in cards]
