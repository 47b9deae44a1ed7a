"""Shared fixtures: a small valid matrix on disk that tests mutate to probe validation."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image


def write_png(path: Path, seed: int, size: tuple[int, int] = (64, 48)) -> Path:
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0 : size[1], 0 : size[0]]
    base = np.stack([xs * 3 + seed * 40, ys * 4 + seed * 10, (xs + ys) * 2], axis=-1) % 256
    noise = rng.integers(0, 20, size=(size[1], size[0], 3))
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(((base + noise) % 256).astype(np.uint8)).save(path)
    return path


MINIMAL = """
[run]
name = "t"
seeds = [1, 2]
steps = 4
size = "64x64"

[servers.ref]
command = ["{python}", "-m", "runner.refserver", "--port", "{port}", "--vram-gib", "{vram_gib}"]

[cards.small]
server = "ref"
vram_gib = 0.5

[flags.default]
role = "default"

[flags.host-cache]
role = "offload"
args = ["--cond-cache", "host"]

[fixtures.pair]
prompt = "a cat on a sofa"
references = ["refs/a.png", "refs/b.png"]

[matrix]
references = [1, 2]
"""


@pytest.fixture
def matrix_dir(tmp_path: Path) -> Path:
    write_png(tmp_path / "refs" / "a.png", 1)
    write_png(tmp_path / "refs" / "b.png", 2)
    (tmp_path / "matrix.toml").write_text(textwrap.dedent(MINIMAL))
    return tmp_path
