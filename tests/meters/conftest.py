"""Fixtures of the meter tests (helpers live in meters_support)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from meters_support import PrometheusServer, ReplayExporter


@pytest.fixture
def replay() -> Iterator[type[ReplayExporter]]:
    made: list[ReplayExporter] = []

    def make(*args: object, **kw: object) -> ReplayExporter:
        e = ReplayExporter(*args, **kw)  # type: ignore[arg-type]
        made.append(e)
        return e

    yield make  # type: ignore[misc]
    for e in made:
        e.stop()


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[type[PrometheusServer]]:
    if shutil.which("prometheus") is None:
        pytest.skip("the prometheus binary is missing (Debian: apt-get install -y prometheus)")
    made: list[PrometheusServer] = []

    def make(targets: list[str], scrape_s: float = 1.0, jobs: dict[str, list[str]] | None = None) -> PrometheusServer:
        p = PrometheusServer(tmp_path, targets, scrape_s, jobs)
        made.append(p)
        return p

    yield make  # type: ignore[misc]
    for p in made:
        p.stop()
