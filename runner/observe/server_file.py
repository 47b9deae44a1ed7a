"""A file of a run folder read as untrusted input: what a server wrote there (an allocator snapshot, a profiler
trace), and the runner's own records, memory.csv and plots, which an edit or a crafted folder may have replaced.

A server writes where it likes inside its profiler folder: a symlink to /dev/zero (`stat` says 0 bytes; reading
never ends), to /etc/passwd or to any file the runner can read, a FIFO (`open` blocks until a writer comes), a
directory. A path is therefore opened one component at a time from the real path of the run folder, never
following a link (O_NOFOLLOW: a link anywhere below the run folder is refused) and never blocking (O_NONBLOCK);
what is opened must be a regular file (fstat), and at most `max_bytes` + 1 bytes are read. Each refusal is one
line in our words (NotRead).

The runner's own files (open_regular, read_regular) follow links, since a person may link a record in, but are
still opened without blocking and refused unless regular: a FIFO in a record's place hung `runner report` and
`--resume` (issue 46 D-2).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from runner.observe import quote

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_PLAIN = re.compile(r"[A-Za-z0-9_.+@=,:-]+(?:/[A-Za-z0-9_.+@=,:-]+)*")
CHUNK = 1 << 20


class NotRead(ValueError):
    """The file was not read: one line why (a link, not a regular file, outside the run folder, too large)."""


def kind(mode: int) -> str:
    """A file type in words (what a refused file is)."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def plain_name(relative: str, secrets: Iterable[str] = ()) -> bool:
    """Whether a name a server chose may be kept in a record as it is: plain path characters (no control
    characters, spaces or markup) and none of the server's secrets."""
    return bool(_PLAIN.fullmatch(relative)) and quote.mask(relative, secrets) == relative


def _why(exc: OSError, name: str | None = None, dir_fd: int | None = None) -> str:
    """An open that failed, in words: a link (O_NOFOLLOW's ELOOP, or ENOTDIR for a folder on the way), else the
    system's words."""
    if name is not None and dir_fd is not None and exc.errno in (errno.ELOOP, errno.ENOTDIR):
        try:
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except OSError:
            mode = 0
        if stat.S_ISLNK(mode):
            return "a symbolic link: only a regular file inside the run folder is read, never through a link"
        return f"{kind(mode)} on its way, where a folder or the file should be"
    return exc.strerror or type(exc).__name__


def read(root: Path, relative: str, max_bytes: int) -> bytes:
    """The bytes of root/relative, a regular file reached without a link, at most `max_bytes`; NotRead why not."""
    rel = PurePosixPath(relative)
    if not rel.parts or rel.is_absolute() or any(p in ("..", ".") for p in rel.parts):
        raise NotRead("not a path inside the run folder")
    try:
        fd = os.open(os.path.realpath(root), _DIR)
    except OSError as exc:
        raise NotRead(f"the run folder cannot be opened: {_why(exc)}") from None
    part = rel.parts[0]
    try:
        for part in rel.parts[:-1]:
            inner = os.open(part, _DIR, dir_fd=fd)
            os.close(fd)
            fd = inner
        part = rel.parts[-1]
        file = os.open(part, _FILE, dir_fd=fd)
    except OSError as exc:
        raise NotRead(_why(exc, part, fd)) from None
    finally:
        os.close(fd)
    try:
        info = os.fstat(file)
        if not stat.S_ISREG(info.st_mode):
            raise NotRead(f"{kind(info.st_mode)}, not a regular file")
        if info.st_size > max_bytes:
            raise NotRead(f"too large: {info.st_size} bytes > {max_bytes}")
        chunks, size = [], 0
        while chunk := os.read(file, min(CHUNK, max_bytes + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:  # it grew while read
                raise NotRead(f"too large: more than {max_bytes} bytes")
        return b"".join(chunks)
    except OSError as exc:
        raise NotRead(_why(exc)) from None
    finally:
        os.close(file)


def open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading when it is a regular file (links followed), else NotRead; never blocks. The
    check is on the open descriptor itself, so nothing can be swapped in between."""
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
