"""The run's live exporter over real HTTP on 127.0.0.1: what monitoring/prometheus.yml scrapes."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runner.core.records import Failure, FailureClass, Peak, Status, StepRecord
from runner.present.exporter import RunExporter
from tests.ports import free_port


def test_exporter_serves_step_outcomes_and_live_memory() -> None:
    port = free_port()
    exporter = RunExporter("run-1", port)
    try:
        exporter.lane_started("gpu0", ("c",), 4)
        exporter.session_started("c", "default", 0)
        exporter.memory("c", 5 * 2**30)
        ok = StepRecord(key="c/default/refs-1/f-seed-1", card="c", flags="default", role="default", fixture="f",
                        references=1, seed=1, status=Status.OK, wall_s=2.5,
                        peaks=(Peak(source="nvml", metric="device", bytes=7 * 2**30, samples=500, rate_hz=1000.0,
                                    available=True),))
        exporter.step_done(ok)
        exporter.step_done(StepRecord(key="c/default/refs-2/f-seed-1", card="c", flags="default", role="default",
                                      fixture="f", references=2, seed=1, status=Status.FAILED,
                                      failure=Failure(kind=FailureClass.OOM, message="oom")))
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        exporter.close()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("runner_device_memory_bytes", (("card", "c"), ("run", "run-1")))] == 5 * 2**30
    assert samples[("runner_steps_total", (("card", "c"), ("failure", "oom"), ("flags", "default"),
                                          ("run", "run-1"), ("status", "failed")))] == 1
    assert samples[("runner_step_peak_bytes", (("card", "c"), ("flags", "default"), ("references", "1"),
                                               ("run", "run-1"), ("source", "nvml")))] == 7 * 2**30
    assert samples[("runner_lane_steps_planned", (("lane", "gpu0"), ("run", "run-1")))] == 4
    assert samples[("runner_step_seconds_count", (("card", "c"), ("flags", "default"), ("run", "run-1")))] == 1


def test_live_page_and_json_beside_metrics() -> None:
    """`/` is the page (inline script and style only, the CSP forbids anything else), `/live.json` its data:
    the card's readings in order, its capacity, the step it is on; a server's text in it is inert."""
    port = free_port()
    exporter = RunExporter("run-1", port, capacities={"c": 9 * 2**20})
    try:
        exporter.lane_started("c", ("c",), 3)
        exporter.session_started("c", "default", 0)
        exporter.session_ready("c", "default", None, why="<script>alert(1)</script>\x1b[31m boom")
        for v in (5 * 2**20, 6 * 2**20, None, 7 * 2**20):
            exporter.memory("c", v)
        exporter.step_done(StepRecord(key="c/default/refs-1/f-seed-1", card="c", flags="default", role="default",
                                      fixture="f", references=1, seed=1, status=Status.OK, wall_s=1.5))
        page = httpx.get(f"http://127.0.0.1:{port}/")
        live = httpx.get(f"http://127.0.0.1:{port}/live.json")
        missing = httpx.get(f"http://127.0.0.1:{port}/nothing")
    finally:
        exporter.close()
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert "<script src" not in page.text and "http://" not in page.text.replace("http://www.w3.org/2000/svg", "")
    assert "innerHTML" not in page.text  # server data is only ever set as textContent
    assert missing.status_code == 404
    assert "<" not in live.text and "\x1b" not in live.text
    doc = live.json()
    (card,) = doc["cards"]
    assert card["bytes"] == [5 * 2**20, 6 * 2**20, 7 * 2**20] and card["t"] == sorted(card["t"])
    assert card["capacity_bytes"] == 9 * 2**20
    assert card["step"] == "step 2 of 3 (1 done)"
    assert card["session"].startswith("default: server did not start (<script>") and "\\x1b[31m" in card["session"]
    assert card["last_step"].startswith("c/default/refs-1/f-seed-1: ok 1.50 s")


def test_decimate_keeps_every_peak() -> None:
    from runner.present.livepage import decimate

    points = [(float(t), 100) for t in range(5000)]
    points[1234] = (1234.0, 999)
    out = decimate(points, 600)
    assert len(out) <= 600 and (1234.0, 999) in out and out == sorted(out)
    assert decimate(points[:10], 600) == points[:10]


def test_an_idle_connection_does_not_keep_a_handler_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 46 L-2: connections that send nothing held a handler thread each, forever (181 held 75). Each is
    closed by the exporter after its timeout (a few seconds; half a second here: raising=False, because the
    name is what the fix added and the test must run, and fail, without it), and the page answers meanwhile."""
    from runner.present import exporter as module

    monkeypatch.setattr(module, "HANDLER_TIMEOUT_S", 0.5, raising=False)
    port = free_port()
    threads = threading.active_count()
    exporter = RunExporter("run-1", port)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
    try:
        assert httpx.get(f"http://127.0.0.1:{port}/live.json", timeout=5).status_code == 200
        for conn in idle:
            conn.settimeout(10)  # far past the exporter's timeout: a connection it keeps fails here
            try:
                assert conn.recv(1) == b""  # closed by the exporter
            except TimeoutError:
                pytest.fail("an idle connection was still held after 10 s")
        deadline = time.monotonic() + 5
        while threading.active_count() > threads + 1 and time.monotonic() < deadline:  # + the serving thread
            time.sleep(0.05)
        assert threading.active_count() <= threads + 1, threading.enumerate()
    finally:
        for conn in idle:
            conn.close()
        exporter.close()
