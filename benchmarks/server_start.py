"""CPU and wall time of one reference-server start, process start to a 200 on /health (issue 32: the suite
starts hundreds). The CPU is the server process's own (user + system, /proc/PID/stat), nothing else's.

    .venv/bin/python benchmarks/server_start.py --repeats 3 -- --preset tiny --vram-gib 0.0075
    .venv/bin/python benchmarks/server_start.py --repeats 3 -- --arch qwen-image --preset tiny --vram-gib 0.016
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(server_args: list[str], cwd: Path | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """A reference server started with `server_args` and answered 200 on /health: the process and its URL.
    `cwd`: a source tree whose runner to run (`-m` puts it first on sys.path, before the venv's editable install)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "runner.refserver", "--port", str(port), *server_args], cwd=cwd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode} before it was ready")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    except BaseException:
        proc.terminate()
        proc.wait(30)
        raise


def process_cpu_s(pid: int) -> float:
    """The process's own CPU so far (user + system), nothing of its children."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_start(server_args: list[str]) -> tuple[float, float]:
    t0 = time.monotonic()
    proc, _ = launch(server_args)
    try:
        return time.monotonic() - t0, process_cpu_s(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("server_args", nargs=argparse.REMAINDER, help="after --: the refserver's arguments")
    a = p.parse_args()
    args = [x for x in a.server_args if x != "--"]
    runs = [one_start(args) for _ in range(a.repeats)]
    walls, cpus = [r[0] for r in runs], [r[1] for r in runs]
    print(f"refserver {' '.join(args)}: ready in {statistics.median(walls):.2f} s wall "
          f"[{min(walls):.2f}–{max(walls):.2f}], {statistics.median(cpus):.2f} CPU-s [{min(cpus):.2f}–{max(cpus):.2f}] "
          f"(median [min–max] of {a.repeats})")


if __name__ == "__main__":
    main()
