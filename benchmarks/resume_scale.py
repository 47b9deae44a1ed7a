"""A resume that sends one step at scale (issue 46 X-1): cards × flag sets sessions on a fast double, the full run
once, then rounds of: one step record removed and `--resume` (timed), and `runner report` of the finished run
(timed). With `--before TREE` the same rounds run, interleaved, with another checkout's runner on its own copy of
the run, so both see the same load on a shared machine.

    .venv/bin/python benchmarks/resume_scale.py [--cards 20] [--flag-sets 5] [--rounds 3] [--before /tmp/old]

The double is tests/safety/hostile.py's `ok` mode (a 64×64 PNG at once, a peak in the response); each flag set
asks it for another peak (`--peak-mib`), so the cells differ. Two seeds × references 1–2: 4 steps a session,
400 at 20 × 5. Each line: the wall time of the command and how many plots it drew (a plot file whose inode or
mtime changed).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOUBLE = ROOT / "tests" / "safety" / "hostile.py"
REFS = ROOT / "examples" / "refs"
ROLES = ("default", "offload", "offload", "quantization", "other")


def matrix_text(cards: int, flag_sets: int, results: Path) -> str:
    head = textwrap.dedent(f"""
        [run]
        name = "scale"
        seeds = [1, 2]
        repeats = 1
        determinism_check = false
        steps = 2
        size = "64x64"
        request_timeout_s = 30
        ready_timeout_s = 30
        results_dir = "{results}"

        [servers.double]
        command = ["{{python}}", "{DOUBLE}", "--port", "{{port}}"]

        [fixtures.pair]
        prompt = "a cat on a sofa"
        references = ["{REFS / 'ref-1.png'}", "{REFS / 'ref-2.png'}"]

        [matrix]
        references = [1, 2]
        """)
    body = [f'\n[cards.c{i:02d}]\nserver = "double"\nvram_gib = 1\nmeters = ["host"]\n' for i in range(cards)]
    body += [f'\n[flags.f{j}]\nrole = "{ROLES[j % len(ROLES)] if j else "default"}"\n'
             f'args = ["--peak-mib", "{100 + 50 * j}"]\n' for j in range(flag_sets)]
    return head + "".join(body)


def _children_cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def runner(tree: Path, *args: str) -> tuple[float, float, subprocess.CompletedProcess[str]]:
    """`runner ARGS` with `tree`'s runner: (wall s, CPU s of it and every child it waited for: the servers), the
    process. The CPU figure is the one a shared machine's load does not move much."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t0, cpu0 = time.monotonic(), _children_cpu_s()
    proc = subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, cwd=tree,
                          env=env)
    return time.monotonic() - t0, _children_cpu_s() - cpu0, proc


def plot_files(run: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (run / "plots").glob("*.png")}


def drawn(before: dict[str, tuple[int, int]], run: Path) -> int:
    return sum(1 for name, seen in plot_files(run).items() if before.get(name) != seen)


Round = tuple[float, float, int, float, float, int]


def one_round(tree: Path, matrix: Path, run: Path) -> Round:
    """Resume one lost step, then report the finished run: (wall s, CPU s, plots drawn) of each."""
    step = sorted(run.glob("c00/f0/refs-2/*.json"))[-1]
    step.unlink()
    step.with_suffix(".png").unlink(missing_ok=True)
    before = plot_files(run)
    resume_s, resume_cpu, proc = runner(tree, str(matrix), "--no-progress", "--resume", str(run))
    if proc.returncode != 0 or "1 step(s) to send" not in proc.stderr:
        sys.exit(f"{tree}: the resume did not send one step (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    resumed = drawn(before, run)
    before = plot_files(run)
    report_s, report_cpu, proc = runner(tree, "report", str(run))
    if proc.returncode != 0:
        sys.exit(f"{tree}: runner report failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return resume_s, resume_cpu, resumed, report_s, report_cpu, drawn(before, run)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cards", type=int, default=20)
    ap.add_argument("--flag-sets", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", type=Path, help="another checkout of the runner to compare with (e.g. a worktree)")
    ap.add_argument("--folder", type=Path, default=Path("/tmp/resume-scale"))
    a = ap.parse_args()
    shutil.rmtree(a.folder, ignore_errors=True)
    results, matrix = a.folder / "results", a.folder / "matrix.toml"
    a.folder.mkdir(parents=True)
    matrix.write_text(matrix_text(a.cards, a.flag_sets, results))
    full_s, full_cpu, proc = runner(ROOT, str(matrix), "--no-progress")
    if proc.returncode != 0:
        sys.exit(proc.stderr[-3000:])
    (run,) = [p for p in results.iterdir() if p.is_dir()]
    print(f"full run: {full_s:.1f} s ({full_cpu:.1f} CPU-s), {a.cards * a.flag_sets} sessions, "
          f"{len(plot_files(run))} plots")
    trees = {"after": ROOT, **({"before": a.before.resolve()} if a.before else {})}
    copies = {}
    for name in trees:  # each tree resumes its own copy: one tree's plots never count as the other's
        copies[name] = a.folder / f"run-{name}"
        shutil.copytree(run, copies[name], symlinks=True)
    seen: dict[str, list[Round]] = {name: [] for name in trees}
    for i in range(a.rounds):
        for name, tree in (reversed(trees.items()) if i % 2 else trees.items()):
            r = one_round(tree, matrix, copies[name])
            seen[name].append(r)
            print(f"round {i + 1} {name:6}: resume sending one step {r[0]:5.1f} s ({r[1]:4.1f} CPU-s, {r[2]:3d} plots "
                  f"drawn); runner report {r[3]:5.1f} s ({r[4]:4.1f} CPU-s, {r[5]:3d} plots drawn)")
    for name, rows in seen.items():
        med = [statistics.median(r[i] for r in rows) for i in range(6)]
        print(f"{name:6} median of {len(rows)}: resume sending one step {med[0]:.1f} s ({med[1]:.1f} CPU-s); "
              f"runner report {med[3]:.1f} s ({med[4]:.1f} CPU-s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
