"""A resume whose only work left on a card is its soak still asks that card's hosts first: a card whose
dcgm-exporter no longer answers stops the resume in preflight (one line, nothing started), and with
`--skip-unreachable` it is set aside — its soak never starts, the other card's soak is continued, and the set-aside
one is left for a later resume.

Both soaks are cut by a Ctrl-C while each holds its fifth request (the leaky double holds it until the runner is
gone: the test acts during the hung requests, it does not sleep and hope). The card 'away' names a dcgm-exporter: a
stub on a local port that answers during the first run and is closed before the resume — a real connection
refusal, no remote host."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from test_soak import BASE, BUDGET, DOUBLE, ROOT, WORK, runner

REQUESTS = 12
HELD_AT = 5  # the request each soak holds when the Ctrl-C comes: 1..4 are recorded


class _Exporter(BaseHTTPRequestHandler):
    """Answers every scrape with no series: reachable, and no figure (the card's server meter has them)."""

    def do_GET(self) -> None:
        body = b"# no GPU here\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def exporter() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Exporter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def matrix(tmp: Path, dcgm_url: str) -> Path:
    (tmp / "ref.png").write_bytes((ROOT / "examples" / "refs" / "ref-1.png").read_bytes())
    servers = "".join(f"""
[servers.{card}]
command = ["{{python}}", "{DOUBLE}", "--port", "{{port}}", "--budget-mib", "{BUDGET}", "--base-mib", "{BASE}",
           "--work-mib", "{WORK}", "--leak-mib", "0", "--hold-at", "{HELD_AT}", "--hold-file", "{tmp / card}.held"]
model = "leaky"
""" for card in ("here", "away"))
    path = tmp / "m.toml"
    path.write_text(f"""
[run]
name = "soak"
steps = 2
size = "64x64"
request_timeout_s = 30
ready_timeout_s = 30
diagnosis = "off"
{servers}
[cards.here]
server = "here"
vram_mib = {BUDGET}
meters = ["server"]

[cards.away]
server = "away"
vram_mib = {BUDGET}
meters = ["server", "dcgm"]
dcgm_url = "{dcgm_url}"

[flags.default]
role = "default"

[fixtures.f]
prompt = "compose"
references = ["ref.png"]

[matrix]
references = [1]

[verdict]
target_references = 1

[soak]
requests = {REQUESTS}
flags = ["default"]
""")
    return path


def numbers(run_dir: Path, card: str) -> list[int]:
    lines = (run_dir / card / "default" / "soak" / "requests.jsonl").read_text().splitlines()
    return [json.loads(line)["number"] for line in lines]


def interrupted_in_both_soaks(m: Path, results: Path, tmp: Path) -> Path:
    run = subprocess.Popen(runner(str(m), "--results", str(results)), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not all((tmp / f"{card}.held").exists() for card in ("here", "away")):
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
            time.sleep(0.05)
        os.kill(run.pid, signal.SIGINT)
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 130, err[-3000:]
    (run_dir,) = results.glob("soak-*")
    assert numbers(run_dir, "here") == numbers(run_dir, "away") == list(range(1, HELD_AT))
    return run_dir


@pytest.mark.timeout(240)
def test_a_card_set_aside_as_unreachable_never_starts_its_soak(tmp_path: Path, exporter: ThreadingHTTPServer) -> None:
    url = f"http://127.0.0.1:{exporter.server_address[1]}/metrics"
    m = matrix(tmp_path, url)
    run_dir = interrupted_in_both_soaks(m, tmp_path / "r", tmp_path)
    away = run_dir / "away" / "default" / "soak"
    before = {p.name: p.read_bytes() for p in away.iterdir() if p.is_file()}
    exporter.shutdown()
    exporter.server_close()  # nothing listens there now: a connection refused

    # without --skip-unreachable: one line naming the card and its exporter, nothing started
    proc = subprocess.run(runner(str(m), "--resume", str(run_dir)), capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and "card 'away'" in errors[0] and url in errors[0], errors
    assert numbers(run_dir, "here") == list(range(1, HELD_AT))

    # with it: 'away' is set aside with one line, its soak untouched; 'here' finishes its soak
    proc = subprocess.run(runner(str(m), "--resume", str(run_dir), "--skip-unreachable"), capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-3000:]  # a resume still owes 'away' its soak
    skips = [ln for ln in proc.stderr.splitlines() if "skipping card 'away'" in ln]
    owed = REQUESTS - HELD_AT + 1
    assert len(skips) == 1 and url in skips[0] and f"{owed} soak request(s)" in skips[0], proc.stderr[-3000:]
    assert numbers(run_dir, "here") == list(range(1, REQUESTS + 1))
    assert {p.name: p.read_bytes() for p in away.iterdir() if p.is_file()} == before  # no start, no request
    assert "away/default soak" not in proc.stderr + proc.stdout
    assert f"{owed} soak request(s) not done" in proc.stderr, proc.stderr[-3000:]
