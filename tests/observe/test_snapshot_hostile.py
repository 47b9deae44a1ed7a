"""Hostile allocator snapshots as `runner report` reads them (runner.run.diagnose.readings; issue 46 P-1…P-4,
P-6…P-8): each is one diagnosis record's "no held reading" line or a reading whose every text is masked and
inert, never a traceback, a hang or memory. The bombs, the FIFO and /dev/zero are read by a child process under
a 3 GiB address-space cap and a deadline, so that the code before the fix fails there (MemoryError, timeout)
instead of taking the machine with it."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from runner.core.records import DiagnosisRecord
from runner.judge.findings.held import Reading, held_memory
from runner.run.diagnose import readings
from runner.run.store import RunStore
from tests.safety import hostile_snapshots as H

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT = "c/f/diagnosis/oom/profile/1_hostile/memory_snapshot_rank0.pickle"
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
TOKEN = "hf_RealSecretValue1234567890"


def diagnosed(tmp: Path, data: bytes | None = None, make: Callable[[Path], object] | None = None) -> RunStore:
    """A run folder with one diagnosis record whose snapshot is `data` (or what `make` puts at its path)."""
    path = tmp / "run" / SNAPSHOT
    path.parent.mkdir(parents=True)
    if make is not None:
        make(path)
    else:
        path.write_bytes(data or b"")
    store = RunStore(tmp / "run")
    store.write_diagnosis(DiagnosisRecord(key="c/f", card="c", flags="f", at="oom", of="c/f/refs-1/x-seed-1",
                                          references=1, started_at=1.0, total_s=1.0, outcome="oom",
                                          snapshot=SNAPSHOT))
    return store


def reading(store: RunStore, **kw: object) -> Reading:
    (r,) = readings(store, **kw)[("c", "f")]  # type: ignore[arg-type]
    return r


def texts(r: Reading) -> list[str]:
    """Every text a reading keeps (what verdict.json, report.md and the plot take from it)."""
    out = [r.why or ""]
    if r.held is not None:
        out += [*r.held.notes, *(n.name for n in r.held.named)]
        out += [t for s in r.held.by_site for t in (s.site, s.function or "", s.part or "")]
    return out


CHILD = textwrap.dedent("""
    import json, resource, sys, time
    from pathlib import Path
    resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))
    from runner.run.diagnose import readings
    from runner.run.store import RunStore
    before, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.monotonic()
    (r,) = readings(RunStore(Path(sys.argv[1])))[("c", "f")]
    print(json.dumps({"active": r.held.active_bytes if r.held else None, "why": r.why, "s": time.monotonic() - t0,
                      "grew_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}))
""")


def read_in_child(store: RunStore, timeout: float = 60) -> dict:
    """readings() in a child capped at 3 GiB of address space: its answer, how long, how much its peak grew."""
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, str(store.root)], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired:
        pytest.fail(f"readings() still running after {timeout:g} s")
    assert proc.returncode == 0, proc.stderr[-1500:]
    return dict(json.loads(proc.stdout))


def test_p1_a_repr_bomb_as_a_frames_texts_is_no_frame_and_builds_nothing(tmp_path: Path) -> None:
    """Lists shared 5 deep and 200 wide (2.4 KB) as a frame's filename and name and as the user_metadata: never
    str()'d (before: the whole repr built, MemoryError); that frame is no frame, the block is still counted."""
    data = H.repr_bomb()
    assert len(data) < 3000
    got = read_in_child(diagnosed(tmp_path, data))
    assert got["active"] == 1000 and got["why"] is None, got
    assert got["s"] < 10 and got["grew_mib"] < 64, got
    r = reading(diagnosed(tmp_path / "again", data))
    assert r.held is not None and [(s.site, s.function, s.part) for s in r.held.by_site] == [
        ("/srv/app/engine.py:88", "forward", None)]
    assert r.held.named == ()


def test_p2_deep_nesting_is_no_frame_and_never_a_traceback(tmp_path: Path) -> None:
    """`]`×100000 as a filename and as the user_metadata (before: RecursionError out of readings(): no
    report, and `runner report` failing the same way every time)."""
    r = reading(diagnosed(tmp_path, H.deep()))
    assert r.held is not None, r.why
    assert [(s.site, s.part) for s in r.held.by_site] == [("/srv/app/engine.py:88", None)]
    assert r.held.active_bytes == 1000


@pytest.mark.parametrize("figures", [{"size": 10**400}, {"size": 10**5000}, {"address": 2**50},
                                     {"line": 10**400}], ids=["size-400-digits", "size-5000-digits",
                                                              "address-1-PiB", "line-400-digits"])
def test_p3_a_figure_beyond_any_memory_refuses_the_snapshot_in_one_line(tmp_path: Path, figures: dict) -> None:
    """Before: the 10**400-byte block was the held reading (its sentence an OverflowError in fmt_bytes, a
    10**5000 one a verdict.json that cannot be written)."""
    r = reading(diagnosed(tmp_path, H.huge(**figures)))
    assert r.held is None, r.held
    assert r.why is not None and "beyond any memory (1 PiB or more)" in r.why, r.why
    assert "\n" not in r.why and len(r.why) < 300


def test_p4_a_link_to_a_snapshot_outside_the_run_folder_is_not_read(tmp_path: Path) -> None:
    """`inside` was lexical: a link in the run folder to any readable file was read (here a valid snapshot)."""
    outside = tmp_path / "outside.pickle"
    outside.write_bytes(H.plain())
    r = reading(diagnosed(tmp_path / "a", make=lambda p: os.symlink(outside, p)))
    assert r.held is None and r.why is not None and "symbolic link" in r.why, (r.held, r.why)
    # a folder on the way that is a link out of the run folder
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "1_hostile").mkdir(parents=True)
    (elsewhere / "1_hostile" / "memory_snapshot_rank0.pickle").write_bytes(H.plain())
    store = diagnosed(tmp_path / "b", H.plain())
    profile = store.root / "c/f/diagnosis/oom/profile"
    (profile / "1_hostile" / "memory_snapshot_rank0.pickle").unlink()
    (profile / "1_hostile").rmdir()
    os.symlink(elsewhere / "1_hostile", profile / "1_hostile")
    r = reading(store)
    assert r.held is None and r.why is not None and "symbolic link" in r.why, (r.held, r.why)


@pytest.mark.parametrize(("make", "said"), [(os.mkfifo, "a FIFO, not a regular file"),
                                            (lambda p: os.symlink("/dev/zero", p), "symbolic link")],
                         ids=["fifo", "link-to-dev-zero"])
def test_p4_a_fifo_or_a_link_to_dev_zero_is_one_line_at_once(tmp_path: Path, make: Callable[[Path], object],
                                                             said: str) -> None:
    """Before: the FIFO hung `open()` (the report never came, Ctrl-C did nothing); /dev/zero (`stat`: 0 bytes)
    was read until MemoryError."""
    got = read_in_child(diagnosed(tmp_path, make=make), timeout=20)
    assert got["active"] is None and said in got["why"], got
    assert got["s"] < 5 and got["grew_mib"] < 64, got


def test_p6_a_none_opcode_bomb_ends_at_the_readers_memory_cap(tmp_path: Path) -> None:
    """260 KB of gzip, 255 MiB of NONE opcodes (under the 256 MiB inflated cap): a list of 255 M pointers, 6.7 GB
    before; now the isolated reader's 2 GiB cap ends it, and the runner's own memory does not grow."""
    data = H.none_bomb()
    assert len(data) < 300_000
    got = read_in_child(diagnosed(tmp_path, data))
    assert got["active"] is None and "too large: reading it needs more than 2 GiB" in got["why"], got
    assert got["s"] < 30 and got["grew_mib"] < 64, got


def test_p6_blocks_sharing_one_frame_list_walk_it_once(tmp_path: Path) -> None:
    """200,000 blocks sharing one list of 64 frames of 700 characters (before: 1.06 GB, 12 s): read once."""
    got = read_in_child(diagnosed(tmp_path, H.shared_frames()))
    assert got["active"] == 200_000 * 512 and got["why"] is None, got
    assert got["s"] < 15 and got["grew_mib"] < 64, got


def test_p7_secrets_in_a_snapshot_are_masked_where_they_enter(tmp_path: Path) -> None:
    r = reading(diagnosed(tmp_path, H.secret(TOKEN)), secrets=(TOKEN,))
    assert r.held is not None
    kept = texts(r)
    assert not [t for t in kept if TOKEN in t], kept
    assert "/home/***/app/engine.py:88" in kept and "load_***" in kept and "the server's cache ***" in kept
    # a global named after the secret is refused, and the refusal's words are masked too
    evil = b"\x80\x02c" + f"os\n{TOKEN}\n".encode() + b"0" + pickle.dumps({"segments": []}, protocol=2)[2:]
    r = reading(diagnosed(tmp_path / "global", evil), secrets=(TOKEN,))
    assert r.held is None and r.why is not None and "refused" in r.why and TOKEN not in r.why, r.why


def test_p8_control_characters_bidi_and_markup_are_inert_and_a_non_string_frame_is_no_frame(tmp_path: Path) -> None:
    """Before: stored raw in verdict.json, a cyclic filename became the site `[[...]]:1`, and the held plot
    printed "Glyph 27 missing" (or failed on the formula)."""
    r = reading(diagnosed(tmp_path, H.escapes()))
    assert r.held is not None, r.why
    kept = texts(r)
    assert not [t for t in kept if CONTROL.search(t)], kept
    (site,) = r.held.by_site
    assert site.site.endswith(".py:7") and "\\x1b[2J" in site.site and "\\u202e" in site.site, site
    assert "[[...]]" not in " ".join(kept)
    from runner.present import plots

    held = held_memory(r.held, None, 2**30, file=SNAPSHOT, record="c/f", references=1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fig = plots.held_figure("c", [("f", held)], 2**30)
        assert fig is not None
        fig.savefig(io.BytesIO(), format="png")
    assert not [w for w in seen if "Glyph" in str(w.message)], [str(w.message) for w in seen]
