"""A reference image too large to decode stops the run before anything starts, from its header alone: one line
naming the file and the key, nothing decoded, no library warning on the console."""

from __future__ import annotations

import re
import struct
import subprocess
import sys
import warnings
import zlib
from pathlib import Path

import pytest
from PIL import Image

from runner.core.errors import UserError
from runner.plan.preflight import check_image


def header_only_png(path: Path, width: int, height: int) -> Path:
    """A PNG whose header declares width x height; one empty row follows, so nothing here can be decoded whole."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 9))
                     + chunk(b"IEND", b""))
    return path


@pytest.mark.parametrize(("size", "words"), [
    ((16385, 8), "says it is 16385x8 pixels (at most 16384 per side and 50 megapixels)"),
    ((12000, 12000), "says it is 12000x12000 pixels"),  # past PIL's warning (89 Mpx): the cap's words, not PIL's
    ((20000, 20000), "is too large to decode"),  # past PIL's error (179 Mpx): refused by PIL at the header
])
def test_an_oversized_reference_is_refused_from_its_header(tmp_path: Path, size: tuple[int, int],
                                                           words: str) -> None:
    path = header_only_png(tmp_path / "big.png", *size)
    with warnings.catch_warnings():
        # `runner` ignores PIL's warning for the whole run (cli.cmd_run): the refusal must not depend on it
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with pytest.raises(UserError, match=re.escape(words)) as caught:
            check_image(path, "m.toml: key 'fixtures.f.references[0]'")
    assert str(caught.value).startswith(f"m.toml: key 'fixtures.f.references[0]': {path}")


def test_the_run_stops_in_one_line_before_any_server_starts(matrix_dir: Path) -> None:
    big = header_only_png(matrix_dir / "refs" / "b.png", 12000, 12000)  # the minimal matrix's second reference
    matrix = matrix_dir / "matrix.toml"
    proc = subprocess.run([sys.executable, "-m", "runner", str(matrix), "--no-progress"], capture_output=True,
                          text=True, timeout=120, cwd=matrix_dir)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"runner: error: {matrix}: key 'fixtures.pair.references[1]': {big.resolve()} says it is 12000x12000 pixels "
        "(at most 16384 per side and 50 megapixels)"], proc.stderr
    assert not (matrix_dir / "results").exists()
