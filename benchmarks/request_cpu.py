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
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from refserver import free_port, reference

ARCHS = {  # the presets the suite runs most, at the sizes its matrices use
    "dit": (["--preset", "tiny", "--vram-gib", "0.02"], {"size": "64x64", "num_inference_steps": 4}),
    "qwen-image": (["--arch", "qwen-image", "--preset", "tiny", "--vram-gib", "0.016"],
                   {"size": "128x128", "num_inference_steps": 8}),
}


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def per_request(tree: Path, arch: str, requests: int, refs: list[str]) -> float:
    server_args, extra = ARCHS[arch]
    port = free_port()
    # `-m` puts the working directory first on sys.path: the tree's runner, not the venv's editable install.
    proc = subprocess.Popen([sys.executable, "-m", "runner.refserver", "--port", str(port), *server_args], cwd=tree,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    content = [{"type": "text", "text": "put the shapes together"}]
    content += [{"type": "image_url", "image_url": {"url": u}} for u in refs]
    body = {"model": "refserver", "messages": [{"role": "user", "content": content}],
            "extra_body": {**extra, "seed": 2301, "true_cfg_scale": 4.0, "negative_prompt": " "}}
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the {arch} server of {tree} exited with {proc.returncode} before it was ready")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)

        def send() -> None:
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            if r.status_code != 200:
                raise SystemExit(f"the {arch} server of {tree} answered {r.status_code}: {r.text[:300]}")

        send()  # warm-up: first-call costs are not a request's
        before = cpu_s(proc.pid)
        for _ in range(requests):
            send()
        return (cpu_s(proc.pid) - before) / requests
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
