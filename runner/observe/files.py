"""A file of a run folder read as untrusted: only a regular file, opened without blocking, read up to a cap.

Anything may stand where a record, a memory.csv or a plot should be (an edit, a copied or crafted folder). A FIFO
blocks an ordinary open until a writer comes, which may be never (`runner report` and `--resume` hung on one,
issue 46 D-2); a device never ends (/dev/zero). So the file is opened with O_NONBLOCK (a FIFO opens at once),
checked on the open descriptor itself (no window between a check and the open), and refused in words unless it
is a regular file; the read stops one byte past the caller's cap.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
         (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class NotRead(ValueError):
    """Why a file was not read, in words fit for one line (`str(exc)`)."""


def kind(mode: int) -> str:
    """What a file that is not a regular one is, in words."""
    return next((name for test, name in KINDS if test(mode)), "not a plain file")


def open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading when it is a regular file (links followed), else NotRead; never blocks."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise NotRead(exc.strerror or str(exc)) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRead(f"not a regular file ({kind(mode)})")
        os.set_blocking(fd, True)  # a regular file: reads as usual from here
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes, else NotRead saying why."""
    with open_regular(path) as f:
        try:
            data = f.read(limit + 1)
        except OSError as exc:
            raise NotRead(exc.strerror or str(exc)) from None
    if len(data) > limit:
        raise NotRead(f"larger than {limit} bytes")
    return data
