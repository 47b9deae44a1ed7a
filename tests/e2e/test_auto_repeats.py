"""`repeats = "auto"` end to end against the reference server's jitter fault: a ratio clearly under the limit
is decided after few sends, one at the limit ends undecided after max_repeats on both sides, one clearly
over is rejected. The 20 seeded trials at the limit are tests/core/test_sequential.py (the same procedure,
without processes); this is the one run with real servers, restarts and records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_run import matrix, no_server_left, run

pytestmark = pytest.mark.slow
MAX = 4  # max_repeats: levels 1, 2, 4 (the 20 trials at 8 are the simulation's)


def _cell_levels(run_dir: Path, card: str, flags: str, n: int) -> list[int]:
    return [len(json.loads(p.read_text())["wall_samples_s"])
            for p in sorted((run_dir / card / flags / f"refs-{n}").glob("*.json"))]


def test_auto_decides_under_and_over_quickly_and_leaves_the_limit_undecided_after_max_repeats(
        tmp_path: Path) -> None:
    # Default OOMs at 3 references (7.75 MiB), the conditioning cache in host memory serves 3: the ratio is
    # cond-host over default at 2 references, 2 seeds a side. Both pay the same compute (≈ 1 on the CPU), so
    # with the default's jitter on the offload too the ratio sits on a limit of 1 whatever the machine's load;
    # under ≈ 0.45 (offload 0.8–1.2 s over default 2–2.8 s), over ≈ 2. The limit's two sides draw the *same*
    # sleeps (seed 7: by request number, on every start alike), so their ratio is 1 by construction, not by
    # luck: with independent draws (`pid`) a run drew 2.2–2.7 s for the offload against 2.5–2.8 s for the
    # default and decided 0.90× [0.82–0.98] (a fresh clone, 2026-12-04), the error the procedure allows at
    # the limit. The other offloads keep `pid`: fresh draws at every start.
    path = matrix(tmp_path, """
        [cards.under]
        server = "ref"
        vram_mib = 7.75

        [cards.at-limit]
        server = "ref"
        vram_mib = 7.75

        [cards.over]
        server = "ref"
        vram_mib = 7.75

        [flags.default]
        role = "default"
        args = ["--fault", "jitter=2:2.8:7"]

        [flags.host-under]
        role = "offload"
        args = ["--cond-cache", "host", "--fault", "jitter=0.8:1.2:pid"]

        [flags.host-at-limit]
        role = "offload"
        args = ["--cond-cache", "host", "--fault", "jitter=2:2.8:7"]

        [flags.host-over]
        role = "offload"
        args = ["--cond-cache", "host", "--fault", "jitter=5:6:pid"]

        [matrix]
        references = [1, 2, 3]
        exclude = [{card = "under", flags = "host-at-limit"}, {card = "under", flags = "host-over"},
                   {card = "at-limit", flags = "host-under"}, {card = "at-limit", flags = "host-over"},
                   {card = "over", flags = "host-under"}, {card = "over", flags = "host-at-limit"}]

        [verdict]
        max_latency_ratio = 1
        """, seeds="[1, 2]", repeats=f'"auto"\nmax_repeats = {MAX}',  # type: ignore[arg-type]
        diagnosis="off")  # the default's OOMs bound the ratio's cells; what held their memory is not read here
    proc, run_dir = run(path, timeout=600)
    assert proc.returncode == 1, proc.stderr[-2000:]  # the card at the limit is undecided
    verdicts = {v["card"]: v for v in json.loads((run_dir / "verdict.json").read_text())["verdicts"]}

    under = verdicts["under"]
    assert under["world"] == "offload-works" and under["flags"] == "host-under", under["reason"]
    assert under["evidence"]["latency_interval"][1] <= 1
    under_levels = _cell_levels(run_dir, "under", "host-under", 2) + _cell_levels(run_dir, "under", "default", 2)
    # How soon is the machine's noise: 2 sends a side when idle, 4 (max_repeats) in a clean-clone run on a
    # machine at half speed. That a clear ratio stops early is tests/core/test_sequential.py's, with seeded noise.
    assert set(under_levels) <= {1, 2, MAX}
    assert _cell_levels(run_dir, "under", "host-under", 1) == [1, 1]  # cells outside the ratio: one send

    at = verdicts["at-limit"]
    assert at["world"] == "undecided" and "straddles 1" in at["reason"], at["reason"]
    assert _cell_levels(run_dir, "at-limit", "host-at-limit", 2) == [MAX, MAX]
    assert _cell_levels(run_dir, "at-limit", "default", 2) == [MAX, MAX]
    sessions = {f: json.loads((run_dir / "at-limit" / f / "session.json").read_text())
                for f in ("default", "host-at-limit")}
    assert sum(len(s["starts"]) for s in sessions.values()) <= 2 + 2  # at most one restart per level above 1
    assert any("top-up" in n for s in sessions.values() for n in s["notes"])

    over = verdicts["over"]
    assert over["world"] == "not-built", over["reason"]
    host = over["evidence"]["flag_sets"]["host-over"]
    assert host["stop"] == "latency" and "too slow" in host["why"]
    over_levels = _cell_levels(run_dir, "over", "host-over", 2) + _cell_levels(run_dir, "over", "default", 2)
    assert set(over_levels) <= {1, 2, MAX}
    no_server_left(run_dir)
