"""Issue 18 item 15: a runner stopped by SIGSTOP (Ctrl-Z) in the middle of a request and continued later
does not record the pause as the request's wall time: that send is discarded (a resume sends it again)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from processkit import (
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
PAUSE_S = 12


def test_a_sigstop_during_a_request_is_not_a_latency(tmp_path: Path) -> None:
    # Each request takes 2.5-3.5 s, well under request_timeout_s = 8; the pause is longer than both.
    path = matrix(tmp_path, seeds="[1, 2]", server_args=', "--fault", "jitter=2.5:3.5"', request_timeout=8)
    runner = Runner(path)
    assert wait_for(lambda: run_shows(tmp_path, lambda run: records_done(run) >= 1), 180), \
        runner.output[-3000:]
    time.sleep(0.5)  # the second request is in flight (it takes at least 2.5 s)
    os.kill(runner.proc.pid, signal.SIGSTOP)  # the runner only; its server runs on
    time.sleep(PAUSE_S)
    os.kill(runner.proc.pid, signal.SIGCONT)
    code = runner.wait(240)
    run = run_dir(tmp_path)
    docs = [json.loads(p.read_text()) for p in step_files(run)]
    walls = [w for d in docs if d["status"] == "ok" for w in d["wall_samples_s"]]
    assert walls and max(walls) < PAUSE_S, (walls, runner.output[-2000:])  # the pause is no one's latency
    suspended = [d for d in docs if "runner suspended" in (d.get("skip_reason") or "")]
    assert len(suspended) == 1, [(d["key"], d["status"], d.get("skip_reason")) for d in docs]
    assert not any(d["status"] == "failed" for d in docs)  # nor a timeout of the server
    assert code == 1 and "--resume" in runner.output  # a step is left, and the resume command says so
    resumed = Runner(path, "--resume", str(run))
    assert resumed.wait(240) == 0, resumed.output[-3000:]
    assert all(d["status"] == "ok" for d in check_records(run, 4))
    nothing_left(tmp_path)
