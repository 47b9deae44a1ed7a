"""Where each soak stands, read from the records (no server, no meter): which flag sets a card's soak takes, what a
resume still owes, and each card's soak findings for the verdict and the report (runner.judge.findings.soak).
The soak itself runs in runner.run.soak."""

from __future__ import annotations

from runner.core.records import StepRecord
from runner.core.units import GIB
from runner.judge.decision import Verdict
from runner.judge.findings import soak as soak_findings
from runner.judge.findings.models import CardSoak
from runner.judge.findings.profiles import card_profile
from runner.judge.verdict import decide
from runner.plan import baseline
from runner.plan import soak as soak_plan
from runner.plan.lanes import make_plan
from runner.plan.matrix import Matrix
from runner.run.pending import pending, soak_left
from runner.run.store import RunStore


def chosen(matrix: Matrix, store: RunStore, card: str, steps: list[StepRecord]
           ) -> tuple[list[tuple[str, str]], str | None]:
    """The flag sets a card's soak takes, each with why, in the matrix's order; or why none. Named in [soak]
    flags, else those profiles.json lists for the card at every count the soak mixes (from its verdict on
    `steps`, the card's records)."""
    soak = matrix.soak
    assert soak is not None
    named = soak_plan.named_flags(matrix, card)
    if named is not None:
        return [(f, "named in [soak] flags") for f in named], None if named else soak_findings.why_none((), True)
    sessions = [s for f in matrix.axes.flags if (s := store.load_session(f"{card}/{f}")) is not None]
    try:
        wall = baseline.wall_s(matrix)
    except Exception:  # an unreadable baseline only loses the baseline's latency, as in the verdict
        wall = None
    capacity = round(matrix.cards[card].vram_gib * GIB)
    profile = card_profile(decide(card, steps, sessions, matrix.verdict, wall, capacity), matrix.verdict, capacity)
    listed = soak_findings.profiled_flags(profile, soak.counts)
    counts = ", ".join(str(n) for n in soak.counts)
    why = f"listed in profiles.json at every count it mixes ({counts} reference(s))"
    ordered = [f for f in matrix.axes.flags if f in listed]
    return [(f, why) for f in ordered], None if ordered else soak_findings.why_none(soak.counts, False)


def owed(matrix: Matrix, store: RunStore) -> dict[str, int]:
    """Soak requests a resume still owes per card, on the cards whose steps are all done (the banner's figure, and
    the cards a resume's preflight must reach; none without [soak])."""
    if matrix.soak is None:
        return {}
    steps = store.load_steps()
    sessions = store.load_sessions()
    left = {s.card for s in pending(make_plan(matrix), steps, sessions).sessions}
    out = {}
    for card in soak_plan.soaked_cards(matrix):
        if card in left:
            continue
        total = 0
        for flags, _ in chosen(matrix, store, card, [s for s in steps if s.card == card])[0]:
            key = f"{card}/{flags}"
            total += soak_left(matrix.soak, store.load_soak(key), store.load_soak_requests(key))
        if total:
            out[card] = total
    return out


def card_soaks(matrix: Matrix, store: RunStore, verdicts: list[Verdict]) -> dict[str, CardSoak]:
    """Each soaked card's soak findings, from its soak records; a card whose soak took no flag set says why."""
    if matrix.soak is None:
        return {}
    steps = store.load_steps()
    out = {}
    for v in verdicts:
        if v.card not in soak_plan.soaked_cards(matrix):
            continue
        soaked = {}
        for flags in soak_plan.candidates(matrix, v.card):
            record = store.load_soak(f"{v.card}/{flags}")
            if record is not None:
                soaked[flags] = (record, store.load_soak_requests(record.key))
        mine = [s for s in steps if s.card == v.card]
        none = None if soaked else chosen(matrix, store, v.card, mine)[1]
        out[v.card] = soak_findings.card_soak(matrix.soak, soaked, round(matrix.cards[v.card].vram_gib * GIB)
                                              if v.card in matrix.cards else None, none, soak_findings.cell_peaks(mine))
    return out
