"""The diagnosis pass against a vLLM-Omni-shaped server whose profiler is hostile (tests/safety/hostile_profiler.py;
issue 46 P-4, P-5, P-7…P-10): every failure of a pass is its record (outcome and why), never a lane's end; an
interrupted pass ends at once and is not recorded; and two real runs of `runner` over hostile snapshots end in
a verdict and a report with nothing a server wrote unmasked or live."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from runner.core.records import Failure, FailureClass, OomReport, Status, StepRecord
from runner.plan.lanes import make_plan
from runner.plan.matrix import load_matrix
from runner.run import execute
from runner.run.diagnose import Target, readings, run_target
from runner.run.store import RunStore
from tests.safety.hostile_matrix import hostile_matrix

PROFILER = Path(__file__).with_name("hostile_profiler.py")
TOKEN = "hf_RealSecretValue1234567890"
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def session_runner(tmp: Path, mode: str) -> tuple[execute.SessionRunner, Target]:
    matrix = load_matrix(hostile_matrix(tmp, "prof", {"c": mode}, script=PROFILER))
    plan = make_plan(matrix)
    store = RunStore(tmp / "run")
    session = plan.sessions[0]
    runner = execute.SessionRunner(execute.RunContext(matrix, plan, store, "u"), session, execute.References(),
                                   execute.Baselines(matrix, store))
    step = session.steps[0]
    return runner, Target("oom", step.key, step)


def test_p5_a_dangling_link_for_a_snapshot_is_the_records_why_not_the_lanes_end(tmp_path: Path) -> None:
    """Before: FileNotFoundError out of the pass (the lane's traceback, no verdict), and a resume's report had
    neither a held reading nor a reason."""
    runner, target = session_runner(tmp_path, "dangling")
    done = run_target(runner, target)
    assert done.outcome == "oom" and done.snapshot is None, done
    assert done.why_none is not None and "memory_snapshot_rank0.pickle is a symbolic link" in done.why_none, done
    runner.ctx.store.write_diagnosis(done)
    (r,) = readings(runner.ctx.store)[("c", "default")]
    assert r.held is None and r.why == done.why_none


def test_a_trace_instead_of_a_snapshot_is_read_as_one_is(tmp_path: Path) -> None:
    """Where the server wrote a profiler trace and no snapshot (vLLM-Omni on a CPU): its [memory] events' peak,
    the file opened and read as a snapshot is (not through a link, in the bounded child)."""
    runner, target = session_runner(tmp_path, "trace")
    done = run_target(runner, target)
    assert done.snapshot is None and done.trace is not None and done.trace.endswith("/trace_rank0.json.gz"), done
    assert (done.trace_peak_bytes, done.trace_device) == (5 * 2**20, "CPU"), done
    assert done.why_none is not None and done.why_none.endswith("peak at 5.00 MiB allocated"), done.why_none


def test_a_load_oom_of_a_server_whose_log_shows_vllm_starts_no_pass(tmp_path: Path) -> None:
    """vLLM's profiler starts only through its endpoints and its port never opens at a load OOM: the pass would load
    the model again to write nothing (a 38 s restart of the real vLLM-Omni on the CPU stand, minutes on a GPU). Its
    banner in the session's log says so; a server whose log does not (the reference server records its load) is
    started."""
    runner, _ = session_runner(tmp_path, "trace")
    at_load = Target("oom", runner.session.key, None)
    log = runner.ctx.store.session_dir(runner.session.key) / "server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("INFO 12-06 03:25:18 [api_utils.py:347] vLLM server version 0.30.0, serving model m\n"
                   "torch.OutOfMemoryError: CUDA out of memory.\n")
    done = run_target(runner, at_load)
    assert done.outcome == "not run" and done.start_s is None, done
    assert done.why_none is not None and 'its log says "vLLM server version 0.30.0"' in done.why_none, done
    assert not (log.parent / "diagnosis" / "oom" / "server.log").exists()  # nothing was started
    log.write_text("torch.OutOfMemoryError: CUDA out of memory.\n")  # no banner: the pass starts the server
    done = run_target(runner, at_load)
    assert done.outcome == "loaded" and done.start_s is not None, done


@pytest.mark.parametrize(("mode", "why"), [("start-500", "POST /start_profile answered 500"),
                                           ("start-huge", "POST /start_profile: TooLarge")])
def test_p9_a_failed_start_profile_is_profiler_failed_not_served(tmp_path: Path, mode: str, why: str) -> None:
    """Before: "served", though nothing was sent under the profiler ("served" reads as "the OOM did not repeat")."""
    runner, target = session_runner(tmp_path, mode)
    done = run_target(runner, target)
    assert done.outcome == "profiler failed" and done.snapshot is None, done
    assert done.why_none == f"no allocator snapshot: {why}", done


def test_p10_a_hanging_start_profile_ends_at_the_interrupt_and_the_pass_is_not_recorded(tmp_path: Path) -> None:
    """The run is stopped (Ctrl-C sets the stop event) while /start_profile hangs. Before: the pass waited up to
    120 s for the answer, then recorded itself as done (outcome "served"): a resume never ran it again."""
    runner, target = session_runner(tmp_path, "start-hang")
    ctx = runner.ctx
    assert target.step is not None
    ctx.record(StepRecord(key=target.of, card="c", flags="default", role="default", fixture=target.step.fixture,
                          references=1, seed=target.step.seed, status=Status.FAILED,
                          failure=Failure(kind=FailureClass.OOM, message="out of memory", evidence=(),
                                          oom=OomReport(message="CUDA out of memory. Tried to allocate 2.00 MiB.",
                                                        source="body", tried_bytes=2 * 2**20))))
    lane = ctx.plan.lanes[0].name
    passes = threading.Thread(target=execute._diagnosis_passes,
                              args=(ctx, lane, runner.refs, runner.baselines), daemon=True)
    passes.start()
    log = ctx.store.session_dir("c/default") / "diagnosis" / "oom" / "server.log"
    deadline = time.monotonic() + 60
    while not (log.is_file() and "start_profile received" in log.read_text(errors="replace")):
        assert passes.is_alive() and time.monotonic() < deadline, "the pass never asked /start_profile"
        time.sleep(0.05)
    ctx.stop.set()  # during the hanging /start_profile
    passes.join(10)
    assert not passes.is_alive(), "the pass still waits on /start_profile 10 s after the interrupt"
    assert not ctx.store.diagnosis_path("c/default", "oom").exists()  # a resume runs it again
    assert not ctx.live  # its server stopped


# --- two real runs -------------------------------------------------------------------------------------------

def run_runner(tmp: Path, name: str, cards: dict[str, str]) -> tuple[Path, subprocess.CompletedProcess[str]]:
    matrix = hostile_matrix(tmp, name, cards, script=PROFILER, token_env=True)
    proc = subprocess.run([sys.executable, "-m", "runner", str(matrix), "--no-progress"], cwd=tmp,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_TOKEN": TOKEN})
    return next((tmp / "results").glob(f"{name}-*")), proc


def diagnosis(run: Path, card: str) -> dict[str, Any]:
    return dict(json.loads((run / card / "default" / "diagnosis.json").read_text()))


def strings(doc: object) -> list[str]:
    """Every string in a JSON document."""
    if isinstance(doc, str):
        return [doc]
    if isinstance(doc, dict):
        return [s for k, v in doc.items() for s in (*strings(k), *strings(v))]
    if isinstance(doc, list):
        return [s for v in doc for s in strings(v)]
    return []


def verdicts(run: Path) -> dict[str, dict[str, Any]]:
    return {v["card"]: v for v in json.loads((run / "verdict.json").read_text())["verdicts"]}


@pytest.fixture(scope="module")
def masked_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    return run_runner(tmp_path_factory.mktemp("masked"), "hostile-masked",
                      {"secret": "secret", "escapes": "escapes", "start-500": "start-500"})


def test_p7_a_secret_in_a_snapshot_reaches_no_file_of_the_run(masked_run: tuple[Path, Any]) -> None:
    """The secret the runner resolved into the server's env (HF_TOKEN = "${HF_TOKEN}"), written into the
    snapshot's paths, function names and user_metadata: in no file of the run but the server's own pickle
    (before: 4 copies in verdict.json, 1 in report.md)."""
    run, proc = masked_run
    assert (run / "report.md").is_file() and (run / "plots" / "secret-held.png").is_file(), proc.stderr[-3000:]
    kept = [p for p in run.rglob("*") if p.is_file() and not p.name.endswith(".pickle")]
    shapes = (TOKEN.encode(), TOKEN.replace("_", "\\_").encode())  # as it is, and as report.md escapes it
    leaks = [p.relative_to(run).as_posix() for p in kept if any(s in p.read_bytes() for s in shapes)]
    assert not leaks, leaks
    assert "/home/***/app/engine.py:88" in (run / "verdict.json").read_text()
    assert TOKEN not in proc.stdout + proc.stderr


def test_p8_control_characters_and_markup_are_inert_in_verdict_json_and_on_the_console(
        masked_run: tuple[Path, Any]) -> None:
    """Before: stored raw in verdict.json, and matplotlib printed "Glyph 27 missing" drawing the held plot."""
    run, proc = masked_run
    assert "Traceback" not in proc.stderr and "Glyph" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    escaped = verdicts(run)["escapes"]
    live = [s for s in strings(escaped) if CONTROL.search(s)]
    assert not live, live[:3]
    text = json.dumps(escaped)
    assert "\\\\x1b[2J" in text and "[[...]]" not in text, text[:2000]  # the escape as visible text
    assert (run / "plots" / "escapes-held.png").is_file()


def test_p9_a_run_says_profiler_failed_for_a_failed_start_profile(masked_run: tuple[Path, Any]) -> None:
    run, proc = masked_run
    start = diagnosis(run, "start-500")
    assert start["outcome"] == "profiler failed" and start["why_none"] == \
        "no allocator snapshot: POST /start_profile answered 500", start
    assert "start-500/default: diagnosis pass (oom, 1 ref)" in proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def files_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    return run_runner(tmp_path_factory.mktemp("files"), "hostile-files",
                      {m: m for m in ("dangling", "passwd", "deep", "huge-400", "huge-5000")})


def test_p2_p3_p4_p5_a_run_over_hostile_snapshot_files_ends_in_a_verdict_and_a_report(
        files_run: tuple[Path, Any]) -> None:
    """Before: the dangling link ended its lane (and the run) with a traceback; the deep nesting and the huge
    figures ended `runner report` the same way every time; /etc/passwd was read."""
    run, proc = files_run
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "report.md").is_file()
    found = verdicts(run)
    assert set(found) == {"dangling", "passwd", "deep", "huge-400", "huge-5000"}
    for card in ("dangling", "passwd"):
        d = diagnosis(run, card)
        assert d["snapshot"] is None and "is a symbolic link, not a regular file" in d["why_none"], d
    for card in ("huge-400", "huge-5000"):
        assert "beyond any memory (1 PiB or more)" in json.dumps(found[card]), card
    assert "/srv/app/engine.py:88" in json.dumps(found["deep"])
    report = (run / "report.md").read_text()
    assert "root:" not in report and "root:" not in (run / "verdict.json").read_text()
