"""Issue 18, untrusted input: one test per item against real processes on 127.0.0.1 (tests/safety/hostile.py)
and the runner's own code paths (the executor's send, the backend's readiness, the report of a run folder).
Item 1 (bad meter readings) is tests/meters/test_bad_readings.py; the whole corpus in one run is
test_hostile_server.py."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from runner.backends.base import Attempt, ExitInfo, RunningServer, StartFailed
from runner.backends.local import LocalServer
from runner.core.records import SCHEMA_VERSION, FailureClass, Status, StepRecord
from runner.judge.verdict import decide_all
from runner.judge.verdict_text import summary
from runner.plan.lanes import ServerPlan, make_plan
from runner.plan.matrix import ServerProfile, load_matrix
from runner.present.progress import ProgressView
from runner.run.execute import Baselines, References, RunContext, Served, SessionRunner
from runner.run.store import RunStore
from tests.ports import free_port

HOSTILE = Path(__file__).with_name("hostile.py")
ROOT = Path(__file__).resolve().parents[2]
REF = ROOT / "examples" / "refs" / "ref-1.png"
SECRET = "hf_Zq8TOKEN0123456789abcdefSECRET"
ESC = "\x1b"


def within(seconds: float, call: Callable[[], object]) -> object:
    """call() on a thread; fails the test instead of hanging it when it takes longer than `seconds`."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")


@pytest.fixture(autouse=True)
def _state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNNER_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("HF_TOKEN", SECRET)


def hostile(tmp: Path, mode: str, port: int | None = None) -> LocalServer:
    port = port or free_port()
    argv = (sys.executable, str(HOSTILE), "--port", str(port), "--mode", mode)
    plan = ServerPlan(backend="local", profile=ServerProfile(name=mode, command=argv, port=port), argv=argv,
                      env={"HF_TOKEN": "${HF_TOKEN}"})
    return LocalServer(plan, Attempt(name=f"hostile-{mode}", log_path=tmp / f"{mode}.log"))


MATRIX = """
[run]
name = "u"
seeds = [1]
repeats = 1
determinism_check = false
restarts = 0
steps = 2
size = "64x64"
request_timeout_s = 3
ready_timeout_s = 20
results_dir = "{results}"

[servers.h]
command = ["{{python}}", "{hostile}", "--port", "{{port}}", "--mode", "ok"]
env = {{ HF_TOKEN = "${{HF_TOKEN}}" }}

[cards.c]
server = "h"
vram_gib = 1
meters = ["host"]

[flags.default]
role = "default"

[fixtures.one]
prompt = "a cat"
references = ["{ref}"]

[matrix]
references = [1]
"""


def session_runner(tmp: Path) -> SessionRunner:
    path = tmp / "matrix.toml"
    path.write_text(textwrap.dedent(MATRIX.format(results=tmp / "results", hostile=HOSTILE, ref=REF)))
    matrix = load_matrix(path)
    plan = make_plan(matrix)
    store = RunStore(tmp / "run")
    return SessionRunner(RunContext(matrix, plan, store, "u"), plan.sessions[0], References(), Baselines(matrix, store))


@pytest.fixture
def serving(tmp_path: Path) -> Iterator[Callable[[str], tuple[SessionRunner, LocalServer]]]:
    started: list[LocalServer] = []

    def start(mode: str) -> tuple[SessionRunner, LocalServer]:
        server = hostile(tmp_path, mode)
        server.start()
        started.append(server)
        server.wait_ready(20)
        return session_runner(tmp_path), server

    yield start
    for s in started:
        s.stop()


# -- item 2: every value the runner resolved is masked in what the server prints ---------------------------
def test_item2_a_resolved_secret_is_masked_in_a_start_failure_and_a_500(tmp_path: Path,
                                                                        serving: Callable) -> None:
    server = hostile(tmp_path, "load-secret")
    server.start()
    with pytest.raises(StartFailed) as info:
        server.wait_ready(20)
    failure = info.value.failure
    text = json.dumps([failure.message, *failure.evidence])
    assert SECRET not in text and "token *** has no access" in text, text

    r, live = serving("secret")
    call = r._request(r.session.steps[0])
    with httpx.Client() as client:
        record = r.execute(r.sender(client, live), [], r.session.steps[0], 0, False)
    assert isinstance(record, StepRecord) and record.failure is not None
    text = json.dumps(record.model_dump(mode="json"))
    assert record.failure.kind == FailureClass.HTTP_ERROR and "invalid token ***" in record.failure.message
    assert SECRET not in text and "401 Client Error for token ***" in text, text
    assert call.path  # the request went where the dialect says


# -- item 5: every timeout the matrix names is a total deadline -------------------------------------------
def test_item5_ready_timeout_is_a_total_deadline_with_a_dripping_health(tmp_path: Path) -> None:
    server = hostile(tmp_path, "drip-health")
    server.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(StartFailed) as info:
            within(15, lambda: server.wait_ready(3))
    finally:
        server.stop()
    assert info.value.failure.kind == FailureClass.READY_TIMEOUT
    assert time.monotonic() - t0 < 3 + 10  # a probe past the deadline and the stop, never the drip (forever)


def test_item5_request_timeout_is_a_total_deadline_with_a_dripping_response(serving: Callable) -> None:
    r, live = serving("drip")
    with httpx.Client() as client:
        sent = within(15, lambda: r.sender(client, live).send(r._request(r.session.steps[0])))
    assert sent.timed_out and sent.wall_s < 3 + 1.0, sent  # type: ignore[attr-defined]


# -- item 10: memory bounded by caps, not by what the server sends ---------------------------------------
def test_item10_a_huge_body_is_refused_at_the_cap(serving: Callable) -> None:
    r, live = serving("huge")
    with httpx.Client() as client:
        sent = within(60, lambda: r.sender(client, live).send(r._request(r.session.steps[0])))
    assert len(sent.content) < 17 * 2**20, len(sent.content)  # type: ignore[attr-defined]
    with httpx.Client() as client:
        record = r.execute(r.sender(client, live), [], r.session.steps[0], 0, False)
    assert isinstance(record, StepRecord) and record.failure is not None
    assert record.failure.kind == FailureClass.BAD_RESPONSE and "over the cap" in record.failure.message


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # as `runner` does (cli.cmd_run)
def test_item10_an_image_declaring_too_many_pixels_is_never_decoded(tmp_path: Path) -> None:
    sys.path.insert(0, str(HOSTILE.parent))
    from hostile import png  # a 12000x12000 PNG of ~140 KB, written row by row

    r = session_runner(tmp_path)
    step = r.session.steps[0]
    record = StepRecord(key=step.key, card=step.card, flags=step.flags, role="default", fixture=step.fixture,
                        references=1, seed=1, status=Status.OK, image="x.png", image_sha256="ab")
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scored, kept = r.score(Served(record, png(12000, 12000), None))
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert scored.status == Status.FAILED and kept is None and scored.failure is not None
    assert "12000x12000 pixels, over the cap" in scored.failure.message
    assert grew_mib < 50, grew_mib  # decoded, it would be 137 MiB of pixels


# -- item 11: an OOM kill during a request is an OOM of host memory --------------------------------------
class OomKilledServer(RunningServer):
    """A server the engine reports as OOM-killed (docker's State.OOMKilled) as soon as it is asked."""

    def __init__(self, plan: ServerPlan, attempt: Attempt, url: str) -> None:
        super().__init__(plan, attempt)
        self.url = url

    @property
    def base_url(self) -> str:
        return self.url

    def start(self) -> None:
        pass

    def exited(self) -> ExitInfo | None:
        return ExitInfo(137, oom_killed=True)

    def stop(self) -> None:
        pass


def test_item11_an_oom_kill_during_a_request_is_a_host_memory_oom(tmp_path: Path) -> None:
    class Hangup(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.close_connection = True

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Hangup)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        r = session_runner(tmp_path)
        plan = ServerPlan(backend="local", profile=ServerProfile(name="k", command=("x",)), argv=("x",), env={})
        server = OomKilledServer(plan, Attempt(name="k", log_path=tmp_path / "k.log"),
                                 f"http://127.0.0.1:{httpd.server_address[1]}")
        with httpx.Client() as client:
            record = r.execute(r.sender(client, server), [], r.session.steps[0], 0, False)
    finally:
        httpd.shutdown()
    assert isinstance(record, StepRecord) and record.failure is not None
    assert record.failure.kind == FailureClass.OOM and "host memory" in record.failure.message, record.failure
    assert record.lost
    (verdict,) = decide_all([record], [], r.ctx.matrix.verdict, ["c"], None)
    assert verdict.world == "not-built" and "host memory" in verdict.reason, verdict.reason
    assert record.failure.oom is not None and record.failure.oom.memory == "host"
    assert "default host-memory OOM at 1 ref" in summary(verdict), summary(verdict)  # the verdict line


# -- items 12 and 14: a crafted run folder, reported ------------------------------------------------------
HOSTILE_TEXT = (f"{ESC}[2J{ESC}]8;;https://evil.example/{ESC}\\click{ESC}]8;;{ESC}\\ <script>alert(1)</script> "
                "<img src=x onerror=alert(2)> [click](javascript:alert(3)) \u202eevil")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real, tiny, finished run (the control server), copied by each test that crafts it."""
    tmp = tmp_path_factory.mktemp("run")
    path = tmp / "matrix.toml"
    path.write_text(textwrap.dedent(MATRIX.format(results=tmp / "results", hostile=HOSTILE, ref=REF)))
    proc = subprocess.run([sys.executable, "-m", "runner", str(path), "--no-progress"], capture_output=True,
                          text=True, timeout=240, env={**__import__("os").environ, "HF_TOKEN": SECRET})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return next((tmp / "results").glob("u-*"))


def crafted(finished_run: Path, tmp: Path, **over: object) -> Path:
    """The finished run copied into tmp/box/run, with one more failed step record whose fields are `over`."""
    run = tmp / "box" / "run"
    shutil.copytree(finished_run, run)
    doc = json.loads((run / "c/default/refs-1/one-seed-1.json").read_text())
    doc.update(key="c/default/refs-1/two-seed-1", fixture="two", status="failed", image=None, image_sha256=None,
               scores=None, failure={"kind": "http_error", "message": HOSTILE_TEXT, "evidence": [HOSTILE_TEXT],
                                     "http_status": 500, "exit_code": None})
    doc.update(over)
    (run / "c/default/refs-1/two-seed-1.json").write_text(json.dumps(doc))
    return run


def report(run: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runner", "report", str(run)], capture_output=True, text=True,
                          timeout=120)


def test_item12_server_text_is_inert_in_report_md_and_on_the_console(finished_run: Path, tmp_path: Path) -> None:
    run = crafted(finished_run, tmp_path)
    proc = report(run)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    md = (run / "report.md").read_text()
    for bad in (ESC, "\u202e", "<script", "<img", "](javascript:"):
        assert bad not in md.replace("\\](javascript:", ""), (bad, md[-1500:])
    assert "&lt;script&gt;" in md and "\\\\x1b\\[2J" in md  # still there, as text (renders as \x1b[2J)
    assert ESC not in proc.stdout + proc.stderr

    out = io.StringIO()
    view = ProgressView(Console(file=out, force_terminal=True, width=400), enabled=False)
    view.lane_started("c", ("c",), 1)
    record = StepRecord(key="c/default/refs-1/one-seed-1", card="c", flags="default", role="default",
                        fixture="one", references=1, seed=1, status=Status.SKIPPED,
                        skip_reason=f"server did not start: {HOSTILE_TEXT} [bold red]x[/]")
    view.step_done(record)
    printed = out.getvalue()
    assert "\\x1b]8;;" in printed and "[bold red]x[/]" in printed  # escapes visible, rich markup not applied
    assert f"{ESC}]8" not in printed and f"{ESC}[2J" not in printed and "\u202e" not in printed


def test_item14_a_crafted_card_name_never_makes_the_report_write_outside_the_run(finished_run: Path,
                                                                                tmp_path: Path) -> None:
    run = crafted(finished_run, tmp_path, card="../../../outside/pwn")
    before = {p for p in tmp_path.rglob("*") if run not in p.parents}
    proc = report(run)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    after = {p for p in tmp_path.rglob("*") if run not in p.parents}
    assert after == before, sorted(map(str, after - before))
    assert not (tmp_path / "outside").exists()


@pytest.mark.parametrize("over", [{"references": "two"}, {"wall_s": "fast"}, {"peaks": "none"},
                                  {"failure": {"kind": "http_error", "message": 5, "evidence": "x"}},
                                  {"seed": None}, {"card": 7}])
def test_item14_a_record_of_wrong_types_gives_one_line_not_a_traceback(finished_run: Path, tmp_path: Path,
                                                                       over: dict[str, object]) -> None:
    run = crafted(finished_run, tmp_path, **over)
    proc = report(run)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if "two-seed-1" in ln]
    assert len(lines) == 1, proc.stderr  # one line, naming the file


# -- item 1, end to end: a bad gauge reading neither ends the run nor becomes a peak ----------------------
def test_item1_a_gauge_beyond_int64_or_negative_never_ends_the_run_nor_makes_a_peak(tmp_path: Path) -> None:
    """The servers answer with images and `peak_memory_mb: 0.0` (vLLM-Omni's "not measured"), so the bad gauge
    was the only device source: no figure, and a served target without one decides no world (issue 44)."""
    head = MATRIX.split("[servers.h]")[0].format(results=tmp_path / "results")
    tail = "[flags.default]" + MATRIX.split("[flags.default]")[1].format(ref=REF).replace("{{", "{")
    cards = "".join(f"""
        [servers.{card}]
        command = ["{{python}}", "{HOSTILE}", "--port", "{{port}}", "--mode", "ok", "--metrics={gauge}",
                   "--peak-mib", "0"]

        [cards.{card}]
        server = "{card}"
        vram_gib = 1
        meters = ["server", "host"]
        """ for card, gauge in (("huge", "1e30"), ("negative", "-5e9")))  # 1e30 B ≥ 2^63; -5e9 B ≈ -4768 MiB
    path = tmp_path / "matrix.toml"
    path.write_text(textwrap.dedent(head) + textwrap.dedent(cards) + textwrap.dedent(tail))
    proc = subprocess.run([sys.executable, "-m", "runner", str(path), "--no-progress"], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]  # undecided, not a crash
    run = next((tmp_path / "results").glob("u-*"))
    verdicts = {v["card"]: v for v in json.loads((run / "verdict.json").read_text())["verdicts"]}
    for card, why in (("huge", "beyond any memory"), ("negative", "is negative")):
        step = json.loads((run / card / "default/refs-1/one-seed-1.json").read_text())
        server = next(p for p in step["peaks"] if p["source"] == "server")
        assert step["status"] == "ok" and not server["available"] and server["bytes"] is None, server
        assert why in server["reason"], server["reason"]
        assert (run / card / "default" / "memory.csv").read_text().startswith("t,attempt")
        verdict = verdicts[card]
        assert verdict["world"] == "undecided" and verdict["evidence"]["peak_bytes"] is None, verdict
        assert "no device-memory figure" in verdict["reason"] and why in verdict["reason"], verdict["reason"]
        assert "the server reported 0.0 (not measured) at choices[0].message.content[0].peak_memory_mb" in \
            verdict["reason"], verdict["reason"]
    assert "peak -" not in proc.stdout and "peak ?" not in proc.stdout


# -- issue 30: hand-edited records are skipped with one line; the report is still written ----------
def _edited(finished_run: Path, tmp: Path, text: str) -> Path:
    run = tmp / "box" / "run"
    shutil.copytree(finished_run, run)
    (run / "c/default/refs-1/two-seed-1.json").write_text(text)
    return run


def _ok_record(finished_run: Path, **over: object) -> str:
    doc = json.loads((finished_run / "c/default/refs-1/one-seed-1.json").read_text())
    doc.update(key="c/default/refs-1/two-seed-1", fixture="two", **over)
    return json.dumps(doc)


@pytest.mark.parametrize("edit", ["deep", "zero-sample", "huge-count", "nan-wall", "inf-sample", "negative-wall"])
def test_an_edited_record_is_skipped_with_one_line_and_the_report_written(finished_run: Path, tmp_path: Path,
                                                                        edit: str) -> None:
    text = {"deep": "[" * 200_000 + "]" * 200_000,
            "zero-sample": _ok_record(finished_run, wall_samples_s=[0.0, 0.5]),
            "huge-count": _ok_record(finished_run, references=10**400),
            "nan-wall": _ok_record(finished_run, wall_s=float("nan")),
            "inf-sample": _ok_record(finished_run, wall_samples_s=[float("inf")]),
            "negative-wall": _ok_record(finished_run, wall_s=-1.5, wall_samples_s=[-1.5])}[edit]
    run = _edited(finished_run, tmp_path, text)
    proc = report(run)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if "two-seed-1" in ln]
    assert len(lines) == 1 and "skipping" in lines[0], proc.stderr
    shown = (run / "report.md").read_text()
    assert "nan s" not in shown and "-1.50 s" not in shown and "inf s" not in shown
    verdict = (run / "verdict.json").read_text()
    assert "NaN" not in verdict and "Infinity" not in verdict


@pytest.mark.parametrize("edit", ["deep", "zero-sample", "huge-count"])
def test_resume_over_an_edited_record_skips_it_with_one_line_and_finishes(finished_run: Path, tmp_path: Path,
                                                                          edit: str) -> None:
    # issue 30 R-1 under --resume: the same edits that crashed `runner report` crashed the resume's reading
    text = {"deep": "[" * 200_000 + "]" * 200_000,
            "zero-sample": _ok_record(finished_run, wall_samples_s=[0.0, 0.5]),
            "huge-count": _ok_record(finished_run, references=10**400)}[edit]
    run = tmp_path / "box" / "run"
    shutil.copytree(finished_run, run)
    edited = run / "c/default/refs-1/one-seed-1.json"  # a step of the plan
    text = text.replace("two-seed-1", "one-seed-1").replace('"fixture": "two"', '"fixture": "one"')
    edited.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "runner", str(finished_run.parent.parent / "matrix.toml"),
                           "--resume", str(run), "--no-progress"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    skipped = [ln for ln in proc.stderr.splitlines() if "skipping" in ln]
    assert len(skipped) == 1 and str(edited) in skipped[0], proc.stderr
    assert "one-seed-1: ok" in proc.stderr  # sent again ...
    assert json.loads(edited.read_text())["status"] == "ok"
    kept = edited.with_name("one-seed-1.json.skipped")  # ... and the edited bytes kept beside, named in a line
    assert kept.read_text() == text
    assert any("kept as one-seed-1.json.skipped" in ln for ln in proc.stderr.splitlines())
    assert (run / "report.md").exists() and (run / "verdict.json").exists()


def test_a_file_where_the_plots_folder_goes_is_one_line(finished_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    shutil.rmtree(run / "plots")
    (run / "plots").write_text("not a folder")
    proc = report(run)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("runner: error:") and "plots" in proc.stderr


def test_resume_never_overwrites_a_record_a_newer_runner_wrote(finished_run: Path, tmp_path: Path) -> None:
    # issue 30 R-3: a schema_version 99 record was skipped, its step sent again and the file overwritten
    run = tmp_path / "box" / "run"
    shutil.copytree(finished_run, run)
    path = run / "c/default/refs-1/one-seed-1.json"
    doc = json.loads(path.read_text())
    doc["schema_version"] = 99
    path.write_text(json.dumps(doc))
    before = path.read_bytes()
    proc = subprocess.run([sys.executable, "-m", "runner", str(finished_run.parent.parent / "matrix.toml"),
                           "--resume", str(run), "--no-progress"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert str(path) in line and "newer runner" in line, line
    assert path.read_bytes() == before


@pytest.mark.parametrize("edit", ["deep-session", "huge-send", "huge-sends-everywhere"])
def test_plan_estimate_from_an_edited_run_is_a_line_not_a_traceback(finished_run: Path, tmp_path: Path,
                                                                   edit: str) -> None:
    # issue 30 C-2
    run = tmp_path / "box" / "run"
    shutil.copytree(finished_run, run)
    if edit == "deep-session":
        (run / "c/default/session.json").write_text("[" * 200_000 + "]" * 200_000)
    else:
        one = [run / "c/default/refs-1/one-seed-1.json"]
        paths = one if edit == "huge-send" else list(run.glob("c/*/refs-*/*.json"))
        for path in paths:
            doc = json.loads(path.read_text())
            doc["sends"] = [{**s, "wall_s": 1e308} for s in doc["sends"]]
            doc["wall_s"], doc["wall_samples_s"] = 1e308, [1e308] * len(doc["wall_samples_s"])
            path.write_text(json.dumps(doc))
    proc = subprocess.run([sys.executable, "-m", "runner", "plan", str(finished_run.parent.parent / "matrix.toml"),
                           "--estimate-from", str(run)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "inf" not in proc.stdout.lower().replace("info", ""), proc.stdout[-2000:]
    estimate = [ln for ln in proc.stdout.splitlines() if ln.startswith(("  lane ", "  run: "))]
    assert estimate and not any(any(len(d) > 5 for d in ln.replace(":", " ").split() if d.isdigit())
                                for ln in estimate), estimate  # no 300-digit hour count


@pytest.mark.parametrize("edit", ["newer-version", "extra-key", "matrix-not-toml"])
def test_report_checks_run_json_as_resume_does(finished_run: Path, tmp_path: Path, edit: str) -> None:
    # issue 30 R-4: report accepted what resume refuses; a bad matrix text named a temporary file
    run = tmp_path / "box" / "run"
    shutil.copytree(finished_run, run)
    doc = json.loads((run / "run.json").read_text())
    if edit == "newer-version":  # a run.json of a newer runner than this one
        doc["schema_version"] = SCHEMA_VERSION + 1
    elif edit == "extra-key":
        doc["surprise"] = 1
    else:
        doc["matrix"]["text"] = "[run\nthis is not toml"
    (run / "run.json").write_text(json.dumps(doc))
    proc = report(run)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert str(run / "run.json") in line and "/tmp/tmp" not in line.replace(str(run), ""), line


def test_garbage_in_memory_csv_is_said_not_silent(finished_run: Path, tmp_path: Path) -> None:
    # issue 30 R-4, third part: garbage in memory.csv silently removed the memory plot
    run = tmp_path / "box" / "run"
    shutil.copytree(finished_run, run)
    csv_path = run / "c/default/memory.csv"
    header = csv_path.read_text().splitlines()[0]
    csv_path.write_text(header + "\n" + "not,a,sample,at,all\n" * 3 + "\x00\x01garbage\n")
    proc = report(run)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    text = (run / "report.md").read_text()
    assert "memory.csv of <code>c/default</code>: 4 line(s) are not samples and were left out" in text, text[-3000:]
