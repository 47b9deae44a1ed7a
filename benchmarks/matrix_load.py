"""Wall time of `load_matrix` on the shipped matrices (the loader runs at every `runner`, `plan`, `report`).

    .venv/bin/python benchmarks/matrix_load.py [--repeat 200] [FILE ...]

Prints the median and the fastest of --repeat loads per file (files are not checked for references,
`check_files=False`, so the figure is the parse and validation alone). Defaults to every examples/*.toml and
matrix.toml. docs/benchmarks.md keeps the figures of issue 16 (hand-written `_Table` → declared models).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runner.plan.matrix import load_matrix  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    files = args.files or [*sorted((ROOT / "examples").glob("*.toml")), ROOT / "matrix.toml"]
    load_matrix(files[0], check_files=False)  # imports and first-use caches out of the figure
    for path in files:
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            load_matrix(path, check_files=False)
            times.append(time.perf_counter() - t0)
        print(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: "
              f"median {statistics.median(times) * 1e3:.3f} ms, min {min(times) * 1e3:.3f} ms "
              f"({args.repeat} loads)")


if __name__ == "__main__":
    main()
