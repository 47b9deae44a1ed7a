# ruff: noqa: E501  (a verbatim vLLM-Omni log, as the real server writes it)
"""A test double of a vLLM-Omni-shaped server that leaks device memory: every served request leaves LEAK MiB
behind, so on one start request n needs BASE + (n − 1) · LEAK + WORK MiB and the first n above BUDGET runs out
of memory — at request (BUDGET − BASE − WORK) // LEAK + 2, a number a test computes from the arguments.

What it answers is vLLM-Omni 0.30's shape: POST /v1/chat/completions with the image as a data-URI image_url part
carrying the request's `peak_memory_mb`; an OOM answered 500 with PyTorch's message in the error body and its
traceback (a frame of vllm_omni's pipeline) in the log; GET /health, /v1/models. Its /metrics holds the
reference server's live gauge (`refserver_device_memory_bytes`: the bytes held now, the request's working set
included while it runs), so the runner's `server` meter reads exact levels between requests.

Stdlib only (it starts in a few tens of milliseconds). `--hold-at N --hold-file PATH`: request N, on the first
start that reaches it, creates PATH and then never answers — a test sends its Ctrl-C while that request is in
flight (the file says it is), never sleeping and hoping.

Until the reference server's own `--fault leak=SIZE` lands (issue 45 part 5), this stands in for it.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import struct
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MIB = 2**20


def png(width: int, height: int, seed: int) -> bytes:
    """An RGB PNG with a gradient (not flat, not transparent: it passes the runner's sanity checks)."""
    rows = b"".join(b"\x00" + bytes(((x * 3 + seed * 7) % 256, (y * 5) % 256, (x + y + seed) % 256)[c]
                                     for x in range(width) for c in range(3)) for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


OOM_TRACEBACK = """ERROR 12-05 07:51:10 [diffusion_worker.py:1870] Error executing method 'execute_model'.
ERROR 12-05 07:51:10 [diffusion_worker.py:1870] Traceback (most recent call last):
ERROR 12-05 07:51:10 [diffusion_worker.py:1870]   File "/venv/lib/python3.11/site-packages/vllm_omni/diffusion/worker/diffusion_model_runner.py", line 865, in _execute_request_list
ERROR 12-05 07:51:10 [diffusion_worker.py:1870]     raw_outputs = self.pipeline.forward(batch)
ERROR 12-05 07:51:10 [diffusion_worker.py:1870]   File "/venv/lib/python3.11/site-packages/vllm_omni/diffusion/models/qwen_image/pipeline_qwen_image_edit_plus.py", line 737, in forward
ERROR 12-05 07:51:10 [diffusion_worker.py:1870]     latents, image_latents = self.prepare_latents(
ERROR 12-05 07:51:10 [diffusion_worker.py:1870]   File "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1789, in _call_impl
ERROR 12-05 07:51:10 [diffusion_worker.py:1870]     return forward_call(*args, **kwargs)
ERROR 12-05 07:51:10 [diffusion_worker.py:1870] torch.OutOfMemoryError: {message}
"""


def oom_message(tried: int, budget: int, live: int) -> str:
    free = budget - live
    return (f"CUDA out of memory. Tried to allocate {tried / MIB:.2f} MiB. GPU 0 has a total capacity of "
            f"{budget / MIB:.2f} MiB of which {free / MIB:.2f} MiB is free. Including non-PyTorch memory, this "
            f"process has {live / MIB:.2f} MiB memory in use. Of the allocated memory {live / MIB:.2f} MiB is "
            "allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated.")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--budget-mib", type=float, required=True)
    ap.add_argument("--base-mib", type=float, default=16)
    ap.add_argument("--work-mib", type=float, default=8, help="a request's working set, freed at its end")
    ap.add_argument("--leak-mib", type=float, default=0, help="left behind by every served request")
    ap.add_argument("--hold-at", type=int, default=0)
    ap.add_argument("--hold-file", default="")
    args = ap.parse_args()
    budget, work, leak = int(args.budget_mib * MIB), int(args.work_mib * MIB), int(args.leak_mib * MIB)
    state = {"live": int(args.base_mib * MIB), "requests": 0}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a: object) -> None:
            pass

        def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, b"{}")
            elif self.path == "/v1/models":
                self._send(200, json.dumps({"object": "list", "data": [{"id": "leaky", "object": "model"}]}).encode())
            elif self.path == "/metrics":
                page = ("# TYPE refserver_device_memory_bytes gauge\n"
                        f"refserver_device_memory_bytes {state['live']}\n")
                self._send(200, page.encode(), "text/plain; version=0.0.4")
            else:
                self._send(404, b"{}")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            with lock:
                state["requests"] += 1
                n = state["requests"]
            if n == args.hold_at and args.hold_file:
                try:
                    os.close(os.open(args.hold_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    pass  # an earlier start held already: this one serves
                else:
                    print(f"INFO holding request {n}", flush=True)
                    while True:
                        time.sleep(60)
            extra = body.get("extra_body", {})
            width, height = int(extra.get("width", 64)), int(extra.get("height", 64))
            with lock:
                live = state["live"]
                if live + work > budget:
                    message = oom_message(work, budget, live)
                    print(OOM_TRACEBACK.format(message=message), end="", flush=True)
                    error = {"error": {"message": f"Image generation failed: {message}", "type": "BadRequestError",
                                       "param": None, "code": 500}}
                    self._send(500, json.dumps(error).encode())
                    return
                state["live"] = live + work
            time.sleep(0.02)  # the working set is held a moment, as a denoise would
            peak = live + work
            with lock:
                state["live"] = live + leak
            image = base64.b64encode(png(width, height, int(extra.get("seed", 0)) % 256)).decode()
            part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"},
                    "peak_memory_mb": peak / MIB}
            doc = {"id": f"chatcmpl-{n}", "object": "chat.completion", "model": body.get("model"),
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": [part]},
                                "finish_reason": "stop"}]}
            print(f"INFO request {n}: served, peak {peak / MIB:.2f} MiB, {state['live'] / MIB:.2f} MiB held after",
                  flush=True)
            self._send(200, json.dumps(doc).encode())

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    print(f"INFO listening on {args.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
