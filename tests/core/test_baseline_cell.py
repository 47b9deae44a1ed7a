"""A baseline cell on a card whose server differs in more than flag args is named: then a card's PSNR compares
two servers' images (seed-emulated-h200 once scored a 16 GiB preset against a 24 GiB one: ~9 dB, "not-built by
quality"). The examples' baseline cells now use one server for every card."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from runner.plan.baseline import cell_mismatch
from runner.plan.matrix import load_matrix

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


@pytest.mark.parametrize("name", ["local.toml", "seed-emulated.toml", "seed-emulated-h200.toml", "h200.toml"])
def test_the_examples_score_every_card_against_its_own_server(name: str) -> None:
    m = load_matrix(EXAMPLES / name, check_files=False)
    assert [c for c in m.axes.cards if cell_mismatch(m, c)] == []


def test_the_old_seed_emulated_h200_is_named(tmp_path: Path) -> None:
    old = subprocess.run(["git", "-C", str(ROOT), "show", "09c7220:examples/seed-emulated-h200.toml"],
                         capture_output=True, text=True)
    if old.returncode != 0:
        pytest.skip("the earlier example is not in this clone's history")
    path = tmp_path / "old.toml"
    path.write_text(old.stdout)
    m = load_matrix(path, check_files=False, base=EXAMPLES)
    assert cell_mismatch(m, "rtx3090") is None  # the baseline cell's own card
    note = cell_mismatch(m, "rtx5080")
    assert note is not None
    assert note.startswith("baseline cell rtx3090/layerwise runs another server than rtx5080 (server "
                           "'vllm-omni-16g' vs 'vllm-omni-24g': command `runner.refserver h200-16g --omni` vs "
                           "`runner.refserver h200-24g --omni`)"), note


def test_model_image_and_env_count_flag_args_do_not(matrix_dir: Path) -> None:
    text = (matrix_dir / "matrix.toml").read_text()
    text += """
[servers.other]
command = ["{python}", "-m", "runner.refserver", "--port", "{port}", "--vram-gib", "{vram_gib}"]
model = "another-model"
env = { A = "1" }

[cards.big]
server = "other"
vram_gib = 2

[cards.same]
server = "ref"
vram_gib = 1

[baseline]
cell = "small/default"
"""
    text = text.replace("[matrix]\nreferences = [1, 2]",
                        '[matrix]\nreferences = [1, 2]\ncards = ["small", "big", "same"]')
    (matrix_dir / "matrix.toml").write_text(text)
    m = load_matrix(matrix_dir / "matrix.toml")
    assert cell_mismatch(m, "small") is None and cell_mismatch(m, "same") is None  # vram differs: the card's own
    note = cell_mismatch(m, "big")
    assert note is not None and "command" not in note and "model 'another-model' vs 'ref'" in note and "env A" in note
