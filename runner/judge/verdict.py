"""The verdict: a pure function of the records → per card one of the seed's three worlds, or undecided.

- fits-resident: a `default` flag set serves the target reference count;
- offload-works: a flag set whose role is an offload role serves it, with a latency ratio clearly within
  the limit (its whole interval at or under `max_latency_ratio`);
- not-built: neither, and every default and offload flag set was stopped by capacity (OOM at load or in a
  request), quality (broken output, low PSNR) or latency (its interval wholly above the limit);
- undecided: neither, and some default or offload flag set was stopped by something that says nothing
  about memory (the server would not start or answer, a crash without OOM text, a latency interval that
  straddles the limit). The reason names the blocking record and the server's own last error lines.

The rules are an ordered list of small functions (RULES: fits_resident, offload_works, undecided,
not_built) over the same Facts, the first that decides returns a typed Decision; the words are rendered from
it in one place (runner.judge.verdict_text), which console, report and compare use.

"Serves n" means every step at n (each fixture and seed) returned an image that passes the sanity checks
and, where a baseline image exists, reaches the minimum PSNR: broken output does not count as served.

Latency: every timed send of a served step (`wall_samples_s`, repeats × seeds × fixtures) is a sample; a
cell's wall time is their median with the min–max spread. A latency ratio is median over median, with a
95% percentile-bootstrap interval (each side resampled on its own, fixed seed: still a pure function). With
two samples a side that interval is about the min–max pairing; more repeats narrow it, min–max would not.
Under `repeats = "auto"` (rules.latency_looks > 1) the ratio is of geometric means and the interval is
runner.plan.sequential's: a t interval on log wall times at 1 − 0.02 / looks with each side's noise pooled over
its whole session (`session_noise`), paired by seed, the one that decided when to stop sending
(docs/matrix.md). A straddling ratio on a card that reached a world is a measured figure (`settled`).
"""

from __future__ import annotations

import functools
import itertools
import math
import random
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from operator import attrgetter
from typing import TYPE_CHECKING

from runner.core.records import Failure, FailureClass, SessionRecord, Status, StepRecord, send_again
from runner.core.units import refs_text

if TYPE_CHECKING:
    from runner.judge.findings.held import Reading
from runner.judge.decision import (
    Blocked,
    Cell,
    Decision,
    Evidence,
    Latency,
    LatencyReference,
    Stop,
    Verdict,
    World,
    fmt_ratio,
)
from runner.judge.findings.memory import no_device_figure
from runner.observe.failures import server_lines
from runner.plan import sequential
from runner.plan.matrix import VerdictRules


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
        again = "; not a measurement: a resume sends it again" if send_again(step) else ""
        return step.failure.kind.value, f"{step.failure.kind}: {step.failure.message}{again}"
    if step.scores and step.scores.sanity.broken:
        return "broken", "broken output: " + "; ".join(step.scores.sanity.reasons)
    if step.scores and step.scores.psnr_db is not None and step.scores.psnr_db < rules.min_psnr_db:
        return "low-psnr", f"PSNR {step.scores.psnr_db:.1f} dB < {rules.min_psnr_db:g} dB"
    return None


def summarise(steps: list[StepRecord], rules: VerdictRules) -> list[Cell]:
    cells = []
    keyfn = attrgetter("flags", "references")
    for (flags, n), grouped in itertools.groupby(sorted(steps, key=keyfn), key=keyfn):
        group = list(grouped)
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
            oom_memory=_memory(problems[0][0].failure) if problems and problems[0][0].failure is not None
            and problems[0][1] == "oom" else None,
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
    # peaks within 1% on every shared step with a device figure on both sides (the difference reached nothing
    # measured), or not; None: no shared step has a device figure on both sides, so memory compares nothing
    same_memory: bool | None
    compared: int = 0  # shared steps with a device figure on both sides

    @property
    def memory(self) -> str:
        """"same", "different" or "unmeasured"."""
        return "unmeasured" if self.same_memory is None else "same" if self.same_memory else "different"

    def compared_on(self) -> str:
        """", on the 2 of 4 shared steps with a device figure on both sides" where not every step had one."""
        return "" if self.compared == self.steps else \
            f" (on the {self.compared} of {self.steps} shared steps with a device figure on both sides)"

    def note(self) -> str:
        head = f"flag sets '{self.a}' and '{self.b}' gave byte-identical images on all {self.steps} shared step(s)"
        if self.same_memory is None:
            return head + "; no device-memory figure compares them: whether their difference reached memory " \
                          "was not measured"
        if self.same_memory:
            return head + f" with the same memory peaks{self.compared_on()}: their difference never reached the " \
                          "output (inert flag?)"
        return head + f", with different memory peaks{self.compared_on()}: their difference never reached the " \
                      "output, only memory"


def identical_pairs(steps: list[StepRecord]) -> list[IdenticalPair]:
    by_flags: dict[str, dict[tuple[str, int, int], StepRecord]] = {}
    for s in steps:
        if s.status == Status.OK and s.image_sha256:
            by_flags.setdefault(s.flags, {})[(s.fixture, s.references, s.seed)] = s
    pairs = []
    for a, b in itertools.combinations(sorted(by_flags), 2):
        shared = by_flags[a].keys() & by_flags[b].keys()
        if shared and all(by_flags[a][k].image_sha256 == by_flags[b][k].image_sha256 for k in shared):
            measured = [(x, y) for k in shared if (x := _device_peak(by_flags[a][k])[0]) is not None
                        and (y := _device_peak(by_flags[b][k])[0]) is not None]
            same = all(_close(x, y) for x, y in measured) if measured else None
            pairs.append(IdenticalPair(a, b, len(shared), same, len(measured)))
    return pairs


def _close(x: int, y: int) -> bool:
    return abs(x - y) <= 0.01 * max(x, y)


def server_says(failure: Failure) -> tuple[str, ...]:
    """The server's own words for a failure (runner.observe.failures.server_lines): an HTTP error body's
    message, the error lines in its evidence (an OOM, a chain's cause before its wrapper), where the scheduler
    ended the server its line; else its last log line that is not an access-log line."""
    return server_lines(failure)


def ratio_interval(num: Sequence[float], den: Sequence[float], *, level: float = 0.95, draws: int = 2000,
                   seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap of median(num) / median(den), each side resampled on its own with a fixed seed.
    A pure function of its arguments, so remembered: the verdict, profiles.json and the cost's replay of when
    each verdict was known ask it of the same walls again and again (a third of a 100-session report's time)."""
    return _bootstrap(tuple(num), tuple(den), level, draws, seed)


@functools.lru_cache(maxsize=4096)
def _bootstrap(num: tuple[float, ...], den: tuple[float, ...], level: float, draws: int,
               seed: int) -> tuple[float, float]:
    rng = random.Random(seed)
    med = statistics.median
    ratios = sorted(med(rng.choices(num, k=len(num))) / med(rng.choices(den, k=len(den))) for _ in range(draws))
    cut = int(draws * (1 - level) / 2)
    return ratios[cut], ratios[-cut - 1]


def timed_walls(cell: Cell) -> tuple[float, ...]:
    """The cell's timed sends (verdict.json of earlier runs: its one median). A wall of 0 s is no timing (a
    hand-edited record, or one rounded to 0): it is never a divisor of a ratio."""
    return tuple(w for w in cell.walls_s or ((cell.wall_s,) if cell.wall_s else ()) if w > 0)


def _timed(s: StepRecord) -> tuple[float, ...]:
    return s.wall_samples_s or ((s.wall_s,) if s.wall_s is not None else ())


def session_noise(steps: Iterable[StepRecord], flags: str) -> sequential.Noise | None:
    """The pooled noise of one card's session of `flags`: every served workload (reference count × fixture:
    its seeds and repeats) around its own mean (runner.plan.sequential.pooled_noise)."""
    workloads: dict[tuple[int, str], list[float]] = {}
    for s in steps:
        if s.flags == flags and s.status == Status.OK:
            workloads.setdefault((s.references, s.fixture), []).extend(_timed(s))
    return sequential.pooled_noise(workloads.values())


def _side(steps: Iterable[StepRecord], flags: str, n: int) -> dict[tuple[str, int], tuple[float, ...]]:
    return {(s.fixture, s.seed): t for s in steps if s.flags == flags and s.references == n
            and s.status == Status.OK and (t := _timed(s))}


def _kept(x: float) -> float:
    """A bound for verdict.json: three decimals, or three significant digits below 0.001 (never 0 for a
    positive bound)."""
    return x if not math.isfinite(x) else round(x, 3) if x >= 0.001 or x == 0 else float(f"{x:.3g}")


@dataclass(frozen=True)
class _Auto:
    """What the sequential interval needs beyond the cells: the card's steps and the planned looks."""

    steps: tuple[StepRecord, ...]
    looks: int
    max_repeats: int
    limit: float


def _ratio(off: Cell, ref: Cell | None, base_wall: float | None, what: str, n: int, auto: _Auto | None = None
           ) -> Latency | None:
    """Median over median with its bootstrap interval (a recorded baseline wall time is one sample); under
    auto the ratio of geometric means with runner.plan.sequential's interval over the sessions' pooled noise."""
    num = timed_walls(off)
    den = timed_walls(ref) if ref is not None else (base_wall,) if base_wall else ()
    if not num or not den:
        return None
    sides = ((off.flags, off.references), None if ref is None else (ref.flags, ref.references))
    ratio = statistics.median(num) / statistics.median(den)
    extra: dict[str, object] = {}
    if auto is not None:
        noise = session_noise(auto.steps, off.flags)
        ref_noise = None if ref is None else session_noise(auto.steps, ref.flags)
        x = _side(auto.steps, off.flags, off.references)
        y: dict[tuple[str, int], tuple[float, ...]] | float = (_side(auto.steps, ref.flags, ref.references)
                                                               if ref is not None else float(den[0]))
        iv = sequential.ratio_interval(x, y, noise, ref_noise, looks=auto.looks) if x and y else None
        ratio, low, high = (ratio, 0.0, math.inf) if iv is None else (iv.ratio, iv.low, iv.high)
        pools = [z for z in (noise, ref_noise) if z is not None]
        pool = max(pools, key=attrgetter("var")) if pools else None
        decide_at = None
        if iv is not None and pool is not None and sequential.judge(iv, auto.limit) == sequential.Judgement.OPEN:
            decide_at = sequential.sends_to_decide(iv, auto.limit, pool, min(len(num), len(den)), auto.looks)
        timed = [*x.values(), *(y.values() if isinstance(y, dict) else ())]
        extra = {"measure": "geometric means", "decide_at": decide_at, "paired": iv is not None and iv.paired,
                 "exhausted": auto.max_repeats > 0 and all(len(t) >= auto.max_repeats for t in timed)}
    else:
        low, high = ratio_interval(num, den)
    return Latency(_kept(ratio), _kept(low), _kept(high), what, round(statistics.median(den), 4),
                   (len(num), len(den)), n, sides, **extra)  # type: ignore[arg-type]


def latency(flags: str, cells: list[Cell], defaults: list[str], target: int,
            baseline_wall_s: float | None, auto: _Auto | None = None) -> Latency | None:
    """Offload at n vs default at n for the largest n both serve (the same workload on both sides); else
    the offload cell at the target vs the baseline's recorded wall time; else unknown."""
    served = {(c.flags, c.references): c for c in cells if c.served and c.wall_s}
    common = sorted(((n, d) for (f, n) in served if f == flags for d in defaults if (d, n) in served),
                    key=lambda x: x[0])
    if common:
        n, d = common[-1]
        return _ratio(served[(flags, n)], served[(d, n)], None,
                      f"default '{d}' at {n} reference(s), both sides at {n}", n, auto)
    if (flags, target) in served and baseline_wall_s:
        return _ratio(served[(flags, target)], None, baseline_wall_s,
                      f"the baseline's recorded wall time ({baseline_wall_s:g} s) at {target} reference(s)", target,
                      auto)
    return None


def blocked(flags: str, role: str, target: int, steps: list[StepRecord], session: SessionRecord | None,
            rules: VerdictRules) -> Blocked:
    """Why a flag set does not serve the target, citing the record that decides it (the OOM at 3, not the
    step at 4 it implied), and whether that is capacity, quality or neither."""
    if session is not None and (f := session.start_failure) is not None:
        at_load = f.kind == FailureClass.OOM_AT_LOAD
        return Blocked(flags, role, Stop.CAPACITY if at_load else Stop.UNKNOWN,
                       f"server did not start ({f.kind}: {f.message})", session.key, server_says(f),
                       "oom-at-load" if at_load else "start", None, f.kind.value,
                       memory=_memory(f) if at_load else None)
    mine = sorted((s for s in steps if s.flags == flags), key=attrgetter("references", "fixture", "seed"))
    at = [s for s in mine if s.references == target]
    by_key = {s.key: s for s in mine}
    # The deciding OOM: the one a skip at the target names (implied_by), else the first at or below it (an
    # OOM below the target implies it even where the target's steps are not recorded).
    named = [by_key[s.implied_by] for s in at if s.implied_by in by_key]
    oom = next((s for s in named + mine if s.references <= target and s.failure
                and s.failure.kind == FailureClass.OOM), None)
    if oom is not None and oom.failure is not None:
        implied = f" (which implies {target})" if oom.references < target else ""
        also = _quality_below(mine, oom.references, rules)
        return Blocked(flags, role, Stop.CAPACITY, f"out of memory at {oom.references} reference(s){implied}: "
                       f"{oom.failure.message}" + (f"; {also} before it" if also else ""), oom.key,
                       server_says(oom.failure), "oom", oom.references, also, memory=_memory(oom.failure))
    if not at:
        served = [n for n in sorted({s.references for s in mine})
                  if all(_usable(s, rules) is None for s in mine if s.references == n)]
        seen = _quality_below(mine, target, rules) or (f"serves ≤{served[-1]}" if served else None)
        return Blocked(flags, role, Stop.UNKNOWN, f"{target} reference(s) not in the run"
                       + (f" ({seen} below it)" if seen else ""), None, cause="absent", references=target,
                       detail=seen)
    problems = [(s, *usable) for s in at if (usable := _usable(s, rules))]
    quality = next(((s, blocker, why) for s, blocker, why in problems if blocker in ("broken", "low-psnr")), None)
    if quality:
        s, blocker, why = quality
        first = _first_quality_problem(mine, rules) or s
        return Blocked(flags, role, Stop.QUALITY, why, s.key, (), blocker, first.references,
                       why.split(": ", 1)[-1] if blocker == "broken" else why)
    if not problems:  # served: callers ask only about flag sets that do not serve the target
        return Blocked(flags, role, Stop.SERVED, f"serves {target}", None, cause="served", references=target)
    s, blocker, why = problems[0]
    if s.failure is not None:
        return Blocked(flags, role, Stop.UNKNOWN, why, s.key, server_says(s.failure), "failure", s.references,
                       s.failure.kind.value)
    lost = next((x for x in reversed(mine) if x.lost and x.failure is not None), None)
    if blocker == "skipped" and lost is not None and lost.failure is not None:
        return Blocked(flags, role, Stop.UNKNOWN, f"{why}, after {lost.failure.kind}: {lost.failure.message}",
                       lost.key, server_says(lost.failure), "failure", lost.references, lost.failure.kind.value)
    return Blocked(flags, role, Stop.UNKNOWN, why, s.key, cause="skipped", references=s.references)


def _memory(failure: Failure) -> str:
    """Which memory an OOM failure ran out of: host when the kernel's OOM killer ended the server."""
    return failure.oom.memory if failure.oom is not None else "device"


def _quality_below(mine: list[StepRecord], n: int, rules: VerdictRules) -> str | None:
    """What was wrong with the output below an OOM's count, in a few words (None: nothing)."""
    bad = _first_quality_problem([s for s in mine if s.references < n], rules)
    why = _usable(bad, rules) if bad is not None else None
    if bad is None or why is None:
        return None
    what = "broken output" if why[0] == "broken" else f"PSNR under {rules.min_psnr_db:g} dB"
    return f"{what} from {refs_text(bad.references)}"


def _first_quality_problem(mine: list[StepRecord], rules: VerdictRules) -> StepRecord | None:
    """The lowest count whose output was broken or too far from the baseline (broken from 1 reads better
    than broken at 4 when 1-3 were broken too)."""
    return next((s for s in mine if (why := _usable(s, rules)) and why[0] in ("broken", "low-psnr")), None)


# --- the rules: facts in, one typed decision out ------------------------------------------------------

@dataclass(frozen=True)
class Facts:
    """What every rule reads: one card's cells and each flag set's stop at the target, computed once."""

    card: str
    rules: VerdictRules
    cells: tuple[Cell, ...]
    roles: dict[str, str]
    steps: tuple[StepRecord, ...]
    sessions: dict[str, SessionRecord]
    baseline_wall_s: float | None

    @property
    def target(self) -> int:
        return self.rules.target_references

    @functools.cached_property
    def at(self) -> dict[str, Cell]:
        return {c.flags: c for c in self.cells if c.references == self.target}

    def served(self, flags: str) -> bool:
        return flags in self.at and self.at[flags].served

    def of(self, *roles: str) -> list[str]:
        return [f for f, r in self.roles.items() if r in roles]

    @property
    def defaults(self) -> list[str]:
        return self.of("default")

    @property
    def offloads(self) -> list[str]:
        return self.of(*self.rules.offload_roles)

    @functools.cached_property
    def stops(self) -> dict[str, Blocked]:
        """Every flag set's stop at the target; an offload flag set that serves it is judged on latency."""
        out = {}
        for flags, role in self.roles.items():
            b = blocked(flags, role, self.target, list(self.steps), self.sessions.get(flags), self.rules)
            if self.unmetered(flags) and self.rules.decides_world(role):
                b = self._unmetered(b)
            if b.stop == Stop.SERVED and role in self.rules.offload_roles:
                b = self._judge_latency(b)
            out[flags] = b
        return out

    def unmetered(self, flags: str) -> bool:
        """Serves the target, but no step there has a device-memory figure: nothing measured the card's memory."""
        return self.served(flags) and self.at[flags].peak_bytes is None

    def _unmetered(self, b: Blocked) -> Blocked:
        """A world is a statement about the card's memory: a served target with no device-memory figure shows
        that the server answered, not that the request ran within the card (on a CPU, or on a larger GPU
        emulating the card, there is no device of that capacity at all). It decides nothing (docs/matrix.md)."""
        cell = self.at[b.flags]
        why = no_device_figure(s for s in self.steps if s.flags == b.flags and s.references == self.target)
        return replace(b, stop=Stop.UNKNOWN, why=f"serves {self.target} reference(s) with no device-memory figure"
                       + (f": {why}" if why else ""), record=cell.steps[0], server_says=(), cause="unmetered",
                       references=self.target, detail=why, latency=None, memory=None)

    def _judge_latency(self, served: Blocked) -> Blocked:
        flags, cell = served.flags, self.at[served.flags]
        auto = None if self.rules.latency_looks <= 1 else _Auto(
            self.steps, self.rules.latency_looks, self.rules.latency_max_repeats, self.rules.max_latency_ratio)
        lat = latency(flags, list(self.cells), self.defaults, self.target, self.baseline_wall_s, auto)
        limit = self.rules.max_latency_ratio
        if lat is not None and lat.low > limit:
            return replace(served, stop=Stop.LATENCY, why=f"serves {self.target} but too slow: {lat.text()}, "
                           f"all above {limit:g}", record=cell.steps[0], cause="slow", latency=lat,
                           detail=f"{fmt_ratio(lat.ratio)} > {limit:g}")
        if lat is not None and lat.high > limit:
            return replace(served, stop=Stop.UNKNOWN, why=f"serves {self.target}, but {lat.text(limit)} straddles "
                           f"{limit:g}: {self._more(lat)}",
                           record=cell.steps[0], cause="straddles", latency=lat, detail=lat.straddles(limit))
        return replace(served, latency=lat)

    def _more(self, lat: Latency) -> str:
        """What more sends would do for a straddling ratio (issue 30, A-2: nothing, once auto is at its end)."""
        if self.rules.latency_looks <= 1:
            return "rerun with more repeats (or repeats = \"auto\")"
        if lat.exhausted:
            return (f"still open with {self.rules.latency_max_repeats} timed sends a step on both sides "
                    f"(max_repeats): the measured noise does not separate it from the limit")
        return "more timed sends would decide it (--resume sends them)"

    def others(self, decided: str | None) -> tuple[Blocked, ...]:
        return tuple(b for f, b in self.stops.items() if f != decided)


def fits_resident(f: Facts) -> Decision | None:
    """A default flag set serves the target, with a device-memory figure there."""
    flags = next((d for d in f.defaults if f.served(d) and not f.unmetered(d)), None)
    if flags is None:
        return None
    return Decision(World.FITS_RESIDENT, flags, f.at[flags], None, f.others(flags))


def offload_works(f: Facts) -> Decision | None:
    """An offload flag set serves the target with a latency interval not above the limit (nor straddling),
    and no default was stopped by something that says nothing about memory: a default that hung, crashed
    without OOM text or was stopped from outside does not show that the card needs offload (issue 18)."""
    flags = next((o for o in f.offloads if f.stops[o].stop == Stop.SERVED), None)
    if flags is None or any(f.stops[d].stop == Stop.UNKNOWN for d in f.defaults):
        return None
    lat = f.stops[flags].latency
    notes: tuple[str, ...] = ()
    if lat is not None and min(lat.samples) < 2:
        notes = (f"latency of '{flags}' from a single timed send on one side: no spread was measured "
                 f"(raise [run] repeats or add seeds)",)
    return Decision(World.OFFLOAD_WORKS, flags, f.at[flags], lat, f.others(flags), notes)


def undecided(f: Facts) -> Decision | None:
    """Some default or offload flag set was stopped by something that says nothing about memory."""
    if not any(f.stops[x].stop == Stop.UNKNOWN for x in f.defaults + f.offloads):
        return None
    serving = [o for o in f.offloads if f.stops[o].stop == Stop.SERVED]
    held = tuple(f"offload '{o}' serves {f.target} reference(s), which decides nothing while a default was stopped "
                 f"by something that says nothing about memory" for o in serving)
    return Decision(World.UNDECIDED, stops=f.others(None), notes=held + _non_offload_note(f))


def not_built(f: Facts) -> Decision:
    """Every default and offload flag set was stopped by capacity, quality or latency."""
    return Decision(World.NOT_BUILT, stops=f.others(None), notes=_non_offload_note(f))


RULES: tuple[Callable[[Facts], Decision | None], ...] = (fits_resident, offload_works, undecided, not_built)


def settled(d: Decision) -> Decision:
    """A card that reached a world: a latency that straddles the limit can no longer change it, so it is a
    measured figure, not an open question (issue 31)."""
    if d.world == World.UNDECIDED:
        return d

    def measured(b: Blocked) -> Blocked:
        if b.cause != "straddles" or b.latency is None:
            return b
        lat = replace(b.latency, decide_at=None)  # no sends are planned for it: nothing to suggest
        return replace(b, stop=Stop.SERVED, why=f"{lat.text()}: a measured figure, it cannot change the card's "
                       f"world ({d.world})", cause="measured", detail=lat.figure(), latency=lat)

    return replace(d, stops=tuple(measured(b) for b in d.stops))


def _non_offload_note(f: Facts) -> tuple[str, ...]:
    served = [x for x in f.roles if x not in f.defaults + f.offloads and f.served(x)]
    return (f"served {f.target} only under non-offload flag set(s) {', '.join(served)}, which do not count "
            f"for this verdict",) if served else ()


def _facts(card: str, steps: list[StepRecord], sessions: list[SessionRecord], rules: VerdictRules,
           baseline_wall_s: float | None) -> Facts:
    cells = tuple(summarise(steps, rules))
    found = {s.flags: s.role for s in sessions} | {s.flags: s.role for s in steps}
    rank = {"default": 0, **{r: 1 for r in rules.offload_roles}}  # the stops read default, offload, the rest
    roles: dict[str, str] = dict(sorted(found.items(), key=lambda fr: rank.get(fr[1], 2)))
    return Facts(card, rules, cells, roles, tuple(steps), {s.flags: s for s in sessions}, baseline_wall_s)


def decide(card: str, steps: list[StepRecord], sessions: list[SessionRecord], rules: VerdictRules,
           baseline_wall_s: float | None = None, capacity_bytes: int | None = None,
           allocator: tuple[tuple[str, str], ...] = (), held: Mapping[str, tuple[Reading, ...]] | None = None
           ) -> Verdict:
    """One card's verdict: the first rule that decides, its words (verdict_text) and the findings. The
    card's capacity (its vram) and the pairs of flag sets that differ only in allocator settings come from
    the matrix."""
    from runner.judge import verdict_text
    from runner.judge.findings.build import card_findings

    facts = _facts(card, steps, sessions, rules, baseline_wall_s)
    cells, roles = facts.cells, facts.roles
    decision = settled(next(d for rule in RULES if (d := rule(facts)) is not None))
    stops = {b.flags: b.stop.value for b in facts.stops.values()} | {b.flags: b.stop.value for b in decision.stops}
    findings = card_findings(steps, sessions, roles, rules.target_references, tuple(rules.offload_roles),
                             capacity_bytes, stops, allocator, rules.min_psnr_db, held)
    notes = tuple(pair.note() for pair in identical_pairs(steps)) + decision.notes
    return Verdict(card, decision.world, rules.target_references, decision.flags,
                   verdict_text.reason(decision, roles, rules), _evidence(decision), cells, notes,
                   decision.stops, findings, decision.latency)


def _evidence(d: Decision) -> Evidence:
    """verdict.json's evidence, from the typed decision."""
    stops = {b.flags: b.evidence() for b in d.stops}
    blocking = tuple(stops[b.flags] for b in d.stops if b.stop == Stop.UNKNOWN) if d.world == World.UNDECIDED else ()
    if d.cell is None:
        return Evidence(stops, blocking)
    c, lat = d.cell, d.latency
    return Evidence(
        stops, blocking, c.steps, c.peak_bytes, c.peak_source, c.host_peak_bytes, c.wall_s,
        (c.wall_min_s, c.wall_max_s), c.wall_samples, c.psnr_db, c.psnr_min_db, c.baseline,
        None if lat is None else lat.ratio,
        None if lat is None else (lat.low, lat.high if lat.bounded else None),
        None if lat is None else LatencyReference(lat.reference_wall_s, lat.reference, lat.samples, lat.references))


def open_latencies(card: str, steps: list[StepRecord], sessions: list[SessionRecord], rules: VerdictRules,
                   baseline_wall_s: float | None = None) -> list[Latency]:
    """The latency ratios more timed sends could still decide: while the card is undecided, every offload flag
    set serving the target whose ratio interval straddles the limit (or has no spread yet). Each one, once
    clear, could make the card offload-works, or remove a blocker. Empty once the card reached a world."""
    facts = _facts(card, steps, sessions, rules, baseline_wall_s)
    if next(d for rule in RULES if (d := rule(facts)) is not None).world != World.UNDECIDED:
        return []
    return [b.latency for b in facts.stops.values()
            if b.cause == "straddles" and b.latency is not None and b.latency.sides is not None]


def decide_all(steps: list[StepRecord], sessions: list[SessionRecord], rules: VerdictRules,
               cards: list[str], baseline_wall_s: float | None = None,
               capacities: dict[str, int] | None = None, allocator: tuple[tuple[str, str], ...] = (),
               held: Mapping[tuple[str, str], tuple[Reading, ...]] | None = None) -> list[Verdict]:
    """`held`: the diagnosis passes' snapshot readings by (card, flags)."""
    by_card: dict[str, dict[str, tuple[Reading, ...]]] = {}
    for (card, flags), readings in (held or {}).items():
        by_card.setdefault(card, {})[flags] = readings
    return [decide(card, [s for s in steps if s.card == card], [s for s in sessions if s.card == card], rules,
                   baseline_wall_s, (capacities or {}).get(card), allocator, by_card.get(card)) for card in cards]


