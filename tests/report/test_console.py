"""What the console prints, read as a person at a terminal would: bars that keep the bar, the count and the
time in 80 columns; a bar that does not say done for steps left after Ctrl-C; a start failure with its
reason on its line; each verdict figure with the reference count it was measured at; the resume command as
the program was invoked."""

from __future__ import annotations

import io
import os
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from runner.cli import invoked_as
from runner.core.records import DiagnosisRecord, FailureClass, Status
from runner.judge.decision import Evidence, Latency, Verdict, World
from runner.plan.lanes import Step
from runner.present.progress import ProgressView, column_widths, verdict_line
from runner.run import policy

from .test_plots import step


def rendered(view: ProgressView, width: int) -> list[str]:
    out = Console(width=width, color_system=None, record=True, file=io.StringIO())
    out.print(view.progress.get_renderable())
    return [ln for ln in out.export_text().splitlines() if ln.strip()]


def two_lanes(width: int) -> ProgressView:
    view = ProgressView(Console(width=width, color_system=None, file=io.StringIO()))
    view.lane_started("cpu-roomy", ("cpu-roomy",), 40)
    view.lane_started("gpu0", ("rtx3090", "rtx5080"), 96)
    view.session_started("cpu-roomy", "cond-host", 0)
    view.session_started("rtx3090", "cpu-offload-expandable", 1)
    view.memory("rtx3090", int(23.5 * 2**30))
    view.progress.advance(view.tasks["gpu0"], 48)
    return view


@pytest.mark.parametrize("width", [80, 100])
def test_bars_stay_readable_in_a_narrow_terminal(width: int) -> None:
    lines = rendered(two_lanes(width), width)
    assert len(lines) == 2
    for line in lines:
        assert len(line) <= width, line
        assert "0:00:00" in line  # elapsed time kept
    gpu = next(ln for ln in lines if ln.startswith("gpu0"))
    assert "48/96" in gpu and gpu.count("━") >= 5  # half of a bar of at least 12 cells (was "━ …" in 80)
    assert "rtx3090/cpu-off" in gpu and "mem 23.50 GiB" in gpu


def test_column_widths_shrink_in_order_and_keep_minimums() -> None:
    assert column_widths(200, 9, 5) == (42, 22, 40)  # wide: rich's widths
    session, memory, bar = column_widths(80, 9, 5)
    assert bar == 12 and memory == 15 and 16 <= session < 42
    assert 9 + 5 + 7 + 5 + session + memory + bar < 80
    assert column_widths(40, 9, 5) == (16, 15, 8)  # never below what still reads


def test_bars_do_not_say_done_for_steps_left_after_ctrl_c() -> None:
    view = ProgressView(Console(file=io.StringIO(), width=120), enabled=False)
    view.lane_started("cpu", ("c",), 4)
    view.step_done(step("c", "default", 1))
    for n in (2, 3, 4):
        left = step("c", "default", n, Status.SKIPPED).model_copy(update={"skip_reason": "run interrupted"})
        view.step_done(left)
    view.lane_done("cpu")
    task = view.progress.tasks[0]
    assert task.completed == 1 and task.fields["session"] == "stopped: 3 left to do"
    # a step decided without sending (implied by an OOM) counts as done
    view.lane_started("cpu2", ("d",), 1)
    implied = step("d", "default", 2, Status.SKIPPED).model_copy(update={"implied_by": "d/default/refs-1/f-seed-1"})
    view.step_done(implied)
    view.lane_done("cpu2")
    assert view.progress.tasks[1].fields["session"] == "done"
    # and so does one whose session's server ran out of memory at load (resume would not send it either);
    # another start failure leaves its steps to do
    view.lane_started("cpu3", ("e",), 2)
    for n, why in ((1, FailureClass.OOM_AT_LOAD), (2, FailureClass.LOAD_EXIT)):
        view.step_done(step("e", "default", n, Status.SKIPPED).model_copy(
            update={"skip_reason": policy.start_failed(why)}))
    view.lane_done("cpu3")
    assert view.progress.tasks[2].fields["session"] == "stopped: 1 left to do"


def test_a_step_an_oom_implies_is_one_short_line_naming_the_deciding_step() -> None:
    buf = io.StringIO()
    view = ProgressView(Console(file=buf, width=100, color_system=None), enabled=False)
    view.lane_started("cpu", ("cpu-tight",), 2)
    implied = step("cpu-tight", "cpu-offload", 4, Status.SKIPPED, seed=2302).model_copy(update={
        "implied_by": "cpu-tight/cpu-offload/refs-3/f-seed-2301",
        "skip_reason": "implied by an out-of-memory at 3 reference(s) in this session "
                       "(cpu-tight/cpu-offload/refs-3/f-seed-2301)"})
    view.step_done(implied)
    assert buf.getvalue().splitlines() == [
        "cpu-tight/cpu-offload/refs-4/f-seed-2302: skipped, implied by the OOM at refs-3/f-seed-2301"]


def test_the_bar_names_the_request_in_flight() -> None:
    view = two_lanes(120)
    view.session_ready("cpu-roomy", "cpu-offload-expandable", 48.0)
    view.sending(Step("cpu-roomy", "cpu-offload-expandable", "suite2", 3, 2302), 2)
    lane = next(ln for ln in rendered(view, 120) if ln.startswith("cpu-roomy"))
    assert "cpu-offload-expandable 3 refs seed 2302 ×2" in lane, lane  # not "ready in 48.00 s" any more


def test_a_diagnosis_pass_is_one_line_with_its_snapshot_or_why_none() -> None:
    buf = io.StringIO()
    view = ProgressView(Console(file=buf, width=100, color_system=None, soft_wrap=True), enabled=False)
    view.lane_started("cpu", ("cpu-tiny",), 2)
    oom = DiagnosisRecord(key="cpu-tiny/int8", card="cpu-tiny", flags="int8", at="oom", of="cpu-tiny/int8/refs-3/f",
                          references=3, started_at=0.0, total_s=3.5, outcome="oom",
                          snapshot="cpu-tiny/int8/diagnosis/oom/snap.pickle")
    view.diagnosis_done(oom)
    view.diagnosis_done(oom.model_copy(update={"references": None, "outcome": "oom at load", "snapshot": None,
                                               "why_none": "the server wrote no snapshot"}))
    view.diagnosis_done(oom.model_copy(update={"references": None, "outcome": "not run", "snapshot": None,
                                               "total_s": 0.0, "why_none": "its log says vLLM"}))
    assert buf.getvalue().splitlines() == [
        "cpu-tiny/int8: diagnosis pass (oom, 3 refs) in 3.50 s: oom; allocator snapshot "
        "cpu-tiny/int8/diagnosis/oom/snap.pickle",
        "cpu-tiny/int8: diagnosis pass (oom, load) in 3.50 s: oom at load; the server wrote no snapshot",
        "cpu-tiny/int8: diagnosis pass (oom, load): not run; its log says vLLM"]  # no time: nothing was started


def test_a_start_failure_gives_its_reason_on_its_line() -> None:
    buf = io.StringIO()
    view = ProgressView(Console(file=buf, width=200, color_system=None), enabled=False)
    view.lane_started("cpu", ("cpu-tiny",), 4)
    view.session_started("cpu-tiny", "default", 0)
    view.session_ready("cpu-tiny", "default", None,
                       "oom_at_load: server exited with 1 while loading: [bold]CUDA out of memory. Tried to allocate")
    line = next(ln for ln in buf.getvalue().splitlines() if "did not start" in ln)
    assert line.startswith("cpu-tiny/default: server did not start (oom_at_load: server exited with 1")
    assert "[bold]CUDA out of memory" in line  # server text is printed as it is, never read as markup


def test_verdict_line_says_the_reference_count_of_each_figure() -> None:
    # the console line is the report table's summary (runner.judge.verdict_text): each figure with its count
    ev = Evidence(peak_bytes=int(7.36 * 2**20), peak_source="server-response", wall_s=0.84, psnr_db=100.0,
                  latency_ratio=1.34)
    lat = Latency(1.34, 1.2, 1.5, "default 'default' at 2 reference(s), both sides at 2", 0.47, (4, 4), 2)
    v = Verdict("cpu-tight", World.OFFLOAD_WORKS, 4, "cond-host", "", evidence=ev, cells=(), notes=(), latency=lat)
    line = verdict_line(v)
    assert line == ("cpu-tight: offload-works (cond-host) — cond-host serves 4 refs at peak 7.36 MiB, "
                    "0.84 s/request at 4, 1.34× the default's latency at 2 refs (medians)")
    base = replace(lat, reference="the baseline's recorded wall time (0.5 s) at 4 reference(s)", references=4)
    assert verdict_line(replace(v, latency=base)).endswith("1.34× the baseline's recorded latency at 4 refs (medians)")


def test_the_resume_command_is_the_program_as_invoked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    script = venv / "runner"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert invoked_as(".venv/bin/runner", "/usr/bin/python3") == [".venv/bin/runner"]  # README's setup
    assert invoked_as(str(script), "/usr/bin/python3") == [".venv/bin/runner"]  # as ./relative
    monkeypatch.setenv("PATH", f"{venv}{os.pathsep}/usr/bin")
    assert invoked_as(str(script), "/usr/bin/python3") == ["runner"]  # found on PATH: the short name
    main = str(Path(__file__).resolve().parents[2] / "runner" / "__main__.py")
    assert invoked_as(main, str(venv / "python")) == [".venv/bin/python", "-m", "runner"]


def test_a_start_failure_line_carries_the_servers_own_error() -> None:
    from runner.core.records import Failure, FailureClass
    from runner.run.execute import start_failure_line

    oom = Failure(kind=FailureClass.OOM_AT_LOAD, message="out of memory at load",
                  evidence=("2026-12-01 09:43:02,123 ERROR refserver: model load failed: CUDA out of memory. Tried to "
                   "allocate 1.06 MiB. GPU 0 has a total capacity of 5.00 MiB",))
    assert start_failure_line(oom) == ("oom_at_load: out of memory at load — model load failed: CUDA out of memory. "
                                       "Tried to allocate 1.06 MiB. GPU 0 has a total capacity of 5.00 MiB")
    gone = Failure(kind=FailureClass.LOAD_EXIT,
                   message="server exited with code 1 before it was ready: ModuleNotFoundError: "
                   "No module named 'x'", evidence=("Traceback (most recent call last):",
                                                    "ModuleNotFoundError: No module "
                                            "named 'x'"))
    assert start_failure_line(gone).count("ModuleNotFoundError") == 1  # already in the message: not twice
