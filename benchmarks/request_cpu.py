"""The reference server's own CPU per request (user + system from /proc/PID/stat around the timed requests, after
one warm-up request), for the DiT and the Qwen-Image tiny presets, for one or more source trees side by side:
the suite sends hundreds of requests, so a cost per request is paid many times (issue 32).

    git worktree add /tmp/before ae712fe~1
    .venv/bin/python benchmarks/request_cpu.py --tree before=/tmp/before --tree after=. --rounds 3

Each tree's server runs under this interpreter with runner imported from the tree, so the two differ only in
runner's own source. Rounds interleave the trees, so a change in the machine's load falls on both alike.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from refserver import reference, request
from server_start import launch, process_cpu_s

ARCHS = {  # the presets the suite runs most, at the sizes its matrices use: server flags, request fields
    "dit": (["--preset", "tiny", "--vram-gib", "0.02"], argparse.Namespace(size="64x64", steps=4)),
    "qwen-image": (["--arch", "qwen-image", "--preset", "tiny", "--vram-gib", "0.016"],
                   argparse.Namespace(size="128x128", steps=8)),
}


def per_request(tree: Path, arch: str, requests: int, refs: list[str]) -> float:
    server_args, fields = ARCHS[arch]
    asked = argparse.Namespace(**vars(fields), true_cfg_scale=4.0, request_timeout=120)
    proc, url = launch(server_args, cwd=tree)
    try:
        def send() -> None:
            status, _, _ = request(url, refs, asked)
            if status != 200:
                raise SystemExit(f"the {arch} server of {tree} answered {status}")

        send()  # warm-up: first-call costs are not a request's
        before = process_cpu_s(proc.pid)
        for _ in range(requests):
            send()
        return (process_cpu_s(proc.pid) - before) / requests
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                   help="a source tree to measure (repeatable; default: this one)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median reported)")
    p.add_argument("--requests", type=int, default=5, help="timed requests per server")
    p.add_argument("--refs", type=int, default=4, help="reference images per request")
    a = p.parse_args()
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1]).resolve()) for t in a.tree] or [
        ("this", Path(__file__).resolve().parents[1])]
    refs = [reference(i) for i in range(a.refs)]
    got: dict[tuple[str, str], list[float]] = {}
    for _ in range(a.rounds):
        for arch in ARCHS:
            for label, tree in trees:
                got.setdefault((arch, label), []).append(per_request(tree, arch, a.requests, refs))
    for arch in ARCHS:
        first = statistics.median(got[(arch, trees[0][0])])
        for label, _ in trees:
            xs = got[(arch, label)]
            med = statistics.median(xs)
            print(f"{arch:10} {label:8} {med:.3f} CPU-s per request [{min(xs):.3f}–{max(xs):.3f}]  "
                  f"{med / first:.2f}× {trees[0][0]}")


if __name__ == "__main__":
    main()
