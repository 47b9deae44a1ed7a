"""What a verdict is made of, declared once: the world, each cell's figures, a flag set's typed stop and
latency, the rules' typed Decision, and the Verdict with its Evidence as verdict.json keeps it.

runner.judge.verdict decides (records in, a Decision out), runner.judge.verdict_text renders its words; both read these
declarations, neither imports the other's logic back. verdict.json is written through one pydantic adapter
(`Verdict.to_json`), and runner.present.schemas publishes its schema from the same classes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated, Any

from pydantic import Field, TypeAdapter

from runner.core.units import clip
from runner.judge.findings.models import Findings
from runner.observe.failures import without_stamp


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
    oom_memory: str | None = None  # the blocker is an OOM: which memory ran out, "device" or "host"


@dataclass(frozen=True)
class StopEvidence:
    """A flag set's stop as verdict.json keeps it (evidence.flag_sets and evidence.blocking): runner.judge.verdict's
    Blocked without what is only known in the run (the role, the latency object)."""

    stop: Stop
    why: str
    record: str | None
    server_says: tuple[str, ...] = ()
    cause: str = ""
    references: int | None = None
    detail: str | None = None
    flags: str | None = None  # runs before the evidence was typed name it only in evidence.blocking
    memory: str | None = None  # an OOM's memory: "host" (the kernel's OOM killer) or "device"


@dataclass(frozen=True)
class LatencyReference:
    """What the deciding offload flag set's latency was compared with."""

    wall_s: float
    what: str
    samples: tuple[int, int]  # timed sends: offload side, reference side
    references: int | None


@dataclass(frozen=True)
class Evidence:
    """verdict.json's evidence: the deciding cell's figures and latency (absent when no flag set decided the
    card); every other flag set's stop; the stops that leave the card undecided."""

    flag_sets: dict[str, StopEvidence] = field(default_factory=dict)
    blocking: tuple[StopEvidence, ...] = ()  # undecided: the stops that say nothing about memory
    steps: tuple[str, ...] = ()
    peak_bytes: int | None = None
    peak_source: str | None = None
    host_peak_bytes: int | None = None
    wall_s: float | None = None
    wall_spread_s: tuple[float | None, float | None] | None = None
    wall_samples: int | None = None
    psnr_db: float | None = None
    psnr_min_db: float | None = None
    baseline: bool | None = None
    latency_ratio: float | None = None
    latency_interval: tuple[float, float | None] | None = None  # the upper end None: unbounded
    latency_reference: LatencyReference | None = None


@dataclass(frozen=True)
class Verdict:
    card: str
    world: World
    target_references: int
    flags: str | None  # the flag set that decided it
    reason: str  # rendered by runner.judge.verdict_text from the typed decision
    evidence: Evidence
    cells: tuple[Cell, ...]
    notes: tuple[str, ...]
    # Known in the run, not kept in verdict.json (Field(exclude)): the evidence holds their kept form.
    stops: Annotated[tuple[Blocked, ...], Field(exclude=True)] = ()  # why each other flag set does not decide it
    findings: Findings | None = None  # where the memory goes, what binds, where a fix would go
    latency: Annotated[Latency | None, Field(exclude=True)] = None  # the deciding offload flag set's, with its sides
    soak: str | None = None  # the deciding flag set's soak failure in words (runner.judge.findings.soak.with_soak)

    def to_json(self) -> dict[str, Any]:
        return dict(_VERDICT_JSON.dump_python(self, mode="json"))


class Stop(StrEnum):
    """What kept a flag set from serving the target (or that it serves it)."""

    CAPACITY = "capacity"  # out of memory at load or in a request (at the target or below it)
    QUALITY = "quality"  # broken output, low PSNR
    LATENCY = "latency"  # serves the target, but its latency interval lies wholly above the limit
    UNKNOWN = "unknown"  # anything that says nothing about memory: the card is undecided
    SERVED = "served"  # serves the target (a flag set that did not decide the card, or whose role does not count)


@dataclass(frozen=True)
class Blocked:
    """Why one flag set does not serve the target (or that it does), typed: `stop` and `cause` say what
    happened, `references` at which count; `why` is the evidence phrase for the full reason."""

    flags: str
    role: str
    stop: Stop
    why: str
    record: str | None  # the deciding record: a step key, or the session key for a start failure
    server_says: tuple[str, ...] = ()  # the server's own last error lines, from the failure's evidence
    # "oom-at-load", "oom", "start" (did not start, not memory), "broken", "low-psnr", "slow", "straddles",
    # "measured" (served; a latency that straddles the limit on a card that reached a world: a figure),
    # "failure" (a request failure that is not memory: `detail` names its class), "skipped", "absent", "served"
    cause: str = ""
    references: int | None = None
    detail: str | None = None  # the failure class, "PSNR 8.0 dB < 20 dB", the latency ratio text, ...
    latency: Latency | None = None
    memory: str | None = None  # an OOM's memory: "host" (the kernel's OOM killer) or "device"

    def text(self) -> str:
        where = f" [{self.record}]" if self.record else ""
        says = [_short(line) for line in self.server_says if without_stamp(line) not in self.why]
        # the lines come from the server's log or from its response body (an OOM's 500 text): say neither
        return self.why + where + (f"; the server says: {' / '.join(says)}" if says else "")

    def evidence(self) -> StopEvidence:
        return StopEvidence(self.stop, self.why, self.record, self.server_says, self.cause, self.references,
                            self.detail, self.flags, self.memory)

    @classmethod
    def from_json(cls, flags: str, d: dict[str, Any], role: str = "") -> Blocked:
        """A stop from verdict.json's evidence.flag_sets, read by StopEvidence's own declaration (a ValidationError,
        a ValueError, names the field that is wrong; earlier runs without a cause: the words fall back to the
        stop)."""
        e = STOP_EVIDENCE.validate_json(json.dumps(d), strict=True)  # as JSON types: "3" is no count
        return cls(flags, role, e.stop, e.why, e.record, e.server_says, e.cause, e.references, e.detail,
                   memory=e.memory)


STOP_EVIDENCE: TypeAdapter[StopEvidence] = TypeAdapter(StopEvidence)


# An interval wider than this factor (high / low), or with a bound outside SHOWN, says nothing a reader can
# use: the words say what would decide it instead (docs/matrix.md, "Latency and its noise"); verdict.json
# keeps the numbers.
WIDEST = 20.0
SHOWN = (0.001, 1000.0)


def fmt_ratio(x: float) -> str:
    """A latency ratio for a sentence, inside SHOWN ("<0.001×", ">1000×" beyond it)."""
    if not x < SHOWN[1]:
        return f">{SHOWN[1]:g}×"
    return f"<{SHOWN[0]:g}×" if x < SHOWN[0] else f"{x:.2g}×" if x < 0.01 else f"{x:.2f}×"


@dataclass(frozen=True)
class Latency:
    """An offload flag set's latency over a reference: the ratio (of `measure`s) and the interval its
    samples allow."""

    ratio: float
    low: float
    high: float
    reference: str  # what it was compared with, in words
    reference_wall_s: float
    samples: tuple[int, int]  # timed sends: offload side, reference side
    references: int | None = None  # the count both sides were timed at (the console and report say it)
    # The two cells compared, as (flags, references); the reference side is None for a baseline wall time.
    sides: tuple[tuple[str, int], tuple[str, int] | None] | None = None
    measure: str = "medians"  # the ratio is of "medians" (bootstrap) or of "geometric means" (auto)
    decide_at: int | None = None  # about this many timed sends a side would decide it (auto, an open ratio)
    exhausted: bool = False  # auto: both sides at max_repeats, more sends are not planned
    paired: bool = False  # paired by seed

    @property
    def bounded(self) -> bool:
        return math.isfinite(self.high)

    @property
    def informative(self) -> bool:
        """An interval worth printing: bounded, at most WIDEST wide, both bounds inside SHOWN."""
        low, high = round(self.low, 2), round(self.high, 2)  # as printed: 0.2017–4.0299 reads 0.20–4.03 (20.15×)
        return (self.bounded and low > 0 and high / low <= WIDEST and SHOWN[0] <= low and high <= SHOWN[1])

    def figure(self, limit: float | None = None) -> str:
        """"1.20× (geometric means) [0.95–1.52]", or what would bound it (against `limit`, when given)."""
        head = f"{fmt_ratio(self.ratio)} ({self.measure}{', paired by seed' if self.paired else ''})"
        if self.informative:
            return f"{head} [{self.low:.2f}–{self.high:.2f}]"
        return f"{head}, {self.unbounded_words(limit)}"

    def unbounded_words(self, limit: float | None = None) -> str:
        n = min(self.samples)
        sends = f"{n} timed send{'' if n == 1 else 's'} a side"
        if not self.bounded and self.decide_at is None:
            return f"not yet bounded ({sends}, no spread measured yet)"
        against = f" against {limit:g}×" if limit is not None else ""
        more = (f"; about {self.decide_at} would decide it{against}" if self.decide_at is not None
                and not self.exhausted else "")
        return f"not yet bounded ({sends}{more})"

    def text(self, limit: float | None = None) -> str:
        return f"latency ratio {self.figure(limit)} vs {self.reference}"

    def straddles(self, limit: float) -> str:
        """A ratio open against the limit, in a few words."""
        return f"{self.figure(limit)} straddles {limit:g}" if self.informative else self.figure(limit)


@dataclass(frozen=True)
class Decision:
    """What a rule decided: the world, the flag set and cell that decided it, its latency, and why every
    other flag set does not decide it (`stops`, in matrix order)."""

    world: World
    flags: str | None = None
    cell: Cell | None = None
    latency: Latency | None = None
    stops: tuple[Blocked, ...] = ()
    notes: tuple[str, ...] = ()


def _short(line: str) -> str:
    """A log line for a one-line reason: without its leading timestamp, about 200 characters, cut where
    units.clip cuts (never between a number and its unit; the evidence keeps it whole)."""
    return clip(without_stamp(line), 200)


# verdict.json's form of a Verdict (pydantic reads the dataclasses; runner.present.schemas publishes its schema)


_VERDICT_JSON = TypeAdapter(Verdict)
