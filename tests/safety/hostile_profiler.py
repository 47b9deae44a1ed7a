"""A vLLM-Omni-shaped server whose profiler is hostile (stdlib only), one misbehaviour per `--mode` (issue 46).

    python hostile_profiler.py --port N --mode MODE [--profiler-config JSON]

Every request (POST /v1/chat/completions) is a device OOM (HTTP 500, vLLM-Omni's body), so a run's diagnosis
pass starts it again with `--profiler-config` and asks POST /start_profile, the request, POST /stop_profile.
At /stop_profile the server writes into its profiler folder, as `<folder>/<stamp>_hostile/memory_snapshot_rank0
.pickle`, what its mode says:
  plain        a snapshot nothing is wrong with (the control)
  secret       $HF_TOKEN in the frames' paths and names and in the user_metadata (P-7)
  escapes      terminal escapes, bidi, markup, a mathtext formula, a cyclic filename (P-8)
  deep         a filename nested 100,000 deep (P-2)
  huge-400     a block of 10**400 bytes (P-3)
  huge-5000    a block of 10**5000 bytes (P-3)
  dangling     a symlink to a file that does not exist (P-5)
  passwd       a symlink to /etc/passwd (P-4)
  fifo         a FIFO (P-4)
  trace        no snapshot, a profiler trace (`trace_rank0.json.gz`) whose [memory] events peak at 5 MiB
Profiler faults: `start-500` (/start_profile answers 500), `start-huge` (a 1 MB body), `start-hang` (it never
answers; the log says `start_profile received` first, so a test acts during the hang) (P-9, P-10).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hostile_snapshots as H  # beside this script, which runs as a program

OOM = ("CUDA out of memory. Tried to allocate 96.00 MiB. GPU 0 has a total capacity of 1.00 GiB of which 20.00 MiB "
       "is free. Including non-PyTorch memory, this process has 700.00 MiB memory in use. Of the allocated memory "
       "650.00 MiB is allocated by PyTorch, and 12.00 MiB is reserved by PyTorch but unallocated.")


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def write_snapshot(folder: Path, mode: str) -> None:
    out = folder / f"{time.time_ns()}_hostile"
    out.mkdir(parents=True, exist_ok=True)
    path = out / "memory_snapshot_rank0.pickle"
    token = os.environ.get("HF_TOKEN", "")
    if mode == "dangling":
        os.symlink(out / "gone.pickle", path)
    elif mode == "passwd":
        os.symlink("/etc/passwd", path)
    elif mode == "fifo":
        os.mkfifo(path)
    elif mode == "trace":
        events = [{"name": "[memory]", "args": {"Total Allocated": n * 2**20, "Device Type": 0}} for n in (3, 5, 4)]
        (out / "trace_rank0.json.gz").write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    else:
        made = {"secret": lambda: H.secret(token), "escapes": H.escapes, "deep": H.deep,
                "huge-400": lambda: H.huge(size=10**400), "huge-5000": lambda: H.huge(size=10**5000)}
        data = made.get(mode, H.plain)()
        path.write_bytes(data)


class Handler(BaseHTTPRequestHandler):
    mode = "plain"
    folder: Path | None = None
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: object) -> None:
        pass

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send(200 if self.path.startswith("/health") else 404, b"{}")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/start_profile":
            log("start_profile received")
            if self.mode == "start-500":
                self._send(500, b'{"error": "profiler exploded"}')
            elif self.mode == "start-huge":
                self._send(200, b'{"status": "' + b"x" * 2**20 + b'"}')
            elif self.mode == "start-hang":
                time.sleep(3600)
            else:
                self._send(200, b'{"status": "started"}')
        elif self.path == "/stop_profile":
            assert self.folder is not None
            write_snapshot(self.folder, self.mode)
            self._send(200, b'{"status": "stopped"}')
        else:
            self._send(500, json.dumps({"error": {"message": f"Image generation failed: {OOM}"}}).encode())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mode", default="plain")
    p.add_argument("--profiler-config")
    a = p.parse_args()
    Handler.mode = a.mode
    if a.profiler_config:
        Handler.folder = Path(json.loads(a.profiler_config)["torch_profiler_dir"])
    log(f"hostile profiler server mode {a.mode} on port {a.port}")
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer(("127.0.0.1", a.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
