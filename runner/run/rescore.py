"""After a run: score every served image against the baseline cell's image of the same fixture, references
and seed (the cell's session ran first on its card, but lanes never wait on each other, so this is done
once all lanes are finished). Reads and rewrites step records only; a record whose scores do not change is
not rewritten."""

from __future__ import annotations

from runner.core.records import Status
from runner.judge import scoring
from runner.plan.matrix import Matrix
from runner.run.store import RunStore


def rescore_against_cell(matrix: Matrix, store: RunStore) -> int:
    """Returns how many records changed."""
    b = matrix.baseline
    if not b or not b.cell:
        return 0
    rules = matrix.verdict
    steps = store.load_steps()
    card, flags = b.cell
    base = {(s.card if card is None else None, s.fixture, s.references, s.seed): s for s in steps
            if s.card == (card or s.card) and s.flags == flags and s.status == Status.OK}
    changed = 0
    for s in steps:
        if s.status != Status.OK:
            continue
        png = store.read_png(s.key)
        if png is None:
            continue
        ref = base.get((s.card if card is None else None, s.fixture, s.references, s.seed))
        ref_png = store.read_png(ref.key) if ref else None
        scores = scoring.score(scoring.decode(png), scoring.decode(ref_png) if ref_png else None,
                               ref.key if ref else None, max_transparent_share=rules.max_transparent_share,
                               min_pixel_std=rules.min_pixel_std, expected_size=matrix.run.size)
        if ref is None:
            scores = scores.model_copy(update={"reason": f"baseline cell {card or s.card}/{flags} has no image "
                                                         f"for this fixture, reference count and seed"})
        if scores != s.scores:
            store.write_step(s.model_copy(update={"scores": scores}))
            changed += 1
    return changed
