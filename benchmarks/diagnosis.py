"""The diagnosis pass (issue 27): what it costs per flag set decided by a device OOM, and that the measured
sends are the same with it on and off — end to end through the runner and the reference server (CPU).

    .venv/bin/python benchmarks/diagnosis.py [--matrix examples/local.toml] [--cards cpu-tiny,cpu-tight] [--keep DIR
                                             [--reuse]]

Runs the matrix twice, `[run] diagnosis = "off"` and `"oom"` (the default), each a real run (`runner MATRIX
--results DIR`), with `repeats = 1` so both send exactly the same requests. Then it compares, step by step, what
the measured sends recorded: status, failure class, the image's sha256 and the device peak of the first
available source (the CPU ledger is deterministic: peaks must be equal to the byte; the CUDA allocator's
reserved figure can move by a segment, so on a GPU compare with a tolerance); wall times are timed sends on a
shared machine and are compared as medians. Prints each diagnosis record (start, request, whole pass) and the
mean cost per OOM'd flag set, beside the run's GPU-busy time.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runner.run.store import RunStore  # noqa: E402


def matrix_text(path: Path, mode: str, cards: list[str] | None) -> str:
    text = path.read_text()
    text = re.sub(r"(?m)^(repeats|max_repeats|diagnosis)\s*=.*\n", "", text)
    text = text.replace("[run]\n", f'[run]\nrepeats = 1\ndiagnosis = "{mode}"\n', 1)
    text = re.sub(r'"refs/', f'"{path.parent}/refs/', text)
    if cards:  # keep only these cards (and a baseline cell on one of them)
        for card in re.findall(r"(?m)^\[cards\.([^\]]+)\]", text):
            if card not in cards:
                text = re.sub(rf"(?ms)^\[cards\.{re.escape(card)}\]\n.*?(?=^\[)", "", text)
        m = re.search(r'(?m)^cell\s*=\s*"([^/"]+)/', text)
        if m and m.group(1) not in cards:
            text = re.sub(r"(?ms)^\[baseline\]\n.*?(?=^\[)", "", text)
    return text


def run(matrix: Path, results: Path) -> Path:
    subprocess.run([sys.executable, "-m", "runner", str(matrix), "--results", str(results), "--no-progress"],
                   cwd=ROOT, check=False, stdout=subprocess.DEVNULL)
    return max(results.glob("*-*"), key=lambda p: p.stat().st_mtime)


def measured(folder: Path) -> dict[str, tuple]:
    """Per step what its sends recorded. A served step's peak is the server's own (the CPU ledger: exact); a
    step that ran out of memory has no server figure, only a polled meter's sample of a failing request
    (its timing decides it), so for those the status and failure class are compared, not the sample."""
    out = {}
    for s in RunStore(folder).load_steps():
        peak = next(((p.source, p.bytes) for p in s.peaks if p.metric == "device" and p.available), None)
        out[s.key] = (s.status, s.failure.kind if s.failure else None, s.image_sha256,
                      peak if s.status == "ok" else None)
    return out


def walls(folder: Path) -> list[float]:
    return [w for s in RunStore(folder).load_steps() for w in (s.wall_samples_s or [])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--matrix", default=str(ROOT / "examples" / "local.toml"))
    ap.add_argument("--cards", default="cpu-tiny,cpu-tight", help="comma-separated cards to keep (default: the "
                                                                    "two cards with OOMs)")
    ap.add_argument("--keep", help="keep the runs here")
    ap.add_argument("--reuse", action="store_true", help="with --keep: compare the runs already there")
    args = ap.parse_args()
    cards = [c for c in args.cards.split(",") if c] or None
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="diagnosis-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    folders = {}
    for mode in ("off", "oom"):
        m = base / f"{mode}.toml"
        m.write_text(matrix_text(Path(args.matrix).resolve(), mode, cards))
        done = sorted((base / mode).glob("*-*/verdict.json")) if args.reuse else []
        folders[mode] = done[-1].parent if done else run(m, base / mode)
    a, b = measured(folders["off"]), measured(folders["oom"])
    same = [k for k in a if k in b and a[k] == b[k]]
    differ = [(k, a[k], b.get(k)) for k in a if b.get(k) != a[k]]
    print(f"steps: {len(a)} (off) / {len(b)} (oom); identical status, failure, image sha256 and device peak: "
          f"{len(same)}; different: {len(differ)}")
    for k, x, y in differ[:10]:
        print(f"  differs: {k}: off {x} / oom {y}")
    wa, wb = walls(folders["off"]), walls(folders["oom"])
    if wa and wb:
        print(f"timed sends: median {statistics.median(wa):.2f} s (off, {len(wa)}) / {statistics.median(wb):.2f} s "
              f"(oom, {len(wb)})")
    diags = RunStore(folders["oom"]).load_diagnoses()
    assert not RunStore(folders["off"]).load_diagnoses(), "diagnosis = off ran a diagnosis pass"
    for d in diags:
        print(f"  {d.key} ({d.at}, {'load' if d.references is None else str(d.references) + ' refs'}): "
              f"start {d.start_s} s, request {d.request_s} s, whole pass {d.total_s} s -> {d.outcome}; "
              f"{'snapshot ' + str((folders['oom'] / d.snapshot).stat().st_size) + ' B' if d.snapshot else d.why_none}")
    if diags:
        total = sum(d.total_s for d in diags)
        print(f"diagnosis passes: {len(diags)}, {total:.1f} s in all, {total / len(diags):.1f} s per OOM'd flag set")
    for mode, folder in folders.items():
        run_doc = json.loads((folder / "run.json").read_text())
        print(f"{mode}: {folder.name} wall {run_doc.get('finished_at', 0) - run_doc['started_at']:.0f} s")
    return 0 if not differ else 1


if __name__ == "__main__":
    raise SystemExit(main())
