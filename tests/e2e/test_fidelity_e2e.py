"""vLLM-Omni 0.30 behaviour end to end: the runner against the reference server in today's shape
(subprocesses on 127.0.0.1). A corrupt third reference is served by the server with HTTP 200 and two
references; the runner must record the step failed (references dropped), never served at 3."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REFS = [ROOT / "examples" / "refs" / f"ref-{i}.png" for i in range(1, 5)]

pytestmark = pytest.mark.slow


def test_corrupt_third_reference_is_failed_not_served_and_peaks_carry_their_source(tmp_path: Path) -> None:
    # The runner's preflight refuses a reference file that does not decode, so the third reference is
    # corrupted on arrival at the server (fault corrupt-ref=3) in the flag set "damaged": the server drops
    # it with vLLM-Omni 0.30's warning and answers 200 with an image made from two.
    refs = json.dumps([str(p) for p in REFS[:3]])
    path = tmp_path / "m.toml"
    path.write_text(textwrap.dedent(f"""
        [run]
        name = "fidelity"
        seeds = [1]
        steps = 2
        size = "128x128"
        true_cfg_scale = 4.0
        negative_prompt = " "
        request_timeout_s = 60
        ready_timeout_s = 120
        results_dir = "{tmp_path / 'results'}"
        determinism_check = false

        [servers.omni]
        command = ["{{python}}", "-m", "runner.refserver", "tiny", "--omni", "--port", "{{port}}",
                   "--served-model-name", "{{model}}", "--vram-gib", "{{vram_gib}}", "--log-stats"]
        model = "qwen-image"

        [cards.roomy]
        server = "omni"
        vram_gib = 1

        [flags.default]
        role = "default"

        [flags.damaged]
        role = "other"
        args = ["--fault", "corrupt-ref=3"]

        [fixtures.shapes]
        prompt = "shapes on a table"
        references = {refs}

        [matrix]
        references = [2, 3]
        """))
    proc = subprocess.run([sys.executable, "-m", "runner", str(path), "--no-progress"], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "results").glob("fidelity-*")

    def step(key: str) -> dict:
        return json.loads((run_dir / f"roomy/{key}.json").read_text())

    dropped = step("damaged/refs-3/shapes-seed-1")
    assert dropped["status"] == "failed" and dropped["failure"]["kind"] == "references_dropped"
    assert dropped["failure"]["http_status"] == 200 and "served 2 of 3" in dropped["failure"]["message"]
    assert any("Failed to decode reference image" in e for e in dropped["failure"]["evidence"])
    assert not (run_dir / "roomy/damaged/refs-3/shapes-seed-1.png").exists()
    # with two references nothing is damaged: served
    assert step("damaged/refs-2/shapes-seed-1")["status"] == "ok"
    # every served chat step carries the server's own peak, where it came from and what it measures
    for key in ("default/refs-2/shapes-seed-1", "default/refs-3/shapes-seed-1", "damaged/refs-2/shapes-seed-1"):
        s = step(key)
        assert s["status"] == "ok"
        assert s["server_peak_mib"] > 0
        assert s["server_peak_source"] == "metrics.peak_memory_mb"  # the refserver's default: today's, asked
        assert s["server_peak_measures"] == "reserved"
        assert s["peaks"][0]["source"] == "server-response"
    assert step("default/refs-3/shapes-seed-1")["server_peak_mib"] > \
        step("default/refs-2/shapes-seed-1")["server_peak_mib"]


def test_seed_emulated_keeps_matrix_toml_flags_axes_seeds_and_rules() -> None:
    from runner.plan.matrix import load_matrix

    seed = load_matrix(ROOT / "matrix.toml", check_files=False)
    emu = load_matrix(ROOT / "examples" / "seed-emulated.toml")
    assert {n: (f.role, f.args, dict(f.env)) for n, f in emu.flags.items()} == \
        {n: (f.role, f.args, dict(f.env)) for n, f in seed.flags.items()}
    assert emu.run.seeds == seed.run.seeds and emu.run.steps == seed.run.steps
    assert (emu.run.true_cfg_scale, emu.run.negative_prompt) == (seed.run.true_cfg_scale, seed.run.negative_prompt)
    assert emu.verdict == seed.verdict
    assert list(emu.cards) == list(seed.cards)
    plan = subprocess.run([sys.executable, "-m", "runner", "plan", str(ROOT / "examples" / "seed-emulated.toml")],
                          capture_output=True, text=True, timeout=60)
    assert plan.returncode == 0, plan.stderr
    for flags in ("--enable-cpu-offload --enable-layerwise-offload", "--enable-cpu-offload --quantization fp8",
                  "--quantization int8", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"):
        assert flags in plan.stdout
    assert plan.stdout.count("session rtx") == 12
    h200 = load_matrix(ROOT / "examples" / "seed-emulated-h200.toml")  # the device's variant of the same
    assert {n: (f.role, f.args, dict(f.env)) for n, f in h200.flags.items()} == \
        {n: (f.role, f.args, dict(f.env)) for n, f in seed.flags.items()}
    # to fit one device call it sends the first two of the seed's seeds and runs the 5080 first (issues 19, 21)
    assert h200.run.seeds == seed.run.seeds[:2] and h200.verdict == seed.verdict
    assert set(h200.cards) == set(seed.cards)
    assert {c: h200.cards[c].vram_gib for c in h200.cards} == {"rtx3090": 24, "rtx5080": 16}
