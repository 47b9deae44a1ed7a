"""Against a double of today's vLLM-Omni chat contract (`runner refserver --api 0.32`: metrics only when a
request asks with return_stage_metrics; a variant that answers 0.0, as vLLM-Omni does when its worker measured
nothing): the server's own peak is recorded from metrics.peak_memory_mb on every served step, with its stage
durations, and a 0.0 is never recorded as a 0-byte peak: the step's figure falls back to the next source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_run import matrix, no_server_left, run

pytestmark = pytest.mark.slow


def test_todays_chat_contract_peaks_and_a_zero_is_no_peak(tmp_path: Path) -> None:
    path = matrix(tmp_path, """
        [cards.c]
        server = "ref"
        vram_mib = 64
        meters = ["server"]

        [flags.default]
        role = "default"
        args = ["--api", "0.32", "--log-stats"]

        [flags.zero]
        role = "other"
        # scraped: each response waits for the server meter's poll, so its window holds a reading at any load
        # (a 128x128 request is shorter than the meter's 50 ms period on a fast hour: b0, 2026-12-04)
        args = ["--api", "0.32", "--log-stats", "--fault", "zero-peak", "--fault", "scraped"]

        [matrix]
        references = [1, 2]
        """, seeds="[1, 2]")
    proc, run_dir = run(path)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    served = [json.loads(p.read_text()) for p in sorted(run_dir.glob("c/default/refs-*/*.json"))]
    assert len(served) == 4 and all(s["status"] == "ok" for s in served)
    for s in served:  # asked, so answered: the peak from metrics.peak_memory_mb, first of the step's peaks
        assert s["server_peak_source"] == "metrics.peak_memory_mb" and s["server_peak_mib"] > 0
        assert s["server_peak_measures"] == "reserved"
        assert s["peaks"][0]["source"] == "server-response" and s["peaks"][0]["available"]
        assert s["peaks"][0]["bytes"] == int(s["server_peak_mib"] * 2**20)
        assert s["server_stage_durations_s"]["diffusion"] > 0
    zero = [json.loads(p.read_text()) for p in sorted(run_dir.glob("c/zero/refs-*/*.json"))]
    assert len(zero) == 4 and all(s["status"] == "ok" for s in zero)
    for s in zero:  # 0.0 = not measured: no server peak, never 0 bytes
        assert s["server_peak_mib"] is None and s["server_peak_source"] is None
        assert s["server_stage_durations_s"]["diffusion"] > 0  # the request did run
        by_source = {p["source"]: p for p in s["peaks"]}
        response = by_source["server-response"]
        assert not response["available"] and response["bytes"] is None
        assert response["reason"] == "unavailable: metrics.peak_memory_mb: the server reported 0.0 (not measured)"
        # the step's figure falls back to the next source: the server meter's sampled device gauge
        first_available = next(p for p in s["peaks"] if p["available"])
        assert first_available["source"] == "server" and first_available["bytes"] > 0
        assert all(p["bytes"] != 0 for p in s["peaks"])
    assert "not scraped twice" not in (run_dir / "c/zero/server.log").read_text()  # each wait was met
    no_server_left(run_dir)
