"""Issue 18 items 7 and 8 and the Must-show kill trials, on real process groups: SIGTERM, SIGHUP and SIGINT
end a run like Ctrl-C (servers stopped, records kept, a partial report, the resume command, exit 128+N); the
first signal says at once what it does and does not wait for the request in flight; a second one stops now;
a SIGKILL while the report is written loses nothing. Each trial is followed by `--resume`: 0 lost, 0
duplicated, 0 corrupt records, nothing of the run left running."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from processkit import (
    SIGNALS,
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
PLANNED = 6  # seeds [1, 2, 3] × references [0, 1]


def resume_and_check(path: Path, run: Path, kept: dict[Path, bytes], planned: int = PLANNED) -> None:
    resumed = Runner(path, "--resume", str(run))
    assert resumed.wait(240) == 0, resumed.output[-3000:]
    docs = check_records(run, planned)
    assert all(d["status"] == "ok" for d in docs), [d["key"] for d in docs if d["status"] != "ok"]
    for p, data in kept.items():  # what the first run finished was not sent again
        assert p.read_bytes() == data, p
    assert (run / "report.md").is_file() and (run / "verdict.json").is_file()


def finished_steps(run: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in step_files(run) if json.loads(p.read_text())["status"] == "ok"}


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_signal_ends_the_run_like_ctrl_c_and_resume_finishes(tmp_path: Path, name: str) -> None:
    # Each request takes 1.5-2.5 s, so the signal lands while one is in flight.
    path = matrix(tmp_path, server_args=', "--fault", "jitter=1.5:2.5"')
    runner = Runner(path)
    assert wait_for(lambda: run_shows(tmp_path, lambda run: records_done(run) >= 2), 180), \
        runner.output[-3000:]
    t0 = time.monotonic()
    runner.signal(SIGNALS[name])
    code = runner.wait(60)
    took = time.monotonic() - t0
    out = runner.output
    assert code == 128 + SIGNALS[name], out[-3000:]
    assert f"runner: {name}: stopping" in out and "Traceback" not in out
    run = run_dir(tmp_path)
    assert f"--resume {run}" in out and "kept " in out
    assert took < 30, f"{name} took {took:.1f} s to end the run"
    doc = json.loads((run / "run.json").read_text())
    assert doc["interrupted"] is True
    assert "interrupted" in (run / "report.md").read_text()
    nothing_left(tmp_path)
    kept = finished_steps(run)
    assert 2 <= len(kept) < PLANNED
    resume_and_check(path, run, kept)
    nothing_left(tmp_path)


def test_first_ctrl_c_does_not_wait_for_the_request_in_flight_and_the_second_stops_now(tmp_path: Path) -> None:
    # Four steps; the third request hangs (and, counted per server, the resume's two do not). With
    # request_timeout_s = 300 the old runner waited for it before printing anything.
    for twice, folder in ((False, tmp_path / "once"), (True, tmp_path / "twice")):
        path = matrix(folder, seeds="[1, 2]", server_args=', "--fault", "hang@3"', request_timeout=300)
        runner = Runner(path)
        assert wait_for(lambda f=folder: run_shows(f, lambda found: records_done(found) >= 2), 180), \
            runner.output[-3000:]
        time.sleep(1.0)  # the third request is in flight now, and hangs
        t0 = time.monotonic()
        runner.signal(signal.SIGINT)
        assert wait_for(lambda r=runner: "runner: SIGINT: stopping" in r.output, 3), runner.output[-2000:]
        if twice:
            time.sleep(0.2)
            runner.signal(signal.SIGINT)
        assert runner.wait(60) == 130, runner.output[-3000:]
        # the first: the servers' stop (10 s grace at most) and the report; the second: at once
        assert time.monotonic() - t0 < (10 if twice else 30)
        run = run_dir(folder)
        if twice:
            assert "SIGINT again: stopping now" in runner.output
        else:
            docs = [json.loads(p.read_text()) for p in step_files(run)]
            # the request in flight is no measurement: recorded as interrupted, so the resume sends it again
            assert not any(d["status"] == "failed" for d in docs), docs
            assert sum(d.get("skip_reason") == "run interrupted" for d in docs) == 2
        nothing_left(folder)
        resume_and_check(path, run, finished_steps(run), planned=4)
        nothing_left(folder)


def test_sigkill_while_the_report_is_written_then_resume(tmp_path: Path) -> None:
    path = matrix(tmp_path)
    runner = Runner(path)
    # verdict.json is written right before report.md and the plots: kill the runner between them.
    assert wait_for(lambda: run_shows(tmp_path, lambda run: (run / "verdict.json").exists()),
                    240, poll=0.002), runner.output[-3000:]
    runner.signal(signal.SIGKILL)
    assert runner.wait(30) == -signal.SIGKILL
    run = run_dir(tmp_path)
    report = run / "report.md"
    if report.exists():  # whole or absent, never half written
        assert report.read_text().rstrip().endswith("docs/meters.md has each source's rate, what it catches "
                                                     "and what it misses.")
    nothing_left(tmp_path)
    kept = finished_steps(run)
    assert len(kept) == PLANNED
    resume_and_check(path, run, kept)
