"""Matrix → Plan: lanes (run concurrently) → sessions (one server start per card × flag set) → steps
(reference count ascending × fixture × seed, one request at a time). Pure.

A lane is one physical device: cards that name the same GPU on the same host (e.g. two capacities emulated
on one H200) share a lane and run one after another, so a whole-device meter never sees the other card's
server. Cards without a GPU (CPU emulation, accounted memory) get a lane each.

A step's key is its path in the run directory and its resume key.
"""

from __future__ import annotations

from dataclasses import dataclass

from runner.matrix import Matrix
from runner.units import GIB, fmt_bytes


@dataclass(frozen=True)
class Step:
    card: str
    flags: str
    fixture: str
    references: int
    seed: int

    @property
    def key(self) -> str:
        return f"{self.card}/{self.flags}/refs-{self.references}/{self.fixture}-seed-{self.seed}"


@dataclass(frozen=True)
class Session:
    card: str
    flags: str
    steps: tuple[Step, ...]

    @property
    def key(self) -> str:
        return f"{self.card}/{self.flags}"


@dataclass(frozen=True)
class Lane:
    name: str
    cards: tuple[str, ...]
    sessions: tuple[Session, ...]


@dataclass(frozen=True)
class Plan:
    lanes: tuple[Lane, ...]

    @property
    def sessions(self) -> tuple[Session, ...]:
        return tuple(s for lane in self.lanes for s in lane.sessions)

    @property
    def steps(self) -> tuple[Step, ...]:
        return tuple(step for s in self.sessions for step in s.steps)


def _excluded(matrix: Matrix, card: str, flags: str) -> bool:
    return any(ex.get("card", card) == card and ex.get("flags", flags) == flags for ex in matrix.axes.exclude)


def device_of(matrix: Matrix, card: str) -> str:
    c = matrix.cards[card]
    if c.gpu is None:
        return card
    return f"{c.docker_host or 'local'}#gpu{c.gpu}"


def make_plan(matrix: Matrix) -> Plan:
    axes, seeds = matrix.axes, matrix.run.seeds
    by_device: dict[str, list[Session]] = {}
    cards_of: dict[str, list[str]] = {}
    for card in axes.cards:
        flag_names = [f for f in axes.flags if not _excluded(matrix, card, f)]
        # A baseline cell on this card runs first, so its images exist before the others are scored.
        if matrix.baseline and matrix.baseline.cell and matrix.baseline.cell[0] in (card, None):
            flag_names.sort(key=lambda f: f != matrix.baseline.cell[1])
        sessions = tuple(
            Session(card, flags, tuple(Step(card, flags, fx, n, seed)
                                       for n in axes.references for fx in axes.fixtures for seed in seeds))
            for flags in flag_names
        )
        if sessions:
            device = device_of(matrix, card)
            by_device.setdefault(device, []).extend(sessions)
            cards_of.setdefault(device, []).append(card)
    return Plan(tuple(Lane(d, tuple(cards_of[d]), tuple(ss)) for d, ss in by_device.items()))


def describe(plan: Plan, matrix: Matrix) -> str:
    """The text `runner plan` prints: what would start and what would be sent, nothing run."""
    run = matrix.run
    size = "server default" if run.size is None else f"{run.size[0]}x{run.size[1]}"
    lines = [
        f"matrix {matrix.path} (sha256 {matrix.sha256[:12]}), run '{run.name}'",
        f"{len(plan.lanes)} lane(s) in parallel, {len(plan.sessions)} server start(s), "
        f"{len(plan.steps)} request(s); {run.steps} steps, size {size}, seeds {list(run.seeds)}",
    ]
    for lane in plan.lanes:
        if len(lane.cards) > 1:
            lines.append(f"lane {lane.name}: cards {', '.join(lane.cards)} share this device, one after another")
        for s in lane.sessions:
            if s is next(x for x in lane.sessions if x.card == s.card):
                card = matrix.cards[s.card]
                where = card.backend if card.backend == "local" else f"docker {card.docker_host or 'local engine'}"
                lines.append(f"card {s.card}: {fmt_bytes(card.vram_gib * GIB)}, gpu {card.gpu or '-'}, {where}, "
                             f"server '{card.server}', meters {', '.join(card.meters)}")
            fs = matrix.flags[s.flags]
            args = " ".join(fs.args) or "(no extra args)"
            env = " ".join(f"{k}={v}" for k, v in fs.env.items())
            lines.append(f"  session {s.key} [{fs.role}]: {args}{'  env ' + env if env else ''}")
            refs = sorted({st.references for st in s.steps})
            lines.append(f"    {len(s.steps)} request(s): references {refs} × fixtures "
                         f"{list(matrix.axes.fixtures)} × seeds {list(run.seeds)}")
    if matrix.baseline:
        b = matrix.baseline
        cell = b.cell and (f"{b.cell[0]}/{b.cell[1]}" if b.cell[0] else f"each card's own '{b.cell[1]}'")
        lines.append(f"baseline: {b.directory if b.directory else 'cell ' + str(cell)}")
    for path in matrix.missing_files:
        lines.append(f"warning: file not found here (needed to run): {path}")
    return "\n".join(lines)
