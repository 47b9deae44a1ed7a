"""A plot is drawn again only when what it draws changed.

Drawing is most of what `runner report` costs (about 0.1 s of CPU a plot: a 100-session run has 137), and a
resume that sends one step changes one card's plots and one session's, not the others (issue 46 X-1). So each
plot carries the digest of its inputs inside its own PNG (a tEXt chunk, written with the image in the same
atomic write: the two can never disagree), and the report reads it back before drawing: the same digest, the
plot on disk is the one these inputs draw. The digest covers the figure's arguments as plain data, the drawing
code (runner/present/plots.py as a file) and matplotlib's version, so a changed plot style redraws everything.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib.util
import json
import math
import struct
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from runner.observe.server_file import NotRead, open_regular

KEY = "runner-inputs"  # the tEXt keyword of the digest in a plot's PNG
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
HEAD_BYTES = 64 * 1024  # a plot's text chunks come before its image data, within its first few hundred bytes


def plain(value: Any) -> Any:
    """`value` as JSON-able data that is the same for the same content in every process (sets sorted, floats
    that JSON lacks spelled out); what has no such form gives its type and repr (a digest that then changes
    every time only costs a redraw)."""
    if isinstance(value, BaseModel):  # pydantic's own JSON: fields in declaration order, and fast
        return [type(value).__qualname__, value.model_dump_json()]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if isinstance(value, Mapping):
        return [[plain(k), plain(v)] for k, v in value.items()]
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted((plain(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is None or isinstance(value, str | int | float):
        return value
    if isinstance(value, Path):
        return str(value)
    return [type(value).__qualname__, repr(value)]


@functools.cache
def _drawing_code() -> str:
    """What draws the plots: plots.py's bytes and matplotlib's version (read, not imported)."""
    spec = importlib.util.find_spec("runner.present.plots")
    source = Path(spec.origin).read_bytes() if spec and spec.origin else b""
    try:
        version = metadata.version("matplotlib")
    except metadata.PackageNotFoundError:
        version = "?"
    return hashlib.sha256(source + version.encode()).hexdigest()


def digest(figure: str, *inputs: Any) -> str:
    """The digest a plot drawn by `figure` from `inputs` carries."""
    text = json.dumps([figure, _drawing_code(), plain(inputs)], separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def text_chunk(head: bytes, keyword: str) -> str | None:
    """The value of the PNG tEXt chunk `keyword` among the chunks before the image data in `head`, or None (not a
    PNG, no such chunk, cut short)."""
    if not head.startswith(PNG_SIGNATURE):
        return None
    at, key = len(PNG_SIGNATURE), keyword.encode("latin-1") + b"\0"
    while at + 8 <= len(head):
        length, kind = struct.unpack(">I4s", head[at:at + 8])
        data = head[at + 8:at + 8 + length]
        if kind == b"IDAT" or len(data) < length:
            return None
        if kind == b"tEXt" and data.startswith(key):
            return data[len(key):].decode("latin-1")
        at += 12 + length  # length, type, data, CRC
    return None


def drawn_digest(image: Path) -> str | None:
    """The digest the plot at `image` was drawn with; None when there is none to read (no file, not a regular
    file, not a plot this runner drew)."""
    try:
        with open_regular(image) as f:
            return text_chunk(f.read(HEAD_BYTES), KEY)
    except (NotRead, OSError):
        return None
