"""Baseline images to score against: a sealed directory (samples.json: fixture + references + seed → file,
like the seed's Diffusers attempt) or a cell of this same run (CARD/FLAGS, same references and seed)."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.core.errors import UserError

if TYPE_CHECKING:
    from runner.plan.matrix import Matrix


@dataclass(frozen=True)
class Sample:
    fixture: str
    references: int | None  # None: any reference count
    seed: int
    file: Path
    wall_s: float | None


def load_samples(directory: Path) -> list[Sample]:
    path = directory / "samples.json"
    try:
        doc: Any = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise UserError(f"{path}: cannot read baseline samples: {exc}") from None
    items = doc.get("samples") if isinstance(doc, dict) else None
    if not isinstance(items, list):
        raise UserError(f"{path}: key 'samples' must be a list of {{fixture, seed, file}} tables")
    samples = []
    for i, item in enumerate(items):
        try:
            sample = Sample(str(item["fixture"]), item.get("references"), int(item["seed"]),
                            directory / item["file"], item.get("wall_s"))
        except (KeyError, TypeError, ValueError, OverflowError):
            raise UserError(f"{path}: key 'samples[{i}]' needs fixture, seed and file, got {item!r}"[:300]) \
                from None
        if not sample.file.is_file():
            raise UserError(f"{path}: key 'samples[{i}].file': baseline image not found: {sample.file}")
        samples.append(sample)
    return samples


def find(samples: list[Sample], fixture: str, references: int, seed: int) -> Sample | None:
    exact = [s for s in samples if s.fixture == fixture and s.seed == seed and s.references == references]
    loose = [s for s in samples if s.fixture == fixture and s.seed == seed and s.references is None]
    return next(iter(exact or loose), None)


def cell_mismatch(matrix: Any, card: str) -> str | None:
    """Why `card`'s images are not comparable with the baseline cell's beyond its flags, or None: the cell's
    card runs a different server (command template, image, served model, or env) — then a low PSNR measures
    two models, not a flag set (the seed-emulated example once scored a 16 GiB preset against a 24 GiB one).
    Placeholders ({port}, {gpu}, {vram_gib}, ...) are the card's own values and not compared."""
    b = matrix.baseline
    if not b or not b.cell or b.cell[0] is None or b.cell[0] == card:
        return None
    base_card, flags = b.cell
    mine, theirs = matrix.cards[card], matrix.cards[base_card]
    a, z = matrix.servers[mine.server], matrix.servers[theirs.server]
    diffs = []
    if a.command != z.command:
        diffs.append(f"command `{_first_difference(a.command, z.command)}` vs "
                     f"`{_first_difference(z.command, a.command)}`")
    if a.model != z.model:
        diffs.append(f"model '{a.model}' vs '{z.model}'")
    if a.image != z.image:
        diffs.append(f"image {a.image or 'none'} vs {z.image or 'none'}")
    env_a, env_z = {**a.env, **mine.env}, {**z.env, **theirs.env}
    changed = sorted(k for k in env_a.keys() | env_z.keys() if env_a.get(k) != env_z.get(k))
    if changed:
        diffs.append("env " + ", ".join(changed))
    if not diffs:
        return None
    return (f"baseline cell {base_card}/{flags} runs another server than {card} (server '{mine.server}' vs "
            f"'{theirs.server}': {'; '.join(diffs)}), not only other flag args: {card}'s PSNR and SSIM compare "
            f"different servers' images, not a flag set's effect")


def _first_difference(mine: tuple[str, ...], theirs: tuple[str, ...]) -> str:
    """The first word of `mine` that differs from `theirs` at the same place (or `mine`'s extra tail)."""
    for i, word in enumerate(mine):
        if i >= len(theirs) or word != theirs[i]:
            return " ".join(mine[max(0, i - 1): i + 2])
    return "(shorter)"


def wall_s(matrix: Matrix) -> float | None:
    """The sealed baseline's mean recorded wall time at the target count (any count when unstated): the
    latency reference when no default serves a common count. Raises UserError for an unreadable baseline."""
    if not (matrix.baseline and matrix.baseline.directory):
        return None
    target = matrix.verdict.target_references
    walls = [s.wall_s for s in load_samples(matrix.baseline.directory) if s.wall_s and s.references in (target, None)]
    return statistics.fmean(walls) if walls else None
