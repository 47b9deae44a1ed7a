"""Everything a run will use, checked before the first server starts: one UserError line (exit 2) naming
what is wrong, and nothing started or written when it is.

- reference images and baseline images: regular files of bounded size whose header names a bounded pixel
  count (read before any decoder allocates), and which then decode;
- the baseline's samples.json: well-formed, finite numbers;
- the results folder: a writable folder (or creatable under one) with room left;
- every flag of a flag set whose server runs a named vLLM-Omni release: a flag of that release, and no
  typographic, single-dash or dashless look-alike of one (cli_flags; a fork's, which names no release, are
  checked against its own --help once the hosts are reached: runner.run.flag_help, from runner.app);
- env values that reference the runner's environment ("${VAR}"): the variable is set;
- what each backend checks itself (runner.core.registry: local servers on a fixed port: the port is free, and no
  two lanes start that server at the same time).
"""

from __future__ import annotations

import math
import os
import shutil
import stat
import tempfile
import warnings
from pathlib import Path

from PIL import Image

from runner.core.errors import UserError
from runner.core.registry import BACKENDS, load
from runner.core.secrets import missing_refs
from runner.plan import baseline, cli_flags
from runner.plan.lanes import Plan
from runner.plan.matrix import Matrix

MAX_IMAGE_BYTES = 64 * 2**20
MAX_IMAGE_SIDE = 16384
MAX_IMAGE_PIXELS = 50_000_000  # ~200 MB decoded as RGBA
MAX_SAMPLES_BYTES = 16 * 2**20
MIN_FREE_BYTES = 64 * 2**20  # below this a run cannot hold its images and logs


def check(matrix: Matrix, plan: Plan, results: Path, *, resume: bool = False) -> None:
    """Raise UserError (one line) for the first problem found; return when the run may start."""
    cli_flags.check(matrix)
    for fx in matrix.axes.fixtures:
        for i, path in enumerate(matrix.fixtures[fx].references[: matrix.most_references]):
            check_image(path, f"{matrix.path}: key 'fixtures.{fx}.references[{i}]'")
    if matrix.baseline and matrix.baseline.directory is not None:
        check_baseline(matrix.baseline.directory)
    check_results(results, resume=resume)
    check_env(matrix, plan)
    check_backends(matrix, plan)


def _regular_file(path: Path, where: str, limit: int) -> int:
    try:
        st = path.stat()
    except OSError as exc:
        raise UserError(f"{where}: {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):  # a FIFO would block, /dev/zero would never end
        raise UserError(f"{where}: {path} is not a regular file")
    if st.st_size == 0:
        raise UserError(f"{where}: {path} is empty (0 bytes)")
    if st.st_size > limit:
        raise UserError(f"{where}: {path} is {st.st_size / 2**20:.0f} MiB (at most {limit // 2**20} MiB)")
    return st.st_size


def check_image(path: Path, where: str) -> None:
    """A bounded, decodable image. The header is read first; only a bounded size reaches the decoder."""
    _regular_file(path, where, MAX_IMAGE_BYTES)
    try:
        with warnings.catch_warnings():  # the caps below decide, in their own words; PIL's warning is noise
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as image:  # reads the header only
                w, h = image.size
                if w <= 0 or h <= 0 or max(w, h) > MAX_IMAGE_SIDE or w * h > MAX_IMAGE_PIXELS:
                    raise UserError(f"{where}: {path} says it is {w}x{h} pixels (at most {MAX_IMAGE_SIDE} "
                                    f"per side and {MAX_IMAGE_PIXELS // 1_000_000} megapixels)")
                image.load()
    except UserError:
        raise
    except Image.DecompressionBombError as exc:  # PIL refuses past twice its warning size, at the header
        raise UserError(f"{where}: {path} is too large to decode: {exc}") from None
    except Exception as exc:  # any decoder failure (PIL raises many kinds) is the same user error
        raise UserError(f"{where}: {path} is not a decodable image ({type(exc).__name__}: "
                        f"{str(exc)[:120]})") from None


def check_baseline(directory: Path) -> None:
    samples_path = directory / "samples.json"
    _regular_file(samples_path, f"{samples_path}", MAX_SAMPLES_BYTES)
    samples = baseline.load_samples(directory)
    if not samples:
        raise UserError(f"{samples_path}: key 'samples' is empty: nothing to score against")
    for i, s in enumerate(samples):
        where = f"{samples_path}: key 'samples[{i}]"
        if s.references is not None and (isinstance(s.references, bool) or not isinstance(s.references, int)
                                         or s.references < 0):
            raise UserError(f"{where}.references' must be a count >= 0, got {s.references!r}"[:300])
        if s.wall_s is not None and (isinstance(s.wall_s, bool) or not isinstance(s.wall_s, (int, float))
                                     or not math.isfinite(s.wall_s) or s.wall_s <= 0):
            raise UserError(f"{where}.wall_s' must be a finite number of seconds > 0, got {s.wall_s!r}"[:300])
        check_image(s.file, f"{where}.file'")


def check_results(results: Path, *, resume: bool) -> None:
    """The run folder's parent (or, on resume, the run folder) takes files: probed with a temp file that is
    removed at once, so nothing is left behind when the check fails or passes."""
    target = results
    existing = target
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise UserError(f"results folder {target}: {existing} is not a folder")
    if not resume and target.exists() and not target.is_dir():
        raise UserError(f"results folder {target} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".runner-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UserError(f"results folder {target}: cannot write in {existing}: {exc.strerror}") from None
    free = shutil.disk_usage(existing).free
    if free < MIN_FREE_BYTES:
        raise UserError(f"results folder {target}: only {free / 2**20:.1f} MiB free on its disk "
                        f"(at least {MIN_FREE_BYTES // 2**20} MiB needed)")


def check_env(matrix: Matrix, plan: Plan) -> None:
    for session in plan.sessions:
        card, flags = matrix.cards[session.card], matrix.flags[session.flags]
        for where, env in ((f"servers.{card.server}.env", matrix.servers[card.server].env),
                           (f"cards.{card.name}.env", card.env), (f"flags.{flags.name}.env", flags.env)):
            missing = missing_refs(env, os.environ)
            if missing:
                key, name = missing[0]
                raise UserError(f"{matrix.path}: key '{where}.{key}' references ${{{name}}}, which is not set "
                                f"in the runner's environment (export it before the run)")


def check_backends(matrix: Matrix, plan: Plan) -> None:
    """Each backend the plan uses checks what it needs (its registry entry's `preflight`): e.g. the local
    backend's fixed ports are free and not shared by two lanes."""
    for backend in dict.fromkeys(s.server.backend for s in plan.sessions if s.server is not None):
        entry = BACKENDS.get(backend)
        if entry.preflight is not None:
            load(entry.preflight)(matrix, plan)
