"""Baseline images to score against: a sealed directory (samples.json: fixture + references + seed → file,
like the seed's Diffusers attempt) or a cell of this same run (CARD/FLAGS, same references and seed)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.errors import UserError


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
    return (exact or loose or [None])[0]
