"""Every entry of a closed vocabulary has its implementation, and matrix errors name the registry."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner import dialects, matrix
from runner.vocab import Dialect


@pytest.mark.parametrize("dialect", list(Dialect))
def test_each_dialect_builds_and_parses(dialect: Dialect) -> None:
    req = dialects.ImageRequest(model="m", prompt="p", references=(), seed=1, steps=2, size=(64, 64))
    call = dialects.build(dialect, req)
    assert call.path.startswith("/v1/")
    assert dialects.parse(dialect, b"{}").image is None  # a reply without an image is a problem, not a crash


def test_an_unknown_dialect_names_the_registry(matrix_dir: Path) -> None:
    path = matrix_dir / "matrix.toml"
    path.write_text(path.read_text().replace('[servers.ref]\n', '[servers.ref]\ndialect = "grpc"\n'))
    with pytest.raises(matrix.UserError) as err:
        matrix.load_matrix(path)
    assert all(d.value in str(err.value) for d in Dialect)
