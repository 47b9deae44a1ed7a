"""Issue 18 item 15, the state parts: memory.csv is appended to, not rewritten; report.md and the plots are
replaced atomically; a report after a resume redraws only the sessions whose records changed; the reason
for an undecodable image carries no memory address."""

from __future__ import annotations

import time
from pathlib import Path

from runner.core.records import Peak, ServerStart, SessionRecord, Status, StepRecord
from runner.judge.verdict import decide_all
from runner.plan.lanes import make_plan
from runner.plan.matrix import VerdictRules, load_matrix
from runner.present.report import write_report
from runner.run.execute import Baselines, References, RunContext, Served, SessionRunner
from runner.run.store import RunStore, load_memory


class S:
    """A memory series as the meters hand it to the store."""

    def __init__(self, t: list[float], v: list[int], source: str = "host", metric: str = "host") -> None:
        self.source, self.metric, self.t, self.value = source, metric, tuple(t), tuple(v)


def test_memory_csv_is_appended_not_rewritten(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    store.write_memory("c/f", [S([1.0, 2.0], [10, 20])], attempt=0)
    path = tmp_path / "c/f/memory.csv"
    first, inode = path.read_bytes(), path.stat().st_ino
    # the next flush of the same start hands the whole (grown) series again
    store.write_memory("c/f", [S([1.0, 2.0, 3.0, 4.0], [10, 20, 30, 40])], attempt=0)
    assert path.stat().st_ino == inode and path.read_bytes().startswith(first)  # appended in place
    assert [r[4] for r in load_memory(path)] == [10, 20, 30, 40]
    # a compacted series drops a middle sample it had shown before: nothing is written twice or lost
    store.write_memory("c/f", [S([1.0, 4.0, 5.0], [10, 40, 40])], attempt=0)
    assert [(r[0], r[4]) for r in load_memory(path)] == [(1.0, 10), (2.0, 20), (3.0, 30), (4.0, 40), (5.0, 40)]
    # a later start (a resume: another store) keeps the rows of the earlier one
    with path.open("a") as f:
        f.write("6.0000,0,host,ho")  # a kill in the middle of an append
    RunStore(tmp_path).write_memory("c/f", [S([9.0], [90])], attempt=1)
    rows = load_memory(path)
    assert [(r[1], r[4]) for r in rows] == [(0, 10), (0, 20), (0, 30), (0, 40), (0, 40), (1, 90)]


RULES = VerdictRules(target_references=1, max_latency_ratio=3.0, min_psnr_db=20, offload_roles=("offload",),
                     max_transparent_share=0.5, min_pixel_std=2.0)


def _run(root: Path) -> RunStore:
    store = RunStore(root)
    for flags in ("a", "b"):
        store.write_step(StepRecord(key=f"c/{flags}/refs-1/f-seed-1", card="c", flags=flags, role="default",
                                    fixture="f", references=1, seed=1, status=Status.OK, started_at=101.0,
                                    wall_s=1.0, image="f-seed-1.png", image_sha256=flags,
                                    peaks=(Peak(source="host", metric="host", bytes=5 * 2**20, samples=10,
                                                rate_hz=10.0, available=True),)))
        store.write_session(SessionRecord(key=f"c/{flags}", card="c", flags=flags, role="default", backend="local",
                                          starts=(ServerStart(attempt=0, started_at=100.0, ready_s=1.0, failure=None,
                                                              stopped_at=103.0),)))
        store.write_memory(f"c/{flags}", [S([100.0, 101.0, 102.0], [1 * 2**20, 5 * 2**20, 2 * 2**20])], 0)
    store.write_run({"run_id": "r", "matrix": {"path": "/x/m.toml", "sha256": "0" * 64, "text": ""},
                     "runner": {"version": "0"}, "cards": {"c": {"vram_gib": 1}},
                     "plan": {"sessions": ["c/a", "c/b"]}})
    return store


def _report(store: RunStore) -> Path:
    return write_report(store, decide_all(store.load_steps(), store.load_sessions(), RULES, ["c"]))


def test_report_and_plots_are_replaced_atomically_and_only_changed_sessions_redrawn(tmp_path: Path) -> None:
    store = _run(tmp_path)
    report = _report(store)
    plots = {f: tmp_path / "plots" / f"c--{f}-memory.png" for f in ("a", "b")}
    assert all(p.is_file() for p in plots.values())
    before = {f: (p.stat().st_ino, p.stat().st_mtime_ns) for f, p in plots.items()}
    report_inode = report.stat().st_ino
    time.sleep(0.01)
    # a resume wrote session b again (a new start): only b's memory plot is drawn again
    session = store.load_session("c/b")
    assert session is not None
    store.write_session(session.model_copy(update={"starts": (*session.starts, session.starts[0].model_copy(
        update={"attempt": 1, "started_at": 104.0, "stopped_at": 106.0}))}))
    _report(store)
    assert (plots["a"].stat().st_ino, plots["a"].stat().st_mtime_ns) == before["a"]  # kept as it was
    assert plots["b"].stat().st_mtime_ns > before["b"][1]
    # written to a new file and renamed over the old one: a kill leaves the previous file, never half of one
    assert plots["b"].stat().st_ino != before["b"][0]
    assert report.stat().st_ino != report_inode
    assert not [p for p in tmp_path.rglob(".*") if p.name != ".lock"]  # no temporary file left


def test_undecodable_image_reason_has_no_memory_address(matrix_dir: Path) -> None:
    matrix = load_matrix(matrix_dir / "matrix.toml")
    plan = make_plan(matrix)
    store = RunStore(matrix_dir / "run")
    ctx = RunContext(matrix=matrix, plan=plan, store=store, run_id="r")
    session = plan.sessions[0]
    runner = SessionRunner(ctx, session, References(), Baselines(matrix, store))
    step = session.steps[0]
    record = StepRecord(key=step.key, card=step.card, flags=step.flags, role="default", fixture=step.fixture,
                        references=step.references, seed=step.seed, status=Status.OK, image="x.png",
                        image_sha256="x")
    reasons = set()
    for _ in range(2):
        scored, png = runner.score(Served(record, b"<html>not an image</html>", None))
        assert scored.status == Status.FAILED and png is None and scored.failure is not None
        reasons.add(scored.failure.message)
    (reason,) = reasons  # the same every time
    assert "0x" not in reason and "cannot identify image file" in reason, reason
