"""Hostile allocator snapshots (issue 46 P-1…P-8), small enough to build in a test (stdlib only: the hostile
profiler server imports this too). Each is a pickle of plain data, as a snapshot is: no global, nothing runs.

Each is a snapshot at an OOM of one live block (`size` bytes) allocated by the request: one segment, the
block's alloc event in the trace, then the oom event; what is hostile is in its frames, its `user_metadata` or
its figures.
"""

from __future__ import annotations

import gzip
import pickle
import struct
import zlib
from typing import Any

TORCH = "/venv/lib/python3.12/site-packages/torch/nn/modules/linear.py"
OWN = "/srv/app/engine.py"
ESCAPES = ("\x1b[2J\x1b[31mred\x1b[0m \x1b]8;;https://evil.example/\x1b\\click\x1b]8;;\x1b\\ "
           "<script>alert(1)</script> [click](javascript:alert(3)) \u202eevil\u202c \x07bell\r\nnext line")
MATHTEXT = r"$\frac{1}{$"  # matplotlib's mathtext: a malformed formula fails the plot that draws it
DEEP = 100_000
MARKER = "@@nested-here@@"


def frame(path: Any, line: Any, name: Any) -> dict[str, Any]:
    return {"filename": path, "line": line, "name": name}


def snapshot(frames: list[Any], *, size: int = 1000, metadata: Any = "", address: int = 0, tried: int = 100
             ) -> dict[str, Any]:
    return {"segments": [{"address": address, "total_size": size, "blocks": [
                {"address": address, "size": size, "requested_size": size, "state": "active_allocated",
                 "frames": frames}]}],
            "device_traces": [[
                {"action": "alloc", "addr": address, "size": size, "time_us": 1, "frames": frames,
                 "user_metadata": metadata},
                {"action": "oom", "size": tried, "time_us": 2, "frames": frames}]]}


def plain() -> bytes:
    """A snapshot nothing is wrong with: 1000 bytes at /srv/app/engine.py:88 in forward."""
    return pickle.dumps(snapshot([frame(TORCH, 134, "forward"), frame(OWN, 88, "forward")]))


def repr_bomb(width: int = 200, depth: int = 5) -> bytes:
    """P-1: lists shared `depth` deep and `width` wide as a frame's filename and name and as the user_metadata:
    ~2 KB whose repr is width**depth zeros (200**5: ~1 TB)."""
    nest: Any = 0
    for _ in range(depth):
        nest = [nest] * width
    return pickle.dumps(snapshot([frame(nest, 1, nest), frame(OWN, 88, "forward")], metadata=nest))


def deep(depth: int = DEEP) -> bytes:
    """P-2: a list nested `depth` deep (`]`×depth) as a frame's filename and as the user_metadata: the pickle is
    written opcode by opcode (pickle.dumps itself would recurse)."""
    data = pickle.dumps(snapshot([frame(MARKER, 1, "forward"), frame(OWN, 88, "forward")], metadata=MARKER),
                        protocol=2)
    encoded = MARKER.encode()
    short = b"X" + struct.pack("<I", len(encoded)) + encoded  # BINUNICODE: the marker's first (memoized) copy
    assert data.count(short) == 1
    return data.replace(short, b"]" * depth + b"a" * (depth - 1))


def huge(**figures: int) -> bytes:
    """P-3: the block's size, address or a frame's line number as given (10**400, 10**5000)."""
    line = figures.get("line", 88)
    return pickle.dumps(snapshot([frame(OWN, line, "forward")], size=figures.get("size", 1000),
                                 address=figures.get("address", 0)))


def none_bomb(mib: int = 255) -> bytes:
    """P-6: {"segments": [], "x": [None × mib MiB]}, gzipped: ~260 KB for 255 MiB of NONE opcodes, under the
    256 MiB cap on the inflated bytes."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    def text(s: str) -> bytes:  # SHORT_BINUNICODE
        return b"\x8c" + bytes([len(s)]) + s.encode()

    head = b"\x80\x04}(" + text("segments") + b"]" + text("x") + b"]("
    parts = [z.compress(head), *(z.compress(b"N" * 2**20) for _ in range(mib)), z.compress(b"eu."), z.flush()]
    return b"".join(parts)


def shared_frames(blocks: int = 200_000, frames: int = 64, chars: int = 700) -> bytes:
    """P-6: `blocks` live blocks sharing one list of `frames` frames of `chars`-character paths, gzipped."""
    shared = [frame(f"/srv/app/{'a' * (chars - 12)}.py", i + 1, "forward") for i in range(frames)]
    snap = {"segments": [{"address": 0, "total_size": blocks * 512, "blocks": [
        {"address": i * 512, "size": 512, "state": "active_allocated", "frames": shared} for i in range(blocks)]}]}
    return gzip.compress(pickle.dumps(snap, protocol=4), compresslevel=1)


def secret(token: str) -> bytes:
    """P-7: the server's resolved secret in the frames' paths and function names and in the user_metadata."""
    return pickle.dumps(snapshot([frame(TORCH, 134, "forward"), frame(f"/home/{token}/app/engine.py", 88,
                                                                       f"load_{token}")],
                                 metadata=f"the server's cache {token}"))


def escapes() -> bytes:
    """P-8: terminal escapes, bidi, markup and a mathtext formula in a frame and the user_metadata; a cyclic
    filename and a frame that is no dict, innermost (each is no frame)."""
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    return pickle.dumps(snapshot([frame(cyclic, 1, "inner"), 42,
                                  frame(f"/srv/app/{ESCAPES}.py", 7, f"fn {MATHTEXT} {ESCAPES}")],
                                 metadata=f"cache {ESCAPES}"))
