"""`runner meter`: peak-since-last-read over real HTTP on 127.0.0.1, the SidecarMeter client, the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from runner.meters.gpu import GpuProcess, ManualSource
from runner.meters.sidecar import Sidecar
from runner.meters.sidecar_meter import SidecarMeter

GIB = 1 << 30


def wait_reads(source: ManualSource, n: int = 3) -> None:
    """Until the sampler has read the current value at least n more times."""
    target = source.reads + n
    deadline = time.monotonic() + 5
    while source.reads < target and time.monotonic() < deadline:
        time.sleep(0.002)


def test_peak_since_last_read_and_reset() -> None:
    source = ManualSource(used=1 * GIB, reserved=615 << 20)
    sidecar = Sidecar(source, hz=500).start()
    try:
        get = lambda path: httpx.get(sidecar.url + path, timeout=5).json()  # noqa: E731
        get("/peak?reader=a")  # opens reader a's window
        wait_reads(source)
        source.set(5 * GIB)
        wait_reads(source)  # a spike of a few ms, between two polls
        source.set(2 * GIB)
        wait_reads(source)
        first = get("/peak?reader=a")
        assert first["used_bytes"] == 5 * GIB and first["reserved_bytes"] == 615 << 20
        assert first["samples"] >= 9 and first["since"] < first["t_max"] <= first["until"]
        wait_reads(source)
        second = get("/peak?reader=a")  # reset: the spike is not reported twice
        assert second["used_bytes"] == 2 * GIB and second["since"] == first["until"]
        # another reader's window is its own: b never read, so it starts with the newest sample only
        assert get("/peak?reader=b")["used_bytes"] == 2 * GIB
        now = get("/now")
        assert now["used_bytes"] == 2 * GIB and now["total_bytes"] == 80 * GIB
        info = get("/info")
        assert info["target_hz"] == 500 and info["achieved_hz"] > 100 and info["gpu"]["uuid"].startswith("GPU-")
        source.procs = (GpuProcess(4242, 3 * GIB, "compute", "python3"),)
        idle = get("/idle")
        assert idle["available"] and idle["foreign_processes"][0]["pid"] == 4242
        text = httpx.get(sidecar.url + "/metrics", timeout=5).text
        names = {f.name for f in text_string_to_metric_families(text)}
        assert {"runner_sidecar_memory_used_bytes", "runner_sidecar_memory_used_max_bytes"} <= names
    finally:
        sidecar.stop()


def test_sidecar_meter_catches_spike_between_polls_and_outage() -> None:
    source = ManualSource(used=1 * GIB)
    sidecar = Sidecar(source, hz=500).start()
    meter = SidecarMeter(sidecar.url, poll_hz=2.0)
    meter.start()
    t0 = time.time()
    wait_reads(source, 5)
    source.set(9 * GIB)
    wait_reads(source, 3)  # ~6 ms, far shorter than the 500 ms poll period
    source.set(1 * GIB)
    wait_reads(source, 5)
    t1 = time.time()
    peak = meter.window_peak(t0, t1)  # polls once more: the window ends after the newest poll
    assert peak.available and peak.bytes == 9 * GIB and peak.samples >= 10 and peak.reason is None
    time.sleep(0.05)
    t2 = time.time()
    after = meter.window_peak(t2, time.time() + 0.01)
    assert after.bytes == 1 * GIB  # the spike was read and reset, not reported again
    sidecar.stop()  # the GPU host goes away mid-session
    t_gone = time.time()
    time.sleep(1.2)
    t3 = time.time()
    gone = meter.window_peak(t_gone + 0.05, t3)
    assert not gone.available and gone.bytes is None and "ConnectError" in gone.reason
    whole = meter.window_peak(t0, t3)
    assert whole.available and whole.bytes == 9 * GIB and whole.reason.startswith("partial")
    meter.stop()
    prov = meter.provenance()
    assert prov["errors"] >= 1 and prov["outages"] and prov["target_hz"] == 500
    assert prov["clock_offset_s"] is not None and abs(prov["clock_offset_s"]) < 0.5


def test_cli_replay_over_http(tmp_path: Path) -> None:
    replay = tmp_path / "series.txt"
    # The 50 ms step comes 1.5 s after the replay starts: the first /peak (which opens the window) must come
    # before it, and on a loaded machine the CLI's first answer can take a good part of a second.
    replay.write_text("# offset_s used reserved\n0 1000 615\n1.5 7000 615\n1.55 2000 615\n")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "runner", "meter", "--port", "0", "--hz", "400",
                             "--fake-replay", str(replay)], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    try:
        line = proc.stdout.readline()
        assert "serving http://127.0.0.1:" in line, proc.stderr.read() if proc.poll() is not None else line
        url = line.split("serving ", 1)[1].split()[0]
        first = httpx.get(url + "/peak", timeout=5).json()  # opens the default reader's window
        assert first["used_bytes"] in (None, 1000), f"the window opened after the step began: {first}"
        deadline = time.monotonic() + 10  # the replay is past the step once /now reads its last value
        while httpx.get(url + "/now", timeout=5).json()["used_bytes"] != 2000 and time.monotonic() < deadline:
            time.sleep(0.05)
        peak = httpx.get(url + "/peak", timeout=5).json()
        assert peak["used_bytes"] == 7000 and peak["reserved_bytes"] == 615  # a 50 ms step, caught
        assert httpx.get(url + "/now", timeout=5).json()["used_bytes"] == 2000
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
