"""Every registry entry has its implementation, and matrix errors name the registry."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.core.registry import BACKENDS, DIALECTS, METERS, load
from runner.plan import matrix
from runner.run import dialects


@pytest.mark.parametrize("dialect", DIALECTS.names())
def test_each_dialect_builds_and_parses(dialect: str) -> None:
    req = dialects.ImageRequest(model="m", prompt="p", references=(), seed=1, steps=2, size=(64, 64))
    call = dialects.build(dialect, req)
    assert call.path.startswith("/v1/")
    assert dialects.parse(dialect, b"{}").image is None  # a reply without an image is a problem, not a crash


def test_every_factory_and_hook_named_by_an_entry_exists() -> None:
    for m in METERS.entries():
        for target in (m.factory, m.idle):
            if target is not None:
                assert callable(load(target)), (m.name, target)
    for b in BACKENDS.entries():
        for target in (b.factory, b.reap, b.preflight):
            if target is not None:
                assert callable(load(target)), (b.name, target)
    for d in DIALECTS.entries():
        assert callable(load(d.build)) and callable(load(d.images)), d.name


def test_an_unknown_dialect_names_the_registry(matrix_dir: Path) -> None:
    path = matrix_dir / "matrix.toml"
    path.write_text(path.read_text().replace('[servers.ref]\n', '[servers.ref]\ndialect = "grpc"\n'))
    with pytest.raises(matrix.UserError) as err:
        matrix.load_matrix(path)
    assert all(d in str(err.value) for d in DIALECTS.names())
