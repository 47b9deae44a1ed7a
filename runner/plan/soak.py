"""The soak's plan, pure: which cards and flag sets it may soak, and what its request number n sends.

A soak sends `[soak] requests` requests one at a time to one fresh server start of each soaked flag set, after
the card's sessions. Request n's reference count comes from rounds of the soak's counts: `cycle` sends each
round in ascending order, `shuffle` each round in a random order drawn from `[soak] seed` and the round's number
(so a resume continues the same sequence). Fixtures and seeds cycle as the matrix's do, one (fixture, seed) per
round: round r sends fixture r mod F, with the seed r // F mod S — after F × S rounds every count has gone out
with every fixture and seed.

Which flag sets: those `[soak] flags` names (where the card runs them), else those profiles.json lists for the
card at every count the soak mixes — known only after the card's sessions (runner.judge.findings.soak.
profiled_flags); `candidates` is the plan's upper bound (every flag set the card runs).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from runner.core.units import refs_text
from runner.plan.matrix import Matrix, Soak


@dataclass(frozen=True)
class SoakStep:
    """What request `number` (1-based) of a soak sends."""

    card: str
    flags: str
    number: int
    references: int
    fixture: str
    seed: int


def soaked_cards(matrix: Matrix) -> tuple[str, ...]:
    """The cards a soak runs on, in the matrix's order (none without [soak])."""
    if matrix.soak is None:
        return ()
    named = matrix.soak.cards
    return tuple(c for c in matrix.axes.cards if named is None or c in named)


def named_flags(matrix: Matrix, card: str) -> tuple[str, ...] | None:
    """The flag sets [soak] flags names that this card runs; None: not named (profiles.json decides)."""
    if matrix.soak is None or matrix.soak.flags is None:
        return None
    return tuple(f for f in matrix.axes.flags if f in matrix.soak.flags and matrix.axes.kept(card, f))


def candidates(matrix: Matrix, card: str) -> tuple[str, ...]:
    """The flag sets a card's soak may take: those named, else every flag set the card runs (the plan's upper
    bound, for its cost and time estimate)."""
    if card not in soaked_cards(matrix):
        return ()
    named = named_flags(matrix, card)
    return named if named is not None else tuple(f for f in matrix.axes.flags if matrix.axes.kept(card, f))


def count_at(soak: Soak, number: int) -> int:
    """The reference count request `number` sends."""
    counts = soak.counts
    rnd, place = divmod(number - 1, len(counts))
    if soak.order == "shuffle":
        counts = tuple(random.Random(soak.seed * 1_000_003 + rnd).sample(counts, len(counts)))
    return counts[place]


def step_at(matrix: Matrix, card: str, flags: str, number: int) -> SoakStep:
    """Request `number` of the soak of card × flags (its fixture and seed: one per round, cycling)."""
    assert matrix.soak is not None, "a soak step needs [soak]"
    rnd = (number - 1) // len(matrix.soak.counts)
    fixtures, seeds = matrix.axes.fixtures, matrix.run.seeds
    return SoakStep(card, flags, number, count_at(matrix.soak, number), fixtures[rnd % len(fixtures)],
                    seeds[(rnd // len(fixtures)) % len(seeds)])


def bounds_text(soak: Soak) -> str:
    """"200 requests (at most 30 min)" — what stops a soak besides its first failure."""
    minutes = "" if soak.minutes is None else f" (at most {soak.minutes:g} min)"
    return f"{soak.requests} request(s){minutes}"


def describe(matrix: Matrix) -> list[str]:
    """`runner plan`'s lines for the soak: where it runs, on what, and what it mixes."""
    soak = matrix.soak
    if soak is None:
        return []
    counts = ", ".join(refs_text(n) for n in soak.counts)
    order = "ascending, repeated" if soak.order == "cycle" else f"shuffled per round, seed {soak.seed}"
    lines = [f"soak after each card's sessions: {bounds_text(soak)} per soaked flag set, one at a time on one "
             f"fresh server start; counts {counts} ({order}); fixtures × seeds cycle one per round; stops at the "
             "first failure; recorded apart (<card>/<flags>/soak/), never a matrix cell's sample or peak"]
    for card in soaked_cards(matrix):
        named = named_flags(matrix, card)
        if named is not None:
            lines.append(f"  soak {card}: {', '.join(named)}")
        else:
            lines.append(f"  soak {card}: the flag sets profiles.json lists at every count above, known after its "
                         f"sessions (at most {', '.join(candidates(matrix, card))})")
    return lines
