"""Issue 46, the file system's items: a results folder made read-only mid-run (D-1), a record that is not a regular
file (D-2), two runs of one name started in the same second (D-3)."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
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
