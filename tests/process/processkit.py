"""Helpers for the issue 18 process tests: a small matrix on the real reference server, the runner as a real
process group (as a terminal or an ssh session runs it), and checks that a run's records are whole."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import jsonschema
import psutil

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "runner" / "schema" / "result.schema.json").read_text())
REFS = [str(ROOT / "examples" / "refs" / f"ref-{i}.png") for i in range(1, 3)]


def matrix(tmp: Path, *, seeds: str = "[1, 2, 3]", references: str = "[0, 1]", server_args: str = "",
           request_timeout: int = 60, extra: str = "", flags: str = "") -> Path:
    text = textwrap.dedent(f"""
        [run]
        name = "proc"
        seeds = {seeds}
        repeats = 1
        determinism_check = false
        steps = 2
        size = "64x64"
        request_timeout_s = {request_timeout}
        ready_timeout_s = 90
        results_dir = "{tmp / 'results'}"
        {extra}

        [servers.ref]
        command = ["{{python}}", "-m", "runner.refserver", "--port", "{{port}}", "--preset", "tiny",
                   "--vram-gib", "{{vram_gib}}"{server_args}]

        [cards.roomy]
        server = "ref"
        vram_mib = 64

        [flags.default]
        role = "default"
        {flags}

        [fixtures.shapes]
        prompt = "shapes on a table"
        references = {json.dumps(REFS)}

        [matrix]
        references = {references}
        """)
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "matrix.toml"
    path.write_text(text)
    return path


class Runner:
    """`runner MATRIX` in its own session and process group (what a terminal's Ctrl-C or a dropped ssh
    session signals is the foreground group)."""

    def __init__(self, path: Path, *extra: str) -> None:
        self.path = path
        self.err_path = path.parent / f"runner-{time.monotonic_ns()}.err"
        self.err = self.err_path.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "runner", str(path), "--no-progress", *extra],
                                     cwd=path.parent, stdout=self.err, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float = 120) -> int:
        code = self.proc.wait(timeout)
        self.err.close()
        return code

    @property
    def output(self) -> str:
        if not self.err.closed:
            self.err.flush()
        return self.err_path.read_text()


def find_run(tmp: Path) -> Path | None:
    """The newest run folder, or None while the runner has not made one (results/ comes first)."""
    runs = sorted((tmp / "results").glob("proc-*"))
    return runs[-1] if runs else None


def run_dir(tmp: Path) -> Path:
    run = find_run(tmp)
    assert run is not None, "no run folder"
    return run


def run_shows(tmp: Path, check: Callable[[Path], bool]) -> bool:
    """A wait_for predicate: the run folder exists and `check` holds on it."""
    run = find_run(tmp)
    return run is not None and check(run)


def step_files(run: Path) -> list[Path]:
    return sorted(run.glob("*/*/refs-*/*.json"))


def wait_for(predicate, timeout: float = 120, poll: float = 0.05) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    return False


def records_done(run: Path) -> int:
    n = 0
    for p in step_files(run):
        try:
            if json.loads(p.read_text())["status"] != "skipped":
                n += 1
        except (ValueError, KeyError):
            pass
    return n


def check_records(run: Path, planned: int) -> list[dict]:
    """0 lost, 0 duplicated, 0 corrupt: one valid record per planned step, each at its own key's path."""
    docs = []
    for p in step_files(run):
        doc = json.loads(p.read_text())  # corrupt: raises
        jsonschema.validate(doc, SCHEMA)
        assert f"{doc['key']}.json" == p.relative_to(run).as_posix(), p
        docs.append(doc)
    keys = [d["key"] for d in docs]
    assert len(keys) == len(set(keys)) == planned, (len(keys), planned)
    for p in [*run.glob("*/*/session.json"), run / "run.json"]:
        jsonschema.validate(json.loads(p.read_text()), SCHEMA)
    return docs


def leftovers(tmp: Path) -> list[str]:
    """Processes of this test's runs still alive: refservers started from its folder, runners on its matrix."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if str(tmp) in cmd or ("runner.refserver" in cmd and p.cwd().startswith(str(tmp))):
                out.append(f"{p.pid}: {cmd[:200]}")
        except psutil.Error:
            continue
    return out


def nothing_left(tmp: Path, timeout: float = 20) -> None:
    assert wait_for(lambda: not leftovers(tmp), timeout), leftovers(tmp)


SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM, "SIGHUP": signal.SIGHUP}
