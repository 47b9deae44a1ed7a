"""Issue 46 X-1: a report draws again only the plots whose inputs changed. A resume that sent one step of a
100-session run redrew all 137 plots (every card's capacity and latency plot at every report; session plots
by file times), 7.9 s of its 8.9 s. Each plot now carries the digest of its inputs (runner.present.redraw)."""

from __future__ import annotations

import os
from pathlib import Path

from PIL import Image

from runner.core.records import Peak, ServerStart, SessionRecord, Status, StepRecord
from runner.judge.verdict import decide_all
from runner.plan.matrix import VerdictRules
from runner.present.report import write_report
from runner.run.store import RunStore

RULES = VerdictRules(target_references=1, max_latency_ratio=3.0, min_psnr_db=20, offload_roles=("offload",),
                     max_transparent_share=0.5, min_pixel_std=2.0)
CARDS, FLAGS = ("c1", "c2"), ("a", "b")


class S:
    """A memory series as the meters hand it to the store."""

    def __init__(self, t: list[float], v: list[int]) -> None:
        self.source, self.metric, self.t, self.value = "host", "host", tuple(t), tuple(v)


def step(card: str, flags: str, wall_s: float = 1.0) -> StepRecord:
    return StepRecord(key=f"{card}/{flags}/refs-1/f-seed-1", card=card, flags=flags, role="default", fixture="f",
                      references=1, seed=1, status=Status.OK, started_at=101.0, wall_s=wall_s,
                      wall_samples_s=(wall_s,), image="f-seed-1.png", image_sha256=flags,
                      peaks=(Peak(source="host", metric="host", bytes=5 * 2**20, samples=10, rate_hz=10.0,
                                  available=True),))


def a_run(root: Path) -> RunStore:
    store = RunStore(root)
    for card in CARDS:
        for flags in FLAGS:
            store.write_step(step(card, flags))
            store.write_session(SessionRecord(key=f"{card}/{flags}", card=card, flags=flags, role="default",
                                              backend="local", starts=(ServerStart(attempt=0, started_at=100.0,
                                                                                   ready_s=1.0, failure=None,
                                                                                   stopped_at=103.0),)))
            store.write_memory(f"{card}/{flags}", [S([100.0, 101.0, 102.0], [2**20, 5 * 2**20, 2 * 2**20])], 0)
    store.write_run({"run_id": "r", "matrix": {"path": "/x/m.toml", "sha256": "0" * 64, "text": ""},
                     "runner": {"version": "0"}, "cards": {c: {"vram_gib": 1} for c in CARDS},
                     "plan": {"sessions": [f"{c}/{f}" for c in CARDS for f in FLAGS]}})
    return store


def report(store: RunStore) -> None:
    write_report(store, decide_all(store.load_steps(), store.load_sessions(), RULES, list(CARDS)))


def drawn(store: RunStore) -> dict[str, tuple[int, int]]:
    """Each plot file's inode and mtime: a plot drawn again is a new file renamed over the old one."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (store.root / "plots").glob("*.png")}


def test_a_report_of_unchanged_records_draws_nothing_again(tmp_path: Path) -> None:
    store = a_run(tmp_path)
    report(store)
    before = drawn(store)
    assert {"c1-capacity.png", "c1-latency.png", "c2-latency.png", "c1--a-memory.png"} <= set(before)
    report(store)
    assert drawn(store) == before


def test_one_changed_step_redraws_its_cards_plots_and_its_sessions_only(tmp_path: Path) -> None:
    store = a_run(tmp_path)
    report(store)
    before = drawn(store)
    store.write_step(step("c1", "b", wall_s=1.5))  # what a resume that sent one step of c1/b changed
    report(store)
    after = drawn(store)
    changed = {name for name in before if after[name] != before[name]}
    assert changed == {"c1-capacity.png", "c1-latency.png", "c1--b-memory.png"}, changed


def test_a_change_written_with_an_older_file_time_is_still_drawn(tmp_path: Path) -> None:
    """A record restored from a backup, or copied with its times kept, is older than the plot: the file times
    said "fresh" and the plot kept showing what the records no longer say."""
    store = a_run(tmp_path)
    report(store)
    before = drawn(store)["c2--a-memory.png"]
    store.write_memory("c2/a", [S([103.0, 104.0], [3 * 2**20, 9 * 2**20])], 1)  # another start's samples
    folder = store.session_dir("c2/a")
    for path in folder.rglob("*"):
        os.utime(path, ns=(1, 1))  # the times of 1970
    report(store)
    assert drawn(store)["c2--a-memory.png"] != before


def test_what_stands_in_a_plots_place_is_replaced_by_the_plot(tmp_path: Path) -> None:
    """Both are newer than every record: a plot by their file times, kept before (the FIFO linked from
    report.md, the garbage shown as the plot)."""
    store = a_run(tmp_path)
    report(store)
    fifo, garbage = store.root / "plots" / "c1--a-memory.png", store.root / "plots" / "c2--b-memory.png"
    fifo.unlink()
    os.mkfifo(fifo)
    garbage.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\xff" * 64)  # a PNG signature, then nothing of a PNG
    report(store)
    assert fifo.is_file() and not fifo.is_fifo()
    for image in (fifo, garbage):
        with Image.open(image) as png:
            png.load()  # a whole plot again
