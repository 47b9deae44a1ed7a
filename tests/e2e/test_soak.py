"""The soak end to end, over the real CLI, against a server that leaks a known size per request
(tests/e2e/fake_leaky_server.py): it runs out of memory at a request number computed from its parameters, and the
Findings name that request; a Ctrl-C during a soak request (the server holds it: the test acts while it is in
flight) and a `--resume` send only the rest."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOUBLE = Path(__file__).with_name("fake_leaky_server.py")
BUDGET, BASE, WORK, LEAK = 64, 16, 8, 2  # MiB


def matrix(tmp: Path, *, leak: float, requests: int, hold: str = "") -> Path:
    (tmp / "ref.png").write_bytes((ROOT / "examples" / "refs" / "ref-1.png").read_bytes())
    extra = f', "--hold-at", "5", "--hold-file", "{hold}"' if hold else ""
    path = tmp / "m.toml"
    path.write_text(f"""
[run]
name = "soak"
steps = 2
size = "64x64"
request_timeout_s = 30
ready_timeout_s = 30
diagnosis = "off"

[servers.leaky]
command = ["{{python}}", "{DOUBLE}", "--port", "{{port}}", "--budget-mib", "{BUDGET}", "--base-mib", "{BASE}",
           "--work-mib", "{WORK}", "--leak-mib", "{leak}"{extra}]
model = "leaky"

[cards.c]
server = "leaky"
vram_mib = {BUDGET}
meters = ["server"]

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
requests = {requests}
flags = ["default"]
""")
    return path


def runner(*args: str) -> list[str]:
    return [sys.executable, "-m", "runner", *args, "--no-progress"]


def soak_requests(run_dir: Path) -> list[dict]:
    lines = (run_dir / "c" / "default" / "soak" / "requests.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_a_leaking_server_runs_out_at_the_request_its_parameters_give_and_the_findings_name_it(tmp_path: Path) -> None:
    # the matrix's own session is another start; the soak's start holds BASE, each served request leaves LEAK:
    # request n needs BASE + (n - 1) * LEAK + WORK, the first above BUDGET is n = (BUDGET - BASE - WORK) // LEAK + 2
    expected = (BUDGET - BASE - WORK) // LEAK + 2
    proc = subprocess.run(runner(str(matrix(tmp_path, leak=LEAK, requests=40)), "--results", str(tmp_path / "r")),
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "r").glob("soak-*")
    done = soak_requests(run_dir)
    assert [r["number"] for r in done] == list(range(1, expected + 1))
    assert done[-1]["failure"]["kind"] == "oom" and all(r["failure"] is None for r in done[:-1])
    report = (run_dir / "report.md").read_text()
    above = (expected - 2) * LEAK  # the floor after the last served request over the first's
    assert f"failed at request {expected} of 40: out of memory" in report
    assert f"with the floor {above:.2f} MiB above the first request's" in report
    assert f"drift {LEAK:.2f} MiB per request" in report
    # the single-request verdict stands; its reason names the deciding flag set's soak failure
    verdict = json.loads((run_dir / "verdict.json").read_text())["verdicts"][0]
    assert verdict["world"] == "fits-resident" and f"failed at request {expected} of 40" in verdict["reason"]
    assert f"its soak failed at request {expected} of 40" in proc.stdout + proc.stderr  # the console line
    profiles = (run_dir / "profiles.json").read_text()
    assert f"failed at request {expected}" in profiles
    assert (run_dir / "plots" / "c-soak.png").stat().st_size > 10_000


@pytest.mark.timeout(180)
def test_a_ctrl_c_during_a_soak_request_and_a_resume_send_only_the_rest(tmp_path: Path) -> None:
    hold = tmp_path / "holding"
    results = tmp_path / "r"
    m = matrix(tmp_path, leak=0, requests=12, hold=str(hold))
    run = subprocess.Popen(runner(str(m), "--results", str(results)), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not hold.exists():  # the soak's 5th request is in flight, and will stay so
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
            time.sleep(0.05)
        os.kill(run.pid, signal.SIGINT)
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 130, err[-3000:]
    (run_dir,) = results.glob("soak-*")
    assert [r["number"] for r in soak_requests(run_dir)] == [1, 2, 3, 4]  # the request in flight is not recorded
    proc = subprocess.run(runner(str(m), "--resume", str(run_dir)), capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = soak_requests(run_dir)
    assert [r["number"] for r in done] == list(range(1, 13)) and all(r["failure"] is None for r in done)
    # the resumed start served exactly the rest: requests 5..12, on a fresh server start
    logs = sorted((run_dir / "c" / "default" / "soak").glob("server.*.log"))
    assert len(logs) == 2 and logs[-1].read_text().count(": served,") == 8
    report = (run_dir / "report.md").read_text()
    assert "held 12 request" in report or "held all 12" in report or "12 of 12" in report, report[-3000:]
