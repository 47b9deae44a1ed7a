"""The bad-input corpus: every case ends in exit 2 with exactly one line on stderr, no traceback, no server
started and nothing written (the folder tree is the same before and after).

Cases run `runner.cli.main` in-process (fast); a few also run as a real subprocess to show the same line and
exit code from the command itself.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from runner import backends, cli

Case = Callable[[Path], list[str] | None]  # mutates the matrix folder; may return extra CLI args


def edit(old: str, new: str) -> Case:
    def apply(d: Path) -> None:
        path = d / "matrix.toml"
        text = path.read_text()
        assert old in text, old
        path.write_text(text.replace(old, new, 1))
    return apply


def append(extra: str) -> Case:
    def apply(d: Path) -> None:
        with (d / "matrix.toml").open("a") as f:
            f.write("\n" + extra + "\n")
    return apply


def ref_file(make: Callable[[Path], None]) -> Case:
    """Replace reference image b.png by whatever `make` creates at that path."""
    def apply(d: Path) -> None:
        target = d / "refs" / "b.png"
        target.unlink()
        make(target)
    return apply


def ref_path(path: str) -> Case:
    return edit('"refs/b.png"', json.dumps(path))


def png_header(width: int, height: int) -> bytes:
    """A PNG whose IHDR says width x height, followed by a tiny (wrong) IDAT: only a header to read."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + \
        chunk(b"IEND", b"")


def baseline(samples: object | bytes, *, files: dict[str, bytes | None] | None = None) -> Case:
    """A [baseline] dir with this samples.json (an object is dumped as JSON; bytes are written as is)."""
    def apply(d: Path) -> None:
        folder = d / "base"
        folder.mkdir()
        data = samples if isinstance(samples, bytes) else json.dumps(samples).encode()
        (folder / "samples.json").write_bytes(data)
        for name, content in (files or {}).items():
            if content is None:
                (folder / name).write_bytes((d / "refs" / "a.png").read_bytes())
            else:
                (folder / name).write_bytes(content)
        append('[baseline]\ndir = "base"')(d)
    return apply


def sample(**kw: object) -> dict[str, object]:
    return {"fixture": "pair", "seed": 1, "file": "s.png", **kw}


def fifo(path: Path) -> None:
    os.mkfifo(path)


def results(value: str) -> Case:
    return edit('name = "t"', f'name = "t"\nresults_dir = {json.dumps(value)}')


def seq(*steps: Callable[[Path], object]) -> Case:
    def apply(d: Path) -> None:
        for step in steps:
            step(d)
    return apply


LONG = "x" * 300

CASES: dict[str, Case] = {
    # --- names become paths (item 4) ---
    "card-dot": edit("[cards.small]", '[cards."."]'),
    "card-dotdot": edit("[cards.small]", '[cards.".."]'),
    "card-300-chars": edit("[cards.small]", f"[cards.{LONG}]"),
    "card-slash": edit("[cards.small]", '[cards."a/b"]'),
    "card-empty": edit("[cards.small]", '[cards.""]'),
    "card-leading-dash": edit("[cards.small]", "[cards.-x]"),
    "card-space": edit("[cards.small]", '[cards."a b"]'),
    "card-unicode": edit("[cards.small]", '[cards."kärtchen"]'),
    "flags-dotdot": edit("[flags.default]", '[flags.".."]'),
    "flags-300-chars": edit("[flags.default]", f"[flags.{LONG}]"),
    "fixture-dotdot": edit("[fixtures.pair]", '[fixtures.".."]'),
    "server-dotdot": edit("[servers.ref]\n", '[servers.".."]\n'),
    "run-name-dotdot": edit('name = "t"', 'name = ".."'),
    "run-name-300": edit('name = "t"', f'name = "{LONG}"'),
    # --- finite, bounded numbers (item 9) ---
    "request-timeout-nan": edit("steps = 4", "steps = 4\nrequest_timeout_s = nan"),
    "request-timeout-inf": edit("steps = 4", "steps = 4\nrequest_timeout_s = inf"),
    "ready-timeout-nan": edit("steps = 4", "steps = 4\nready_timeout_s = nan"),
    "ready-timeout-inf": edit("steps = 4", "steps = 4\nready_timeout_s = +inf"),
    "ready-timeout-huge": edit("steps = 4", "steps = 4\nready_timeout_s = 1e300"),
    "sample-hz-nan": edit("steps = 4", "steps = 4\nsample_hz = nan"),
    "sample-hz-inf": edit("steps = 4", "steps = 4\nsample_hz = inf"),
    "sample-hz-huge": edit("steps = 4", "steps = 4\nsample_hz = 1e9"),
    "cfg-nan": edit("steps = 4", "steps = 4\ntrue_cfg_scale = nan"),
    "vram-gib-nan": edit("vram_gib = 0.5", "vram_gib = nan"),
    "vram-gib-inf": edit("vram_gib = 0.5", "vram_gib = inf"),
    "vram-mib-neg-inf": edit("vram_gib = 0.5", "vram_mib = -inf"),
    "latency-ratio-inf": append("[verdict]\nmax_latency_ratio = inf"),
    "latency-ratio-nan": append("[verdict]\nmax_latency_ratio = nan"),
    "psnr-nan": append("[verdict]\nmin_psnr_db = nan"),
    "psnr-neg-inf": append("[verdict]\nmin_psnr_db = -inf"),
    "psnr-above-cap": append("[verdict]\nmin_psnr_db = 200"),
    "transparent-above-1": append("[verdict]\nmax_transparent_share = 1.5"),
    "transparent-below-0": append("[verdict]\nmax_transparent_share = -0.1"),
    "transparent-nan": append("[verdict]\nmax_transparent_share = nan"),
    "pixel-std-negative": append("[verdict]\nmin_pixel_std = -1"),
    "target-refs-not-in-matrix": append("[verdict]\ntarget_references = 5"),
    "env-value-nan": edit("[cards.small]", "[cards.small]\nenv = { X = nan }"),
    "size-zero": edit('size = "64x64"', 'size = "0x0"'),
    "size-huge": edit('size = "64x64"', 'size = "99999x99999"'),
    "restarts-huge": edit("steps = 4", "steps = 4\nrestarts = 1000000000"),
    "repeats-huge": edit("steps = 4", "steps = 4\nrepeats = 1000000000"),
    "repeats-word": edit("steps = 4", 'steps = 4\nrepeats = "often"'),
    "max-repeats-one": edit("steps = 4", "steps = 4\nmax_repeats = 1"),
    "max-repeats-with-fixed-repeats": edit("steps = 4", "steps = 4\nrepeats = 2\nmax_repeats = 4"),
    # --- placeholders are names only (item 10) ---
    "env-unknown-placeholder": edit("[cards.small]", '[cards.small]\nenv = { A = "{prot}" }'),
    "env-json-braces": edit("[cards.small]", '[cards.small]\nenv = { A = \'{"a": 1}\' }'),
    "command-format-spec-dos": edit('"{port}"', '"{port:>999999999999}"'),
    "command-conversion": edit('"{port}"', '"{port!r}"'),
    "command-attribute": edit('"{port}"', '"{port.real}"'),
    "command-index": edit('"{port}"', '"{port[0]}"'),
    "command-lone-brace": edit('"{port}"', '"{port"'),
    "args-lone-closing-brace": edit('args = ["--cond-cache", "host"]', 'args = ["x}"]'),
    "args-env-reference": edit('args = ["--cond-cache", "host"]', 'args = ["${HOME}"]'),
    "env-bad-reference": edit("[cards.small]", '[cards.small]\nenv = { A = "${1BAD}" }'),
    "env-bad-key": edit("[cards.small]", '[cards.small]\nenv = { "BAD-KEY" = "1" }'),
    "env-unset-variable": edit("[cards.small]", '[cards.small]\nenv = { HF_TOKEN = "${RUNNER_TEST_UNSET_VAR}" }'),
    "fixed-port-in-two-lanes": seq(edit("[servers.ref]\n", "[servers.ref]\nport = 18999\n"),
                                   append('[cards.other]\nserver = "ref"\nvram_gib = 1')),
    # --- axes (item 11) ---
    "references-empty": edit("references = [1, 2]", "references = []"),
    "references-negative": edit("references = [1, 2]", "references = [-1]"),
    "references-huge": edit("references = [1, 2]", "references = [1, 99999]"),
    "exclude-everything": edit("references = [1, 2]", 'references = [1, 2]\nexclude = [{card = "small"}]'),
    "exclude-empty-table": edit("references = [1, 2]", "references = [1, 2]\nexclude = [{}]"),
    "seeds-duplicate": edit("seeds = [1, 2]", "seeds = [1, 1]"),
    "seeds-empty": edit("seeds = [1, 2]", "seeds = []"),
    "seeds-negative": edit("seeds = [1, 2]", "seeds = [-5]"),
    "cards-duplicate": edit("references = [1, 2]", 'references = [1, 2]\ncards = ["small", "small"]'),
    # --- reference images (item 9) ---
    "ref-text-file": ref_file(lambda p: p.write_text("not an image\n")),
    "ref-empty-png": ref_file(lambda p: p.write_bytes(b"")),
    "ref-dev-zero": ref_path("/dev/zero"),
    "ref-dev-null": ref_path("/dev/null"),
    "ref-fifo": ref_file(fifo),
    "ref-directory": ref_file(lambda p: p.mkdir()),
    "ref-100000-square-header": ref_file(lambda p: p.write_bytes(png_header(100000, 100000))),
    "ref-wide-header": ref_file(lambda p: p.write_bytes(png_header(20000, 10))),
    "ref-truncated-png": ref_file(lambda p: p.write_bytes((p.parent / "a.png").read_bytes()[:80])),
    "ref-too-big-file": ref_file(lambda p: os.truncate(p.open("wb").name, 65 * 2**20)),
    "ref-missing": ref_path("refs/nope.png"),
    # --- baseline (item 9) ---
    "baseline-no-samples-json": seq(lambda d: (d / "base").mkdir(), append('[baseline]\ndir = "base"')),
    "baseline-samples-fifo": seq(lambda d: (d / "base").mkdir(), lambda d: fifo(d / "base" / "samples.json"),
                                 append('[baseline]\ndir = "base"')),
    "baseline-bad-json": baseline(b"{not json"),
    "baseline-deep-json": baseline(b"[" * 100000 + b"]" * 100000),
    "baseline-not-a-list": baseline({"samples": 3}),
    "baseline-empty": baseline({"samples": []}),
    "baseline-sample-no-file": baseline({"samples": [{"fixture": "pair", "seed": 1}]}),
    "baseline-image-missing": baseline({"samples": [sample()]}),
    "baseline-image-text": baseline({"samples": [sample()]}, files={"s.png": b"hello"}),
    "baseline-image-huge-header": baseline({"samples": [sample()]}, files={"s.png": png_header(100000, 100000)}),
    "baseline-wall-string": baseline({"samples": [sample(wall_s="abc")]}, files={"s.png": None}),
    "baseline-wall-nan": baseline(b'{"samples": [{"fixture": "pair", "seed": 1, "file": "s.png", "wall_s": NaN}]}',
                                  files={"s.png": None}),
    "baseline-seed-inf": baseline(b'{"samples": [{"fixture": "pair", "seed": Infinity, "file": "s.png"}]}',
                                  files={"s.png": None}),
    "baseline-references-string": baseline({"samples": [sample(references="x")]}, files={"s.png": None}),
    # --- results folder (item 9) ---
    "results-is-a-file": seq(lambda d: (d / "res").write_text("x"), results("res")),
    "results-dev-null": results("/dev/null"),
    "results-under-a-file": seq(lambda d: (d / "res").write_text("x"), results("res/sub")),
    "results-unwritable-proc": results("/proc/runner-results"),
    "results-read-only-sysfs": results("/sys/runner-results"),
    "results-empty-string": results(""),
    # --- the file itself ---
    "toml-syntax": edit("[run]", "[run"),
    "toml-unknown-section": append("[bogus]\nx = 1"),
}


def snapshot(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = p.lstat().st_size if not p.is_dir() else -1
    return out


@pytest.fixture
def no_server(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    started: list[str] = []

    def create(backend: str, spec: object) -> None:
        started.append(backend)
        raise AssertionError("a server was created for bad input")

    monkeypatch.setattr(backends, "create", create)
    return started


def test_corpus_is_large_enough() -> None:
    assert len(CASES) >= 60


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bad_input_exit_2_one_line(case: str, matrix_dir: Path, capsys: pytest.CaptureFixture[str],
                                   no_server: list[str]) -> None:
    extra = CASES[case](matrix_dir) or []
    before = snapshot(matrix_dir)
    code = cli.main(["run", str(matrix_dir / "matrix.toml"), "--no-progress", *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("runner: error: "), err
    assert "Traceback" not in err
    assert not no_server
    assert snapshot(matrix_dir) == before  # no run folder, no results folder, no stray file


@pytest.mark.parametrize("case", ["card-dotdot", "command-format-spec-dos", "ref-100000-square-header",
                                  "results-dev-null", "baseline-deep-json"])
def test_bad_input_from_the_command(case: str, matrix_dir: Path) -> None:
    CASES[case](matrix_dir)
    before = snapshot(matrix_dir)
    proc = subprocess.run([sys.executable, "-m", "runner", str(matrix_dir / "matrix.toml"), "--no-progress"],
                          capture_output=True, text=True, timeout=60, cwd=matrix_dir)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == ""
    assert snapshot(matrix_dir) == before


def test_disk_too_full_is_refused_before_start(matrix_dir: Path, tmp_path: Path, capsys, no_server) -> None:
    """A results folder on a nearly full disk (a real 1 MiB tmpfs) is refused before anything starts."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        code = cli.main(["run", str(matrix_dir / "matrix.toml"), "--results", str(mnt), "--no-progress"])
        err = capsys.readouterr().err
        assert code == 2 and len(err.splitlines()) == 1 and "MiB free" in err, err
        assert list(mnt.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
