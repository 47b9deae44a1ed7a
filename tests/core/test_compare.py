"""`runner compare`: two runs' verdict.json → what changed, over the real CLI."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from test_verdict import RULES, session, step

from runner.core.records import FailureClass, Status
from runner.judge.verdict import decide
from runner.present.compare import load_summary, render


def write_run(root: Path, run_id: str, steps: list, sessions: list) -> Path:
    root.mkdir(parents=True)
    verdict = decide("c", steps, sessions, RULES)
    (root / "verdict.json").write_text(json.dumps({"run_id": run_id, "verdicts": [verdict.to_json()]}))
    return root


def test_compare_names_verdict_and_cell_changes(tmp_path: Path) -> None:
    before = write_run(tmp_path / "a", "run-a", [
        step("default", "default", 1, gib=10), step("default", "default", 2, Status.FAILED, kind=FailureClass.OOM)],
        [session("default", "default")])
    after = write_run(tmp_path / "b", "run-b", [
        step("default", "default", 1, gib=9, wall=0.5), step("default", "default", 2, gib=11)],
        [session("default", "default")])
    out = tmp_path / "compare.md"
    proc = subprocess.run([sys.executable, "-m", "runner", "compare", str(before), str(after), "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "| c | not-built | fits-resident ⚠️ changed |" in proc.stdout
    assert "| c | default | 2 | not served | served ⚠️ |" in proc.stdout
    # the peak moved beyond meter noise; the wall time is one send per run (no spread): no change claimed
    assert "| c | default | 1 | served | served | peak | -1.00 GiB | 1.00 (1 send) → 0.50 (1 send) | -0.50 (-50%) | " \
        in proc.stdout
    assert out.read_text() == proc.stdout


def _two_seeds(walls: tuple[float, float, float, float]) -> list:
    return [step("default", "default", 1, seed=1, wall=walls[0], samples=walls[:2]),
            step("default", "default", 1, seed=2, wall=walls[2], samples=walls[2:])]


def test_identical_runs_report_no_changed_cells(tmp_path: Path) -> None:
    sessions = [session("default", "default")]
    a = write_run(tmp_path / "a", "run-a", _two_seeds((1.0, 1.2, 0.9, 1.1)), sessions)
    b = write_run(tmp_path / "b", "run-b", _two_seeds((1.0, 1.2, 0.9, 1.1)), sessions)
    text = render(load_summary(a), load_summary(b))
    assert "0 of 1 cell(s) changed beyond noise" in text and "No changed cells." in text


def test_wall_changes_within_the_spread_are_noise_beyond_it_are_changes(tmp_path: Path) -> None:
    sessions = [session("default", "default")]
    a = load_summary(write_run(tmp_path / "a", "run-a", _two_seeds((1.0, 1.2, 0.9, 1.1)), sessions))
    noisy = load_summary(write_run(tmp_path / "b", "run-b", _two_seeds((0.95, 1.25, 1.0, 1.15)), sessions))
    slower = load_summary(write_run(tmp_path / "c", "run-c", _two_seeds((1.5, 1.7, 1.6, 1.55)), sessions))
    assert "No changed cells." in render(a, noisy)  # medians 1.05 → 1.075, well within the spread
    assert "| c | default | 1 | served | served | noise |" in render(a, noisy, show_all=True)
    text = render(a, slower)
    assert "1 of 1 cell(s) changed beyond noise" in text
    assert "| wall | +0.00 MiB | 1.05 [0.90–1.20] → 1.57 [1.50–1.70] | +0.52 (+50%) |" in text


def test_compare_without_verdict_is_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "runner", "compare", str(tmp_path), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "cannot read verdicts" in proc.stderr and "Traceback" not in proc.stderr
    assert "runner report" in proc.stderr  # a run folder without verdict.json: the report writes it


def test_compare_on_a_missing_folder_says_so(tmp_path: Path) -> None:
    missing = tmp_path / "results" / "no-such-run"
    proc = subprocess.run([sys.executable, "-m", "runner", "compare", str(missing), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"runner: error: {missing}: no such run folder (it does not exist)"
    proc = subprocess.run([sys.executable, "-m", "runner", "compare", str(tmp_path), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "not a run directory (no verdict.json, no run.json)" in proc.stderr
    assert "runner report" not in proc.stderr


def test_run_to_run_noise_is_measured_over_all_cells_and_only_outliers_change(tmp_path: Path) -> None:
    """Ten cells whose wall time drifts ±20% between two runs (a shared machine's load) and one that got
    four times slower: only that one is a change."""
    import dataclasses

    sessions = [session("default", "default")]
    a = load_summary(write_run(tmp_path / "a", "run-a", _two_seeds((1.0, 1.02, 0.98, 1.01)), sessions))
    base = next(iter(a.cells.values()))
    drift = (0.8, 1.2, 0.9, 1.1, 0.85, 1.15, 0.95, 1.05, 0.82, 1.18)
    before, after = {}, {}
    for i, f in enumerate((*drift, 4.0)):
        walls = tuple(w * f for w in base.walls_s)
        key = ("c", f"flags-{i}", 1)
        before[key] = dataclasses.replace(base, flags=key[1])
        after[key] = dataclasses.replace(base, flags=key[1], walls_s=walls, wall_s=statistics.median(walls),
                                         wall_min_s=min(walls), wall_max_s=max(walls))
    text = render(dataclasses.replace(a, cells=before), dataclasses.replace(a, cells=after))
    assert "1 of 11 cell(s) changed beyond noise" in text
    first = text.splitlines()[0]  # the band and why it is that wide, before anything else
    assert "a change must clear ×/÷ " in first and "over the 11 cells both runs timed" in first, first
    assert "a shared machine's load moves every cell" in first
    assert "| c | flags-10 | 1 | served | served | wall |" in text
    # with fewer than 5 cells timed in both runs there is no band: the within-run spread (±2%) alone decides
    few = [k for k in before if k[1] in ("flags-0", "flags-1", "flags-2", "flags-3")]
    text = render(dataclasses.replace(a, cells={k: before[k] for k in few}),
                  dataclasses.replace(a, cells={k: after[k] for k in few}))
    assert "4 of 4 cell(s) changed beyond noise" in text and "no run-to-run band (4 cells timed" in text.splitlines()[0]


def test_walls_spread_over_six_hundred_decades_are_a_band_that_says_nothing_not_an_overflow(tmp_path: Path) -> None:
    """Issue 30 C-1: after/before ratios from 1e-300 to 1e300 over six cells (hand-edited verdict.json files)
    overflowed math.exp in the run-to-run band; the band is unbounded and the first line says it tells nothing."""
    import dataclasses

    a = load_summary(write_run(tmp_path / "a", "run-a", _two_seeds((1.0, 1.02, 0.98, 1.01)),
                                     [session("default", "default")]))
    base = next(iter(a.cells.values()))
    before, after = {}, {}
    for i, (x, y) in enumerate([(1e-150, 1e150), (1e150, 1e-150), (1.0, 1.0), (1e-150, 1e150), (1e150, 1e-150),
                                (1.0, 2.0)]):
        key = ("c", f"flags-{i}", 1)
        before[key] = dataclasses.replace(base, flags=key[1], wall_s=x, walls_s=(x, x), wall_min_s=x, wall_max_s=x)
        after[key] = dataclasses.replace(base, flags=key[1], wall_s=y, walls_s=(y, y), wall_min_s=y, wall_max_s=y)
    text = render(dataclasses.replace(a, cells=before), dataclasses.replace(a, cells=after))
    first = text.splitlines()[0]
    assert "is beyond ×/÷ 1000: no change of wall time can be told from it" in first, first
    assert "inf" not in text and "0 of 6 cell(s) changed beyond noise" in text


def test_a_cell_with_three_sends_a_step_and_one_with_one_are_compared_alike(tmp_path: Path) -> None:
    # repeats = "auto" leaves most cells at one send per step and tops up a few: the cells' samples are
    # compared, however many sends per step made them.
    def cell(*per_seed: tuple[float, ...]) -> list:
        return [step("default", "default", 1, seed=i + 1, wall=w[0], samples=w) for i, w in enumerate(per_seed)]

    sessions = [session("default", "default")]
    one = load_summary(write_run(tmp_path / "a", "run-a", cell((1.0,), (1.1,), (0.95,), (1.05,)), sessions))
    three = load_summary(write_run(tmp_path / "b", "run-b", cell((1.02, 0.97, 1.08), (1.04, 0.99, 1.06)), sessions))
    slower = load_summary(write_run(tmp_path / "c", "run-c", cell((2.0, 2.1, 1.95), (2.05, 2.0, 2.1)), sessions))
    assert "No changed cells." in render(one, three) and "No changed cells." in render(three, one)
    assert "1 of 1 cell(s) changed beyond noise" in render(one, slower)


# --- issue 30 C-1, C-3, C-4: foreign verdict.json files and --out paths are one line -------------------------

def _good(tmp: Path) -> Path:
    return write_run(tmp / "good", "run-good", [step("default", "default", 1)], [session("default", "default")])


def _compare(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runner", "compare", *argv], capture_output=True, text=True,
                          timeout=60)


def stop_of(doc: dict) -> dict:
    (story, *_) = doc["verdicts"][0]["evidence"]["flag_sets"].values()
    return story


def test_compare_on_a_verdict_json_of_another_shape_is_one_line(tmp_path: Path) -> None:
    good = _good(tmp_path)
    doc = json.loads((good / "verdict.json").read_text())
    cell = doc["verdicts"][0]["cells"][0]

    def edited(change) -> bytes:  # type: ignore[no-untyped-def]
        d = json.loads(json.dumps(doc))
        change(d)
        return json.dumps(d).encode()

    shapes = {
        "unknown-cell-key": edited(lambda d: d["verdicts"][0]["cells"][0].update(colour="red")),
        "missing-cell-field": edited(lambda d: d["verdicts"][0]["cells"][0].pop("served")),
        "unknown-world": edited(lambda d: d["verdicts"][0].update(world="maybe")),
        "no-verdicts": edited(lambda d: d.pop("verdicts")),
        "a-list": b"[1, 2]",
        "not-utf8": b'{"run_id": "\xff\xfe"}',
        "deep": b"[" * 100_000 + b"]" * 100_000,
        "zero-walls": edited(lambda d: d["verdicts"][0]["cells"][0].update(wall_s=0.0, walls_s=[0.0, 0.0],
                                                                          wall_min_s=0.0, wall_max_s=0.0)),
        # a stop's evidence read by its own declaration: a string is not a list of lines, "3" is not a count
        "says-a-string": edited(lambda d: stop_of(d).update(server_says="CUDA out of memory")),
        "count-as-text": edited(lambda d: stop_of(d).update(references="3")),
    }
    assert cell["served"] is True
    for name, data in shapes.items():
        bad = tmp_path / name
        bad.mkdir()
        (bad / "verdict.json").write_bytes(data)
        proc = _compare(str(good), str(bad))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (name, proc.stderr[-2000:])
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith(f"runner: error: {bad / 'verdict.json'}: "), (name, line)


def test_compare_out_and_schema_out_are_one_line_and_never_write_through_a_link(tmp_path: Path) -> None:
    good = _good(tmp_path)
    for out in (tmp_path / "no-such" / "c.md", tmp_path, Path("/proc/version")):
        proc = _compare(str(good), str(good), "--out", str(out))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (out, proc.stderr[-2000:])
        assert len(proc.stderr.strip().splitlines()) == 1 and str(out) in proc.stderr, proc.stderr
    (tmp_path / "file").write_text("x")
    for folder in (tmp_path / "file", Path("/proc/sys")):
        proc = subprocess.run([sys.executable, "-m", "runner", "schema", "--out", str(folder)], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (folder, proc.stderr[-2000:])
    # C-4: a symlink planted in the folder is replaced by the schema, its target untouched
    target, folder = tmp_path / "precious.txt", tmp_path / "schemas"
    target.write_text("keep me")
    folder.mkdir()
    (folder / "verdict.schema.json").symlink_to(target)
    proc = subprocess.run([sys.executable, "-m", "runner", "schema", "--out", str(folder)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert target.read_text() == "keep me" and not (folder / "verdict.schema.json").is_symlink()
