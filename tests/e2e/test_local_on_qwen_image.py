"""The embedded default (examples/local.toml) on the real Qwen-Image transformer architecture (`runner refserver
--arch qwen-image`, diffusers' QwenImageTransformer2DModel): the three worlds, OOM sites in diffusers' code, and
the runner's per-reference cost against the accounted growth measured in process. Reads the shared run
(tests/conftest.py)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import ExampleRun, needs_diffusers

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "local.toml"

pytestmark = [pytest.mark.slow, needs_diffusers]  # these tests only read the shared run's files


@pytest.fixture
def run_dir(local_example: ExampleRun) -> Path:
    return local_example.run_dir


def verdicts(run_dir: Path) -> dict[str, dict]:
    return {v["card"]: v for v in json.loads((run_dir / "verdict.json").read_text())["verdicts"]}


def test_the_three_worlds_on_diffusers_with_its_sites(run_dir: Path) -> None:
    by_card = verdicts(run_dir)
    assert {c: v["world"] for c, v in by_card.items()} == {"cpu-roomy": "fits-resident",
                                                           "cpu-tight": "offload-works", "cpu-tiny": "not-built"}
    sites = by_card["cpu-tiny"]["findings"]["contribution_sites"]
    assert sites and all(s["site"].startswith("diffusers/models/") for s in sites), sites
    tight = by_card["cpu-tight"]["findings"]["flag_sets"]["default"]["memory"]["oom"]
    assert tight["references"] == 3 and tight["site"].startswith("diffusers/models/"), tight
    report = (run_dir / "report.md").read_text()
    assert "`QwenImageTransformer2DModel`" in report and "random weights" in report


def test_the_runners_per_reference_cost_is_the_accounted_growth(run_dir: Path) -> None:
    """The slope the runner fits to the server's reported peaks (cpu-roomy, default) against the ledger's own peaks
    for the same requests in this process: within 10 %."""
    from runner.refserver.cli import build_parser, config_from_args
    from runner.refserver.engine import GenerationRequest, configure_torch
    from runner.refserver.qwen_image.engine import QwenEngine

    measured = verdicts(run_dir)["cpu-roomy"]["findings"]["flag_sets"]["default"]["memory"]["per_reference_bytes"]
    matrix = tomllib.loads(json.loads((run_dir / "run.json").read_text())["matrix"]["text"])  # as it was run
    run, fixture = matrix["run"], matrix["fixtures"]["shapes"]
    config = config_from_args(build_parser().parse_args(["--arch", "qwen-image", "--preset", "tiny"]))
    configure_torch(config)
    engine = QwenEngine(config)
    refs = tuple(Image.open(EXAMPLE.parent / r) for r in fixture["references"])
    side = int(run["size"].split("x")[0])
    peaks = [engine.generate(GenerationRequest(
        prompt=fixture["prompt"], references=refs[:n], width=side, height=side, steps=run["steps"],
        seed=run["seeds"][0], true_cfg_scale=run["true_cfg_scale"], negative_prompt=run["negative_prompt"]
    )).peak_bytes for n in matrix["matrix"]["references"]]
    accounted = float(np.polyfit(matrix["matrix"]["references"], peaks, 1)[0])
    assert accounted > 0 and abs(measured - accounted) <= 0.1 * accounted, (measured, accounted, peaks)
