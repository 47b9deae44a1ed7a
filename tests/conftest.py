"""Shared fixtures: a small valid matrix on disk that tests mutate to probe validation, and one run of
examples/local.toml shared by the e2e tests that read it; and the xdist groups that keep the tests sharing one
costly or exclusive thing on one worker."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import resource
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

# pytest rewrites every test module's asserts at import and caches the result beside it, unless bytecode writing
# is off (PYTHONDONTWRITEBYTECODE, as on CI): then each xdist worker rewrote and compiled all ~240 modules again,
# ~8 CPU-s a process, at every run. On here, for the test modules only (the environment, and so every child,
# keeps it off): a second run collects in ~5 CPU-s a process. A fresh clone's first run has no cache to read.
sys.dont_write_bytecode = False


def write_png(path: Path, seed: int, size: tuple[int, int] = (64, 48)) -> Path:
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0 : size[1], 0 : size[0]]
    base = np.stack([xs * 3 + seed * 40, ys * 4 + seed * 10, (xs + ys) * 2], axis=-1) % 256
    noise = rng.integers(0, 20, size=(size[1], size[0], 3))
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(((base + noise) % 256).astype(np.uint8)).save(path)
    return path


MINIMAL = """
[run]
name = "t"
seeds = [1, 2]
steps = 4
size = "64x64"

[servers.ref]
command = ["{python}", "-m", "runner.refserver", "--port", "{port}", "--vram-gib", "{vram_gib}"]

[cards.small]
server = "ref"
vram_gib = 0.5

[flags.default]
role = "default"

[flags.host-cache]
role = "offload"
args = ["--cond-cache", "host"]

[fixtures.pair]
prompt = "a cat on a sofa"
references = ["refs/a.png", "refs/b.png"]

[matrix]
references = [1, 2]
"""


@pytest.fixture
def matrix_dir(tmp_path: Path) -> Path:
    write_png(tmp_path / "refs" / "a.png", 1)
    write_png(tmp_path / "refs" / "b.png", 2)
    (tmp_path / "matrix.toml").write_text(textwrap.dedent(MINIMAL))
    return tmp_path


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# Asked of the installed packages, not imported: every xdist worker collects every module, and importing diffusers
# (and torch) at collection cost each one ~5 CPU-s. The tests that need it import it as they run.
needs_diffusers = pytest.mark.skipif(importlib.util.find_spec("diffusers") is None,
                                     reason="diffusers is missing (the dev extra installs it)")


def example_copy(name: str, folder: Path, verdict: dict[str, str] | None = None,
                 matrix: dict[str, str] | None = None, **run: str) -> Path:
    """examples/NAME written into FOLDER with its [run] keys (and `verdict`'s [verdict] keys, `matrix`'s [matrix]
    keys) set to the given TOML values (added where the file has none) and its refs/ made absolute: the example's
    own cards, servers, flag sets and fixtures, with less work where a test reads something else than the work's
    outcome."""
    text = (EXAMPLES / name).read_text().replace('"refs/', f'"{EXAMPLES}/refs/')
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(with_keys(text, verdict, matrix, **run))
    return path


def with_keys(text: str, verdict: dict[str, str] | None = None, matrix: dict[str, str] | None = None,
              **run: str) -> str:
    """A matrix's TOML text with its [run] keys (and `verdict`'s [verdict] keys, `matrix`'s [matrix] keys) set to
    the given TOML values, added where the text has none."""
    for table, keys in (("run", run), ("verdict", verdict or {}), ("matrix", matrix or {})):
        if f"\n[{table}]\n" not in text:
            text += f"\n[{table}]\n"
        head, body = text.split(f"\n[{table}]\n", 1)
        for key, value in keys.items():
            body, n = re.subn(rf"^{key} = .*$", f"{key} = {value}", body, count=1, flags=re.M)
            body = body if n else f"{key} = {value}\n{body}"
        text = f"{head}\n[{table}]\n{body}"
    return text


@dataclass(frozen=True)
class ExampleRun:
    proc: subprocess.CompletedProcess[str]
    run_dir: Path


# Under pytest-xdist (scripts/test.sh: `-n N --dist loadgroup`) a session fixture is made once per worker, so
# the tests that use a costly one go to one worker and it is made once: the group follows the fixture, not a
# list of files that would go stale. pytest 9.2 drops every group silently (pytest-xdist #1386), hence the
# dev extra's pytest < 9.2.
GROUP_BY_FIXTURE = {
    "local_example": "local-example",  # one run of examples/local.toml (minutes)
    "fleet": "refserver-fleet",  # tests/refserver: eleven reference servers started at once
    "slurm": "slurm",  # the one stand-in node's gres: a second test's job would pend behind the first's
}
# Every docker run reaps the engine's containers whose owner is dead, and tests/docker makes such containers
# on purpose to watch one reap: run side by side, one test's run reaped another's (CI, 2026-12-03).
GROUP_BY_FOLDER = {"tests/docker/": "docker-engine"}


def xdist_group(item: pytest.Item) -> str | None:
    """The named costly fixture's group; else its folder's; else the module's own, when the test uses a
    module-scoped fixture: such a module's tests share (and often build on) its state, so they run in order on
    one worker."""
    names = getattr(item, "fixturenames", ())
    group = next((g for f, g in GROUP_BY_FIXTURE.items() if f in names), None)
    if group is not None:
        return group
    folder = next((g for f, g in GROUP_BY_FOLDER.items() if item.nodeid.startswith(f)), None)
    if folder is not None:
        return folder
    info = getattr(item, "_fixtureinfo", None)  # pytest's record of the item's fixture definitions
    defs = info.name2fixturedefs.values() if info is not None else ()
    if any(d and d[-1].scope == "module" for d in defs):
        return f"module:{item.nodeid.split('::')[0]}"
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's loadgroup reads the marks (it would see none after)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        group = xdist_group(item)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
    # The slow modules first, each kept whole and in file order: xdist hands out the largest groups first and
    # then single tests in this order, so a minute-long test no longer starts last and leaves one worker busy
    # while the others are done (the tail of the 2026-12-04 runs, docs/benchmarks.md).
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


# RUNNER_TEST_CPU_LOG=FILE: one JSON line per test with its wall time, its worker, when it ended (epoch s) and
# the CPU seconds of the worker and of the children it waited for (the runner, servers, ansible-playbook), setup
# included. What it cannot see: containers (dockerd's children) and Slurm steps (slurmd's); docs/benchmarks.md
# compares the sum with the machine's total. The suite's CPU, not its wall time, is the floor on two cores.
CPU_LOG = os.environ.get("RUNNER_TEST_CPU_LOG")


def _cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    if not CPU_LOG:
        yield
        return
    cpu, wall = _cpu_s(), time.monotonic()
    yield
    line = {"test": item.nodeid, "wall_s": round(time.monotonic() - wall, 2), "cpu_s": round(_cpu_s() - cpu, 2),
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "ended": round(time.time(), 1)}
    with open(CPU_LOG, "a") as log:  # one short write per line: the workers' lines do not interleave
        log.write(json.dumps(line) + "\n")


@pytest.fixture(scope="session", autouse=True)
def _runner_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The runner's per-user cache (a fork's flags read from its --help, runner.run.flag_help) in a folder of
    this session, not the user's ~/.cache: every runner the tests start inherits it."""
    old = os.environ.get("RUNNER_CACHE_DIR")
    os.environ["RUNNER_CACHE_DIR"] = str(tmp_path_factory.mktemp("runner-cache"))
    yield
    if old is None:
        os.environ.pop("RUNNER_CACHE_DIR", None)
    else:
        os.environ["RUNNER_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def local_example(tmp_path_factory: pytest.TempPathFactory) -> ExampleRun:
    """One run of examples/local.toml (the README's first command's matrix), shared by the tests that only read its
    run folder (tests/e2e/test_examples.py, tests/e2e/test_schemas_e2e.py): each run is minutes here."""
    results = tmp_path_factory.mktemp("local-example")
    # At 4 steps, not the file's 8: the same cells, worlds, OOM sites and findings (a request's peak does not
    # depend on the step count), for three quarters of the CPU (256 against 335 CPU-s alone, docs/benchmarks.md).
    # The file as it stands is the README's first command, run in a fresh clone before every landing.
    # Its latency limit at 10×, not the file's 3×: the worlds these tests read are the memory's (cpu-offload serves
    # 4 references at ~1.25× the default's latency on a quiet machine), while beside the suite's real-server starts
    # the ratio's interval once read 2.00× [0.95–4.20] and left cpu-tight undecided (docs/benchmarks.md,
    # 2026-12-06). Judging latency under load is tests/e2e/test_undecided.py's and test_auto_repeats.py's work.
    example = example_copy("local.toml", results / "matrix", verdict={"max_latency_ratio": "10.0"}, steps="4")
    # 6:37 in CI with four workers on 2 cores (stop 36): the bound is pytest-timeout's, less a margin to say so
    proc = subprocess.run([sys.executable, "-m", "runner", str(example), "--results", str(results), "--no-progress"],
                          capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = results.glob("local-*")
    return ExampleRun(proc, run_dir)
