"""Issue 46, the file system's items: a results folder made read-only mid-run (D-1), a record that is not a regular
file (D-2), two runs of one name started in the same second (D-3)."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from runner.backends.base import ExitInfo, RunningServer
from runner.core.records import RunRecord, load
from runner.core.registry import BACKENDS, BackendEntry, BackendOptions
from runner.plan.lanes import make_plan
from runner.plan.matrix import load_matrix
from runner.present import runinfo
from runner.run.execute import RunContext, run_plan
from runner.run.store import RunStore, StoreError

ROOT = Path(__file__).resolve().parents[2]
HOSTILE = Path(__file__).with_name("hostile.py")
REF = ROOT / "examples" / "refs" / "ref-1.png"


def within(seconds: float, call: Callable[[], Any]) -> Any:
    """call() on a thread; fails the test instead of hanging it when it takes longer than `seconds`."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s: it hangs"
    if "error" in box:
        raise box["error"]
    return box.get("value")


# --- D-1: a results folder made read-only while a request is in flight ---------------------------------------
@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[Path], Path]]:
    """mount(folder): a small tmpfs mounted on `folder` (made), unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted: list[Path] = []

    def mount(folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)]).returncode != 0:
            pytest.skip("cannot mount a tmpfs here")
        mounted.append(folder)
        return folder

    yield mount
    for folder in reversed(mounted):
        subprocess.run(["umount", "-l", str(folder)], check=True)


def read_only(folder: Path) -> None:
    """Remount `folder` read-only. A remount waits out a file open for writing (EBUSY): the runner's record and
    memory.csv writes are short, so this retries for a moment; the server here holds no file open."""
    for _ in range(100):
        if subprocess.run(["mount", "-o", "remount,ro", str(folder)], capture_output=True).returncode == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"could not remount {folder} read-only")


def _png() -> str:
    out = io.BytesIO()
    Image.new("RGB", (32, 32), (40, 120, 200)).save(out, "PNG")
    return base64.b64encode(out.getvalue()).decode()


class ReadOnlyDuringRequest(RunningServer):
    """A server in this process that makes its session's folder read-only while it holds the first request,
    then answers it: the step's record is the first write that meets the read-only folder. Its log is written
    and closed at start, so no file of the folder is open for writing when it is remounted."""

    session_folder: Path

    def start(self) -> None:
        folder = self.session_folder

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200 if self.path == "/health" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                read_only(folder)  # during the request: the runner is waiting for this answer
                url = f"data:image/png;base64,{_png()}"
                data = json.dumps({"choices": [{"message": {"content": [
                    {"type": "image_url", "image_url": {"url": url}}]}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.http.server_address[1]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_text("server ready\n")
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def exited(self) -> ExitInfo | None:
        return None

    def stop(self) -> None:
        if hasattr(self, "http"):
            self.http.shutdown()
            self.http.server_close()


MATRIX = """
[run]
name = "ro"
seeds = [1]
repeats = 1
determinism_check = false
steps = 2
size = "32x32"

[servers.s]
command = ["in-process", "--port", "{{port}}"]

[cards.c]
server = "s"
backend = "inprocess"
meters = ["host"]
vram_gib = 1

[flags.default]
role = "default"

[fixtures.one]
prompt = "a cat"
references = ["{ref}"]

[matrix]
references = [1]
"""


def test_d1_a_results_folder_made_read_only_mid_run_is_the_one_line_store_error(
        tmp_path: Path, tmpfs: Callable[[Path], Path]) -> None:
    """Before: seal_log's `unlink(missing_ok=True)` of its temporary file raised EROFS inside the handler of the
    StoreError, and that OSError reached the user as a traceback with exit 1."""
    path = tmp_path / "matrix.toml"
    path.write_text(textwrap.dedent(MATRIX.format(ref=REF)))
    entry = BackendEntry("inprocess", ReadOnlyDuringRequest, BackendOptions, "127.0.0.1", "a thread of the test")
    with BACKENDS.added(entry):
        matrix = load_matrix(path)
        plan = make_plan(matrix)
        store = RunStore(tmp_path / "results" / "ro-run")
        store.write_run(load(RunRecord, runinfo.run_doc(matrix, plan, "ro-run", time.time())).model_dump(mode="json"))
        ReadOnlyDuringRequest.session_folder = tmpfs(store.root / "c" / "default")
        with pytest.raises(StoreError) as raised:
            within(120, lambda: run_plan(RunContext(matrix, plan, store, "ro-run")))
    message = str(raised.value)
    assert "Read-only file system" in message and "\n" not in message, message
    assert "every record finished before it is kept" in message
    assert (store.root / "run.json").is_file()  # what was written before stays


# --- D-2: a FIFO where a record, a session or memory.csv should be -----------------------------------------
RUN_MATRIX = """
[run]
name = "f"
seeds = [1, 2]
repeats = 1
determinism_check = false
restarts = 0
steps = 2
size = "64x64"
request_timeout_s = 10
ready_timeout_s = 20
results_dir = "{results}"

[servers.h]
command = ["{{python}}", "{hostile}", "--port", "{{port}}", "--mode", "ok"]

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
HANG_S = 60  # far beyond what a report or a one-step resume of this run takes; a FIFO waited on never ends


def runner(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, timeout=HANG_S)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real, tiny, finished run (two steps on the control server), copied by each test that plants a FIFO."""
    tmp = tmp_path_factory.mktemp("fifo")
    matrix = tmp / "matrix.toml"
    matrix.write_text(textwrap.dedent(RUN_MATRIX.format(results=tmp / "results", hostile=HOSTILE, ref=REF)))
    proc = runner(str(matrix), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return next((tmp / "results").glob("f-*"))


def planted(finished: Path, tmp: Path, relative: str) -> tuple[Path, Path]:
    """The finished run copied into tmp, with a FIFO made where `relative` was: (run folder, the FIFO)."""
    run = tmp / "run"
    shutil.copytree(finished, run)
    fifo = run / relative
    fifo.unlink()
    os.mkfifo(fifo)
    return run, fifo


FIFO_PLACES = ["c/default/refs-1/one-seed-1.json", "c/default/session.json", "c/default/memory.csv"]


@pytest.mark.parametrize("relative", FIFO_PLACES)
def test_d2_report_skips_a_fifo_with_one_line_instead_of_hanging(finished: Path, tmp_path: Path,
                                                               relative: str) -> None:
    """Before: `runner report` hung in open() on the FIFO, forever (only a second Ctrl-C ended it)."""
    run, fifo = planted(finished, tmp_path, relative)
    proc = runner("report", str(run))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    said = [ln for ln in proc.stderr.splitlines() if "FIFO" in ln] + \
        [ln for ln in (run / "report.md").read_text().splitlines() if "FIFO" in ln]
    assert len(said) == 1 and "not a regular file (a FIFO)" in said[0], proc.stderr[-2000:]
    assert (run / "verdict.json").is_file() and fifo.exists()  # the report is written; the FIFO left as it is


def test_d2_resume_over_a_fifo_record_sends_its_step_again_and_keeps_the_fifo_aside(finished: Path,
                                                                                  tmp_path: Path) -> None:
    run, fifo = planted(finished, tmp_path, FIFO_PLACES[0])
    proc = runner(str(finished.parents[1] / "matrix.toml"), "--resume", str(run), "--no-progress")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "1 step(s) to send" in proc.stderr and "one-seed-1: ok" in proc.stderr, proc.stderr[-2000:]
    assert json.loads(fifo.read_text())["status"] == "ok"  # a record again
    assert fifo.with_name(fifo.name + ".skipped").is_fifo()  # what stood there is kept beside, never read


def test_d2_a_fifo_where_a_steps_image_goes_is_no_image_not_a_hang(finished: Path, tmp_path: Path) -> None:
    """The image is read back by the cell rescoring and by auto top-ups."""
    run, _ = planted(finished, tmp_path, "c/default/refs-1/one-seed-1.png")
    lines: list[str] = []
    store = RunStore(run, warn=lines.append)
    assert within(HANG_S, lambda: store.read_png("c/default/refs-1/one-seed-1")) is None
    assert len(lines) == 1 and "not a regular file (a FIFO)" in lines[0], lines
    assert within(HANG_S, lambda: store.read_png("c/default/refs-1/one-seed-2")).startswith(b"\x89PNG")


# --- D-3: a new run whose folder name is taken (same run name, same second) --------------------------------
FROZEN = 1_796_000_000.0  # the clock both runs read: the same second, by construction


class _FrozenClock:
    class datetime:  # stands in for the datetime class app reads the time from
        @staticmethod
        def now() -> Any:
            import datetime as real

            return real.datetime.fromtimestamp(FROZEN)


@pytest.mark.parametrize("other", ["finished", "running"])
def test_d3_a_new_run_never_adopts_nor_is_refused_a_folder_of_another_run_of_its_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], other: str) -> None:
    """Before: the second run of a name started in the same second was refused "in use" (the first held the
    folder's lock) though it asked for a new run; or, when the other run had finished, it adopted its folder:
    run.json overwritten, the other's records in its report."""
    from runner import app
    from runner.core.units import slug
    from runner.run import runlock

    monkeypatch.setattr(app, "dt", _FrozenClock)
    results = tmp_path / "results"
    theirs = results / f"{slug('f')}-{runinfo.iso_time(FROZEN).replace(':', '')}"
    (theirs / "c" / "default" / "refs-1").mkdir(parents=True)
    their_run = json.dumps({"run_id": theirs.name, "matrix": {"path": "/elsewhere/other.toml", "text": "x"}})
    (theirs / "run.json").write_text(their_run)
    their_step = theirs / "c" / "default" / "refs-1" / "one-seed-1.json"
    their_step.write_text('{"the other matrix": 1}')
    held = runlock.acquire(theirs) if other == "running" else None
    matrix = tmp_path / "matrix.toml"
    matrix.write_text(textwrap.dedent(RUN_MATRIX.format(results=results, hostile=HOSTILE, ref=REF)))
    try:
        code = within(120, lambda: app.run(str(matrix), progress=False))
    finally:
        if held is not None:
            held.release()
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    assert (theirs / "run.json").read_text() == their_run and their_step.read_text() == '{"the other matrix": 1}'
    mine = theirs.with_name(theirs.name + "-2")
    doc = json.loads((mine / "run.json").read_text())
    assert doc["run_id"] == mine.name and doc["matrix"]["path"] == str(matrix)
    assert len(list(mine.glob("c/default/refs-1/*.json"))) == 2 and f"→ {mine}" in err
