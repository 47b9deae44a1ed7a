"""The hostile-server corpus (issue 18): one real run of `runner` against a server per misbehaviour
(tests/safety/hostile.py, stdlib, on 127.0.0.1). Each ends as a recorded failure with a clear reason, the
runner's own RSS stays under RSS_BOUND the whole time, and no secret nor raw control character nor live
markup is in any file of the run folder or on the console.

On main at 09c7220 this run holds the runner for minutes (drip, drip-health), grows it past 1.6 GiB (huge,
bomb), writes the token into five files and the console, and copies the escapes raw.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.safety.hostile_matrix import hostile_matrix

ROOT = Path(__file__).resolve().parents[2]
SECRET = "hf_Zq8TOKEN0123456789abcdefSECRET"
RSS_BOUND = 450 * 2**20  # the runner alone (python, numpy, PIL, matplotlib for the report) peaks at ~230 MiB here
REQUEST_TIMEOUT_S, READY_TIMEOUT_S = 3, 8

# card → (mode, where the failure is recorded, failure kind, words its reason must hold)
CORPUS = {
    "drip": ("drip", "step", "timeout", "no response within the request deadline"),
    "huge": ("huge", "step", "bad_response", "over the cap"),
    "gzip-bomb": ("gzip-bomb", "step", "bad_response", "inflates past the cap"),
    "bomb": ("bomb", "step", "bad_response", "12000x12000 pixels, over the cap"),
    "html": ("html", "step", "bad_response", "does not decode"),
    "bad-base64": ("bad-base64", "step", "bad_response", "not valid base64"),
    "secret": ("secret", "step", "http_error", "HTTP 500"),
    "escapes": ("escapes", "step", "http_error", "HTTP 500"),
    "hang": ("hang", "step", "timeout", "no response within the request deadline"),
    "drip-health": ("drip-health", "start", "ready_timeout", "not ready before the deadline"),
    "load-secret": ("load-secret", "start", "load_exit", "PermissionError: token *** has no access"),
}

pytestmark = pytest.mark.slow


def write_matrix(tmp: Path) -> Path:
    cards = {card: mode for card, (mode, *_) in {**CORPUS, "control": ("ok",)}.items()}
    return hostile_matrix(tmp, "hostile", cards, request_timeout_s=REQUEST_TIMEOUT_S,
                          ready_timeout_s=READY_TIMEOUT_S, token_env=True)


class RssWatch:
    """The runner process's own RSS, sampled every 20 ms while it runs (its servers are other processes)."""

    def __init__(self, pid: int) -> None:
        self.proc, self.peak = psutil.Process(pid), 0
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.02)


# What must appear nowhere: the token, raw control characters (ESC, BEL, bidi overrides), live markup.
RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
LIVE_MARKUP = re.compile(r"<script|<img|(?<!\\)\]\(javascript:|<javascript:", re.IGNORECASE)  # \] is text


def leaks(name: str, text: str, markdown: bool) -> list[str]:
    found = []
    if SECRET in text:
        found.append(f"{name}: the token")
    if m := RAW_CONTROL.search(text):
        found.append(f"{name}: raw control character {m.group()!r}")
    if markdown and (m := LIVE_MARKUP.search(text)):
        found.append(f"{name}: live markup {m.group()!r}")
    return found


def test_hostile_corpus_ends_in_recorded_failures_bounded_memory_and_nothing_leaked(tmp_path: Path) -> None:
    path = write_matrix(tmp_path)
    env = {**os.environ, "HF_TOKEN": SECRET}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "runner", str(path), "--no-progress"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watch = RssWatch(proc.pid)
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:  # a run stalled by a drip: stop it like Ctrl-C, then for good
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=30)
            finally:
                proc.kill()
                proc.wait()
    print(f"runner RSS peak {watch.peak / 2**20:.0f} MiB, {time.monotonic() - t0:.1f} s")
    elapsed = time.monotonic() - t0
    run_dir = next((tmp_path / "results").glob("hostile-*"))

    assert proc.returncode == 1, err[-3000:]  # cards undecided (harness failures), never a traceback
    assert "Traceback" not in err, err[-3000:]
    assert "Warning:" not in err, err[-3000:]  # no raw library warning on the console (PIL's at the bomb was)
    assert watch.peak < RSS_BOUND, f"runner RSS peaked at {watch.peak / 2**20:.0f} MiB"

    verdicts = {v["card"]: v for v in json.loads((run_dir / "verdict.json").read_text())["verdicts"]}
    assert verdicts["control"]["world"] == "fits-resident"
    for card, (_, where, kind, words) in CORPUS.items():
        if where == "step":
            record = json.loads((run_dir / card / "default" / "refs-1" / "one-seed-1.json").read_text())
            failure = record["failure"]
            assert record["status"] == "failed", (card, record)
        else:
            session = json.loads((run_dir / card / "default" / "session.json").read_text())
            failure = session["starts"][0]["failure"]
        assert failure["kind"] == kind and words in failure["message"], (card, failure)
        assert verdicts[card]["world"] == "undecided", (card, verdicts[card]["reason"])
        if kind == "timeout":  # a total deadline: no dripping past it
            assert record["wall_s"] < REQUEST_TIMEOUT_S + 1.5, (card, record["wall_s"])
    session = json.loads((run_dir / "drip-health" / "default" / "session.json").read_text())
    start = session["starts"][0]
    assert start["stopped_at"] - start["started_at"] < READY_TIMEOUT_S + 6, start  # probe deadline inside it
    assert elapsed < 200, elapsed  # each deadline held: no step waits on a drip

    # The masked token stands where the server printed it; escapes are visible, never raw.
    secret = json.loads((run_dir / "secret" / "default" / "refs-1" / "one-seed-1.json").read_text())
    assert "invalid token ***" in secret["failure"]["message"]
    escapes = json.loads((run_dir / "escapes" / "default" / "refs-1" / "one-seed-1.json").read_text())
    assert any("\\x1b[2J" in line and "\\x1b]8;;" in line for line in escapes["failure"]["evidence"])

    problems = leaks("stdout", out, False) + leaks("stderr", err, False)
    for file in run_dir.rglob("*"):
        if file.is_file() and file.suffix != ".png":  # records, report, memory.csv, server logs
            problems += leaks(str(file.relative_to(run_dir)), file.read_text(errors="replace"),
                              file.suffix == ".md")
    report = (run_dir / "report.md").read_text()
    assert "&lt;script&gt;" in report  # quoted, as text
    assert not problems, problems
