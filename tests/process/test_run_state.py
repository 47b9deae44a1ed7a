"""Issue 18 items 4, 6 and 13 on real runs of the reference server: one runner per run folder (a second
`--resume` is refused naming the holder), a resume refused when an input the records depend on changed (but
not for a comment-only edit), and one bad file never makes a run unresumable or unreportable."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from processkit import (
    REFS,
    Runner,
    check_records,
    matrix,
    nothing_left,
    records_done,
    run_dir,
    run_shows,
    step_files,
    wait_for,
)

pytestmark = pytest.mark.slow


def runner(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    quiet = () if args[0] == "report" else ("--no-progress",)
    return subprocess.run([sys.executable, "-m", "runner", *args, *quiet], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


def test_a_second_resume_of_a_running_run_is_refused_naming_the_holder(tmp_path: Path) -> None:
    path = matrix(tmp_path, server_args=', "--fault", "jitter=1.0:1.5"')
    first = Runner(path)
    assert wait_for(lambda: run_shows(tmp_path, lambda run: records_done(run) >= 1), 180), \
        first.output[-3000:]
    run = run_dir(tmp_path)
    second = runner(str(path), "--resume", str(run), cwd=tmp_path, timeout=60)
    assert second.returncode == 2, second.stderr
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and f"runner PID {first.proc.pid}" in lines[0] and "in use" in lines[0], lines
    assert first.wait(240) == 0, first.output[-3000:]
    # the refused resume sent nothing: one record per step, one server start, no resume in run.json
    check_records(run, 6)
    session = json.loads((run / "roomy/default/session.json").read_text())
    assert len(session["starts"]) == 1
    assert json.loads((run / "run.json").read_text())["resumes"] == []
    # the lock goes with its holder: a resume now goes ahead
    assert runner(str(path), "--resume", str(run), cwd=tmp_path).returncode == 0


def test_a_killed_holder_does_not_block_the_resume(tmp_path: Path) -> None:
    path = matrix(tmp_path, seeds="[1]", server_args=', "--fault", "jitter=1.0:1.5"')
    first = Runner(path)
    assert wait_for(lambda: run_shows(tmp_path, lambda run: records_done(run) >= 1), 180)
    first.signal(signal.SIGKILL)
    first.wait(30)
    nothing_left(tmp_path)
    resumed = runner(str(path), "--resume", str(run_dir(tmp_path)), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]


def test_resume_refuses_changed_inputs_and_says_what_changed(tmp_path: Path) -> None:
    refs = [tmp_path / "refs" / f"r{i}.png" for i in (1, 2)]
    for src, dst in zip(REFS, refs, strict=True):
        dst.parent.mkdir(exist_ok=True)
        shutil.copy(src, dst)
    path = matrix(tmp_path, seeds="[1]")
    path.write_text(path.read_text().replace(json.dumps(REFS), json.dumps(["refs/r1.png", "refs/r2.png"]))
                    .replace('[flags.default]\nrole = "default"', '[flags.default]\nrole = "default"\n'
                             'env = { TOKEN_FOR_TEST = "${RUNNER_T18_TOKEN}" }'))
    env = {**os.environ, "RUNNER_T18_TOKEN": "first-value"}
    proc = subprocess.run([sys.executable, "-m", "runner", str(path), "--no-progress"], capture_output=True,
                          text=True, timeout=240, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = run_dir(tmp_path)
    before = {p: p.read_bytes() for p in step_files(run)}
    assert "first-value" not in (run / "run.json").read_text()

    def resume(**extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "runner", str(path), "--no-progress", "--resume", str(run)],
                              capture_output=True, text=True, timeout=240, cwd=tmp_path, env={**env, **extra})

    # a comment-only edit of the matrix is not a change
    path.write_text("# a comment added after the run\n" + path.read_text() + "\n# and another\n")
    assert resume().returncode == 0
    # an env value the server resolves
    changed = resume(RUNNER_T18_TOKEN="second-value")
    assert changed.returncode == 2 and "env ${RUNNER_T18_TOKEN} changed" in changed.stderr, changed.stderr
    assert "second-value" not in changed.stderr and len(changed.stderr.strip().splitlines()) == 1
    # a reference image changed in place
    refs[0].write_bytes(Path(REFS[1]).read_bytes())
    changed = resume()
    assert changed.returncode == 2 and "fixtures.shapes.references[0] (r1.png) changed" in changed.stderr
    refs[0].write_bytes(Path(REFS[0]).read_bytes())
    # the server command (a flag added to the profile)
    text = path.read_text()
    path.write_text(text.replace('"--preset", "tiny"', '"--preset", "tiny", "--dtype", "float32"'))
    changed = resume()
    assert changed.returncode == 2 and "server command of roomy/default changed" in changed.stderr
    assert "matrix (as parsed) changed" in changed.stderr
    path.write_text(text)
    # the same matrix copied to another folder next to other references
    other = tmp_path / "copy"
    (other / "refs").mkdir(parents=True)
    shutil.copy(REFS[1], other / "refs" / "r1.png")
    shutil.copy(REFS[0], other / "refs" / "r2.png")
    shutil.copy(path, other / "matrix.toml")
    moved = subprocess.run([sys.executable, "-m", "runner", str(other / "matrix.toml"), "--no-progress",
                            "--resume", str(run)], capture_output=True, text=True, timeout=240, cwd=other, env=env)
    assert moved.returncode == 2 and "references[0] (r1.png) changed" in moved.stderr, moved.stderr
    # nothing was sent by the refused resumes
    assert {p: p.read_bytes() for p in step_files(run)} == before
    assert resume().returncode == 0  # the inputs restored: the resume goes ahead


def test_one_bad_file_never_makes_a_run_unresumable_or_unreportable(tmp_path: Path) -> None:
    path = matrix(tmp_path, seeds="[1, 2]")
    proc = runner(str(path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = run_dir(tmp_path)
    files = step_files(run)
    assert len(files) == 4
    files[0].write_bytes(b"")  # 0 bytes
    files[1].write_bytes(files[1].read_bytes()[:40])  # truncated
    (run / "roomy/default/refs-1/notes.json").write_text('{"my": "notes"}')  # a stray file
    shutil.copy(files[2], files[2].with_name(files[2].stem + " (copy).json"))  # a copy: same key, other path
    session = run / "roomy/default/session.json"
    session.write_bytes(b"")

    report = runner("report", str(run), cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    for bad in (files[0], files[1], run / "roomy/default/refs-1/notes.json", session):
        assert f"skipping {bad}" in report.stderr, report.stderr
    assert "(copy).json: its key" in report.stderr and "Traceback" not in report.stderr
    assert "Steps: 2 — 2 ok" in (run / "report.md").read_text()  # the two readable records, the copy not

    resumed = runner(str(path), "--resume", str(run), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "2 step(s) to send of 4" in resumed.stderr  # exactly the two unreadable ones, the copy not counted
    for f in (files[0], files[1]):
        assert json.loads(f.read_text())["status"] == "ok"
    verdict = json.loads((run / "verdict.json").read_text())["verdicts"][0]
    assert verdict["world"] == "fits-resident"
    assert all(c["ok"] <= 2 for c in verdict["cells"])  # the copy is never a third step of a 2-seed cell
    nothing_left(tmp_path)

    # a malformed run.json: one line naming it, no traceback
    (run / "run.json").write_text('{"run_id": ')
    for args in (("report", str(run)), (str(path), "--resume", str(run))):
        bad = runner(*args, cwd=tmp_path)
        assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [bad.stderr.strip()], bad.stderr
        assert f"{run / 'run.json'}: not valid JSON" in bad.stderr


def test_resume_refuses_replaced_baseline_images_and_says_which(tmp_path: Path) -> None:
    from PIL import Image

    sealed = tmp_path / "sealed"
    sealed.mkdir()
    for seed, shade in ((1, 90), (2, 160)):
        Image.new("RGB", (64, 64), (shade, shade, shade)).save(sealed / f"shapes-1r-{seed}.png")
    (sealed / "samples.json").write_text(json.dumps({"samples": [
        {"fixture": "shapes", "references": 1, "seed": s, "file": f"shapes-1r-{s}.png"} for s in (1, 2)]}))
    path = matrix(tmp_path, seeds="[1, 2]", references="[1]")
    path.write_text(path.read_text().replace("[matrix]", '[baseline]\ndir = "sealed"\n\n[matrix]'))
    first = runner(str(path), cwd=tmp_path)
    assert first.returncode in (0, 1) and "Traceback" not in first.stderr, first.stderr[-2000:]
    run = run_dir(tmp_path)
    before = {p: p.read_bytes() for p in step_files(run)}
    assert len(before) == 2

    original = (sealed / "shapes-1r-2.png").read_bytes()
    Image.new("RGB", (64, 64), (10, 200, 30)).save(sealed / "shapes-1r-2.png")  # replaced, same name
    changed = runner(str(path), "--resume", str(run), cwd=tmp_path)
    assert changed.returncode == 2 and "baseline shapes-1r-2.png changed" in changed.stderr, changed.stderr
    assert len(changed.stderr.strip().splitlines()) == 1 and "Traceback" not in changed.stderr
    assert {p: p.read_bytes() for p in step_files(run)} == before  # nothing sent, nothing rescored

    (sealed / "shapes-1r-2.png").write_bytes(original)
    again = runner(str(path), "--resume", str(run), cwd=tmp_path)
    assert again.returncode == first.returncode, again.stderr[-2000:]  # the same world: it goes ahead
    nothing_left(tmp_path)
