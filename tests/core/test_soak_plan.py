"""The soak's plan, pure (runner.plan.matrix's [soak] checks, runner.plan.soak): every bad [soak] is one line naming
the file, the key and the value, through the matrix loader; which cards and flag sets a soak may take; what request
n sends — `cycle` ascending rounds, a seeded `shuffle` that a resume recomputes exactly, fixtures and seeds one
per round as the module's docstring states."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from runner.core.errors import UserError
from runner.plan import soak as soak_plan
from runner.plan.matrix import Matrix, load_matrix

OTHER_CARD = '[cards.other]\nserver = "ref"\nvram_gib = 0.5\n\n[cards.small]'


def write(d: Path, soak: str, *, edits: tuple[tuple[str, str], ...] = ()) -> Path:
    """The conftest's minimal matrix with `edits` applied (each `old` must be there) and `soak` as its [soak]."""
    path, pristine = d / "matrix.toml", d / "matrix.toml.pristine"
    if not pristine.exists():
        pristine.write_text(path.read_text())
    text = pristine.read_text()
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new, 1)
    path.write_text(f"{text}\n[soak]\n{soak}\n")
    return path


def load(d: Path, soak: str, *, edits: tuple[tuple[str, str], ...] = ()) -> Matrix:
    return load_matrix(write(d, soak, edits=edits))


# --- every bad [soak]: one line naming file, key and value ------------------------------------------------------

EXCLUDE_ON_SMALL = ("[matrix]\nreferences = [1, 2]",
                    '[matrix]\nreferences = [1, 2]\nexclude = [{card = "small", flags = "host-cache"}]')
ONLY_DEFAULT = ("[matrix]\nreferences = [1, 2]", '[matrix]\nreferences = [1, 2]\nflags = ["default"]')
ONLY_SMALL = ("[matrix]\nreferences = [1, 2]", '[matrix]\nreferences = [1, 2]\ncards = ["small"]')


@pytest.mark.parametrize(("soak", "edits", "expected"), [
    # requests
    ("minutes = 3", (), "key 'soak.requests' is required"),
    ("requests = 0", (), "key 'soak.requests' must be between 1 and 1000000, got 0"),
    ("requests = -5", (), "key 'soak.requests' must be between 1 and 1000000, got -5"),
    ("requests = 1000001", (), "key 'soak.requests' must be between 1 and 1000000, got 1000001"),
    ('requests = "many"', (), "key 'soak.requests' must be an integer, got 'many'"),
    ("requests = true", (), "key 'soak.requests' must be an integer, got True"),
    ("requests = 2.5", (), "key 'soak.requests' must be an integer, got 2.5"),
    # minutes
    ("requests = 5\nminutes = 0", (), "key 'soak.minutes' must be > 0 and <= 10080, got 0"),
    ("requests = 5\nminutes = -1", (), "key 'soak.minutes' must be > 0 and <= 10080, got -1"),
    ("requests = 5\nminutes = 1e9", (), "key 'soak.minutes' must be > 0 and <= 10080, got 1000000000.0"),
    ("requests = 5\nminutes = nan", (), "key 'soak.minutes' must be a finite number, got nan"),
    ("requests = 5\nminutes = inf", (), "key 'soak.minutes' must be a finite number, got inf"),
    ('requests = 5\nminutes = "30"', (), "key 'soak.minutes' must be a number, got '30'"),
    # references
    ("requests = 5\nreferences = []", (), "key 'soak.references' must hold at least 1 item(s), got []"),
    ("requests = 5\nreferences = [2, 1, 2]", (), "key 'soak.references' lists 2 twice"),
    ('requests = 5\nreferences = [1, "2"]', (), "key 'soak.references[1]' must be an integer, got '2'"),
    ("requests = 5\nreferences = [-1]", (), "key 'soak.references[0]' must be between 0 and 64, got -1"),
    ("requests = 5\nreferences = 2", (), "key 'soak.references' must be a list, got 2"),
    # order and its seed
    ('requests = 5\norder = "random"', (), "key 'soak.order' must be 'cycle' or 'shuffle', got 'random'"),
    ("requests = 5\norder = 1", (), "key 'soak.order' must be 'cycle' or 'shuffle', got 1"),
    ("requests = 5\nseed = -1", (), "key 'soak.seed' must be between 0 and 9223372036854775807, got -1"),
    # names: unknown, listed twice, listing none, or left out by [matrix]
    ('requests = 5\ncards = ["big"]', (), "key 'soak.cards' names unknown card 'big' (known: small)"),
    ('requests = 5\nflags = ["turbo"]', (), "key 'soak.flags' names unknown flag set 'turbo' (known: default, "
                                            "host-cache)"),
    ('requests = 5\nflags = ["default", "default"]', (), "key 'soak.flags' names 'default' twice"),
    ("requests = 5\ncards = []", (), "key 'soak.cards' must hold at least 1 item(s), got []"),
    ("requests = 5\nflags = []", (), "key 'soak.flags' must hold at least 1 item(s), got []"),
    ('requests = 5\ncards = ["other"]', (("[cards.small]", OTHER_CARD), ONLY_SMALL),
     "key 'soak.cards' names card 'other', which [matrix] cards leaves out (runs: small)"),
    ('requests = 5\nflags = ["host-cache"]', (ONLY_DEFAULT,),
     "key 'soak.flags' names flag set 'host-cache', which [matrix] flags leaves out (runs: default)"),
    # a flag set the matrix excludes on every soaked card (here the only card)
    ('requests = 5\nflags = ["host-cache"]', (EXCLUDE_ON_SMALL,),
     "key 'soak.flags' names flag set 'host-cache', which no soaked card runs ([matrix] exclude leaves it out on "
     "small)"),
    # … and on every card [soak] cards names, though another card runs it
    ('requests = 5\nflags = ["host-cache"]\ncards = ["small"]', (("[cards.small]", OTHER_CARD), EXCLUDE_ON_SMALL),
     "key 'soak.flags' names flag set 'host-cache', which no soaked card runs ([matrix] exclude leaves it out on "
     "small)"),
    # counts a fixture cannot send (the fixture holds 2 images)
    ("requests = 5\nreferences = [1, 3]", (), "key 'soak.references' asks for 3 reference(s) but fixture 'pair' "
                                             "holds 2 image(s)"),
    ("requests = 5\nrequest = 5", (), "unknown key 'soak.request'"),
])
def test_a_bad_soak_table_is_one_line_naming_its_key_and_value(matrix_dir: Path, soak: str,
                                                                edits: tuple[tuple[str, str], ...],
                                                                expected: str) -> None:
    path = write(matrix_dir, soak, edits=edits)
    with pytest.raises(UserError) as info:
        load_matrix(path)
    message = str(info.value)
    assert message == f"{path}: {expected}"


def test_a_flag_set_excluded_on_one_soaked_card_is_soaked_on_the_other(matrix_dir: Path) -> None:
    m = load(matrix_dir, 'requests = 5\nflags = ["host-cache", "default"]',
             edits=(("[cards.small]", OTHER_CARD), EXCLUDE_ON_SMALL))
    assert soak_plan.soaked_cards(m) == ("other", "small")  # the matrix's order
    assert soak_plan.named_flags(m, "other") == ("default", "host-cache")  # the matrix's order, not [soak]'s
    assert soak_plan.named_flags(m, "small") == ("default",)


def test_the_soak_defaults_to_the_matrixs_counts_and_every_card(matrix_dir: Path) -> None:
    m = load(matrix_dir, "requests = 7")
    assert m.soak is not None and m.soak.counts == (1, 2) and m.soak.order == "cycle"
    assert soak_plan.soaked_cards(m) == ("small",)
    assert soak_plan.named_flags(m, "small") is None  # profiles.json decides, after the card's sessions
    assert soak_plan.candidates(m, "small") == ("default", "host-cache")  # the plan's upper bound


def test_a_card_not_named_is_not_soaked(matrix_dir: Path) -> None:
    m = load(matrix_dir, 'requests = 5\ncards = ["small"]', edits=(("[cards.small]", OTHER_CARD),))
    assert soak_plan.soaked_cards(m) == ("small",)
    assert soak_plan.candidates(m, "other") == () and soak_plan.candidates(m, "small") == ("default", "host-cache")


def test_without_a_soak_table_nothing_is_soaked(matrix_dir: Path) -> None:
    m = load_matrix(matrix_dir / "matrix.toml")
    assert m.soak is None and soak_plan.soaked_cards(m) == () and soak_plan.describe(m) == []


# --- what request n sends ----------------------------------------------------------------------------------------

def counts(m: Matrix, upto: int, start: int = 1) -> list[int]:
    assert m.soak is not None
    return [soak_plan.count_at(m.soak, n) for n in range(start, upto + 1)]


def test_cycle_sends_the_counts_ascending_round_after_round(matrix_dir: Path) -> None:
    m = load(matrix_dir, "requests = 9\nreferences = [2, 0, 1]")
    assert counts(m, 9) == [0, 1, 2, 0, 1, 2, 0, 1, 2]


def test_shuffle_sends_every_count_once_per_round_in_a_seeded_order(matrix_dir: Path) -> None:
    m = load(matrix_dir, 'requests = 60\nreferences = [0, 1, 2]\norder = "shuffle"\nseed = 7')
    got = counts(m, 60)
    rounds = [got[i:i + 3] for i in range(0, 60, 3)]
    assert all(sorted(r) == [0, 1, 2] for r in rounds)  # each round is a permutation of the counts
    assert len({tuple(r) for r in rounds}) > 1  # and not one fixed order (20 rounds, 6 orders)
    assert rounds != [[0, 1, 2]] * 20


def test_the_shuffle_is_the_same_on_every_call_and_a_resume_continues_it(matrix_dir: Path) -> None:
    """Request n's count is a function of ([soak], n) alone: a resume at request 23 (a fresh process, no state)
    sends what the uninterrupted soak would have. Pinned: a run recorded by this version resumes the same
    sequence under the next (changing the draw would mix two sequences in one soak)."""
    soak = 'requests = 40\nreferences = [1, 2, 3, 4]\norder = "shuffle"\nseed = 2301'
    m = load(matrix_dir, soak, edits=(('"refs/b.png"]', '"refs/b.png", "refs/a.png", "refs/b.png"]'),))
    whole = counts(m, 40)
    assert counts(m, 40) == whole
    assert counts(m, 40, start=23) == whole[22:]
    assert whole[:12] == [2, 3, 1, 4, 4, 1, 3, 2, 3, 2, 4, 1]
    other = load(matrix_dir, soak.replace("2301", "2302"),
                 edits=(('"refs/b.png"]', '"refs/b.png", "refs/a.png", "refs/b.png"]'),))
    assert counts(other, 40) != whole  # the seed decides the order


def test_fixtures_and_seeds_cycle_one_per_round(matrix_dir: Path) -> None:
    """Round r sends fixture r mod F with seed r // F mod S: after F × S rounds every count has gone out with
    every fixture and seed, each exactly once, and the sequence starts over."""
    m = load(matrix_dir, 'requests = 100\norder = "shuffle"\nseed = 3', edits=(
        ("seeds = [1, 2]", "seeds = [11, 12, 13]"),
        ("[matrix]", '[fixtures.solo]\nprompt = "a dog"\nreferences = ["refs/b.png", "refs/a.png"]\n\n[matrix]')))
    fixtures, seeds, per_round = ("pair", "solo"), (11, 12, 13), 2
    steps = [soak_plan.step_at(m, "small", "default", n) for n in range(1, 2 * 2 * 3 * per_round + 1)]
    assert [(s.number, s.card, s.flags) for s in steps[:2]] == [(1, "small", "default"), (2, "small", "default")]
    for n, s in enumerate(steps, start=1):
        rnd = (n - 1) // per_round
        assert (s.fixture, s.seed) == (fixtures[rnd % 2], seeds[(rnd // 2) % 3]), s
    period = 2 * 3 * per_round  # F × S rounds
    sent = Counter((s.references, s.fixture, s.seed) for s in steps[:period])
    assert set(sent) == {(c, f, sd) for c in (1, 2) for f in fixtures for sd in seeds} and set(sent.values()) == {1}
    assert {(s.fixture, s.seed) for s in steps[period:]} == {(s.fixture, s.seed) for s in steps[:period]}
    assert [(s.fixture, s.seed) for s in steps[period:]] == [(s.fixture, s.seed) for s in steps[:period]]


def test_the_plan_says_where_and_what_the_soak_mixes(matrix_dir: Path) -> None:
    m = load(matrix_dir, 'requests = 200\nminutes = 30\norder = "shuffle"\nseed = 9\nflags = ["host-cache"]')
    assert m.soak is not None and soak_plan.bounds_text(m.soak) == "200 request(s) (at most 30 min)"
    head, card = soak_plan.describe(m)
    assert "200 request(s) (at most 30 min) per soaked flag set" in head
    assert "counts 1 ref, 2 refs (shuffled per round, seed 9)" in head
    assert card == "  soak small: host-cache"
    unnamed = soak_plan.describe(load(matrix_dir, "requests = 3"))
    assert "(ascending, repeated)" in unnamed[0]
    assert unnamed[1] == ("  soak small: the flag sets profiles.json lists at every count above, known after its "
                          "sessions (at most default, host-cache)")
