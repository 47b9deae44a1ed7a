"""A hostile image server (stdlib only), one misbehaviour per `--mode`, speaking vLLM-Omni's chat API.

    python hostile.py --port N --mode MODE [--metrics GAUGE_VALUE]

Modes (each answers GET /health with 200 unless said otherwise; POST /v1/chat/completions is the request):
  drip        200 headers, then the JSON one byte every 0.5 s, forever
  huge        200 with a 400 MB body, streamed without a Content-Length
  gzip-bomb   200 with Content-Encoding: gzip, ~1 MB that inflate to 256 MiB
  bomb        200 with a valid PNG of 12000x12000 pixels (~150 KB; 144 MB decoded)
  html        200 with an HTML page, base64-encoded, where the image should be
  bad-base64  200 with an image URL that is not base64
  secret      HTTP 500 whose body and whose logged traceback hold $HF_TOKEN
  escapes     HTTP 500; body and log lines hold terminal escapes, OSC 8 links, <script>, <img onerror>,
              a javascript: link, bidi overrides
  hang        POST reads the request and never answers
  drip-health GET /health drips one byte every 0.5 s, forever (the server never becomes ready)
  load-secret prints a traceback holding $HF_TOKEN and escapes at load, then exits 1
  ok          a valid 64x64 PNG (the control)
Findings modes (issue 30): an OOM with hostile figures or logs, HTTP 500 in a request or exit 1 at load:
  oom-huge      "Tried to allocate" a 400-digit number of GiB, in the log and the body
  load-oom-huge the same at load
  oom-signs     "1e30 GiB allowed", "-2.00 GiB" in use, a "0 B" capacity, a twenty-digit free figure
  oom-prefixed  the traceback with vLLM's worker prefixes: a rank, and terminal colours
  oom-long      a traceback of ~550 KB: longer than the runner's log window
  load-oom-long a traceback of ~40 KB at load: longer than the start's log tail
  load-oom-others a load OOM within the stated capacity (other processes hold the rest)
  oom-markup    the site is `vllm_omni/__init__.py` in `_x_`, a caller under `~~gone~~`
  oom-body      the OOM only in the 500's body, the log silent
Auto-repeat modes (issue 30 A-1, A-2): wall times a latency ratio must survive (counted per server start):
  oom-at-2      a request with two or more references is the OOM of oom-body; one reference is served
  spike         answers after 0.2 s and 0.02 s in turn (a ratio auto must top up), every fifth after 2 s (~40x)
  wide          answers after 0.02 s and 1.0 s in turn: a ratio no number of repeats bounds
`--metrics V` serves /metrics with `refserver_device_memory_bytes V` (V as given: NaN, +Inf, -5e9, 1e30...).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import struct
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ESCAPES = ("\x1b[2J\x1b[31mred\x1b[0m \x1b]8;;https://evil.example/\x1b\\click\x1b]8;;\x1b\\ "
           "<script>alert(1)</script> <img src=x onerror=alert(2)> [click](javascript:alert(3)) "
           "\u202eevil\u202c \x07bell")


NINES = "9" * 400
SITE_FRAMES = ['  File "/venv/lib/python3.12/site-packages/vllm_omni/~~gone~~/worker.py", line 188, in execute_model',
               "    out = self.pipeline(req)",
               '  File "/venv/lib/python3.12/site-packages/vllm_omni/diffusion/__init__.py", line 12, in _x_',
               "    noise_pred = self.transformer(",
               '  File "/venv/lib/python3.12/site-packages/torch/nn/modules/module.py", line 1773, in _call_impl',
               "    return forward_call(*args, **kwargs)"]
OUTER = ['  File "/venv/lib/python3.12/site-packages/vllm_omni/entry.py", line 1, in step', "    x()"]
FULL = ("CUDA out of memory. Tried to allocate 96.00 MiB. GPU 0 has a total capacity of 1.00 GiB of which "
        "20.00 MiB is free. Including non-PyTorch memory, this process has 700.00 MiB memory in use. Of the "
        "allocated memory 650.00 MiB is allocated by PyTorch, and 12.00 MiB is reserved by PyTorch but unallocated.")
OOMS = {  # mode → (exception message, outer frames repeated, line prefix)
    "oom-huge": (f"CUDA out of memory. Tried to allocate {NINES} GiB. GPU 0 has a total capacity of 1.00 GiB", 0, ""),
    "oom-signs": ("CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has a total capacity of 0 B of which "
                  "12345678901234567890 B is free. Including non-PyTorch memory, this process has -2.00 GiB memory "
                  "in use. 1e30 GiB allowed; Of the allocated memory 1.00 MiB is allocated by PyTorch", 0, ""),
    "oom-prefixed": (FULL, 0, "(VllmWorker rank=0 pid=4242) "),
    "oom-prefixed-ansi": (FULL, 0, "\x1b[1;36m(DiffusionWorker pid=4243)\x1b[0;0m "),
    "oom-long": (FULL, 9000, ""),
    "oom-markup": (FULL, 0, ""),
    "load-oom-huge": (f"CUDA out of memory. Tried to allocate {NINES} GiB. GPU 0 has a total capacity of 1 GiB", 0, ""),
    "load-oom-long": (FULL, 700, ""),
    "load-oom-others": (FULL, 0, ""),
}


def oom_traceback(mode: str) -> None:
    message, outer, prefix = OOMS[mode]
    lines = ["Traceback (most recent call last):", *OUTER * outer, *SITE_FRAMES,
             f"torch.OutOfMemoryError: {message}"]
    sys.stderr.write("".join(f"{prefix}{line}\n" for line in lines))
    sys.stderr.flush()


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def png(width: int, height: int) -> bytes:
    """A greyscale PNG written row by row (never the whole raster in memory)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    z, parts, row = zlib.compressobj(9), [], b"\x00" + bytes(width)
    for _ in range(height):
        parts.append(z.compress(row))
    parts.append(z.flush())
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"".join(parts)) + chunk(b"IEND", b"")


def small_png() -> bytes:
    """A 64x64 RGB gradient (passes the sanity checks)."""
    from PIL import Image

    img = Image.new("RGB", (64, 64))
    img.putdata([(x * 4, y * 4, (x + y) * 2) for y in range(64) for x in range(64)])
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


PEAK_MIB = 64.0  # --peak-mib: what the image part says, as vLLM-Omni 0.30 on a GPU does; 0 is its "not measured"


def chat(url: str) -> bytes:
    part = {"type": "image_url", "image_url": {"url": url}, "peak_memory_mb": PEAK_MIB}
    return json.dumps({"choices": [{"message": {"content": [part]}}], "metrics": None}).encode()


def references(body: bytes) -> int:
    """The image parts of a chat request's messages."""
    try:
        messages = json.loads(body)["messages"]
        return sum(1 for m in messages for part in m.get("content") or () if isinstance(part, dict)
                   and part.get("type") == "image_url")
    except (ValueError, KeyError, TypeError, AttributeError):
        return 0


def gzip_bomb(size: int = 256 * 2**20) -> bytes:
    z = zlib.compressobj(1, zlib.DEFLATED, 31)  # gzip container
    block = bytes(2**20)
    return b"".join([*(z.compress(block) for _ in range(size // len(block))), z.flush()])


class Handler(BaseHTTPRequestHandler):
    mode = "ok"
    metrics: str | None = None
    scrapes = 0  # /metrics answers so far; with --metrics a POST waits for the next one (below)
    scraped = threading.Condition()
    posts = 0  # requests answered by this server start
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: object) -> None:  # keep the log for what the modes print
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json", **headers: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers.items():
            self.send_header(k.replace("_", "-"), v)
        self.end_headers()
        self.wfile.write(body)

    def _drip(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body) * 1000))
        self.end_headers()
        while True:
            for b in body:
                self.wfile.write(bytes([b]))
                self.wfile.flush()
                time.sleep(0.5)

    def do_GET(self) -> None:
        if self.path.startswith("/health"):
            if self.mode == "drip-health":
                self._drip(b"ok")
            self._send(200, b"ok", "text/plain")
        elif self.path.startswith("/metrics") and self.metrics is not None:
            text = f"# TYPE refserver_device_memory_bytes gauge\nrefserver_device_memory_bytes {self.metrics}\n"
            self._send(200, text.encode(), "text/plain")
            with Handler.scraped:
                Handler.scrapes += 1
                Handler.scraped.notify_all()
        else:
            self._send(404, b"{}")

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        token = os.environ.get("HF_TOKEN", "")
        mode = self.mode
        Handler.posts += 1
        if self.metrics is not None:
            # The answer waits until the runner's meter has read /metrics twice during the request (the second
            # poll began after the request arrived), 2.5 s at most: the step's window holds a reading by
            # construction, not by where a poll happened to fall (a 26 ms request once held none).
            with Handler.scraped:
                seen = Handler.scrapes
                Handler.scraped.wait_for(lambda: Handler.scrapes >= seen + 2, timeout=2.5)
        if mode == "spike":
            time.sleep(2.0 if Handler.posts % 5 == 0 else 0.2 if Handler.posts % 2 else 0.02)
        elif mode == "wide":
            time.sleep(1.0 if Handler.posts % 2 == 0 else 0.02)
        if mode == "oom-at-2" and references(body) > 1:
            mode = "oom-body"
        if mode == "drip":
            self._drip(chat("data:image/png;base64," + base64.b64encode(small_png()).decode()))
        elif mode == "huge":
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            block = b"A" * 2**20
            try:
                for _ in range(400):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(block), block))
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                pass  # the runner hung up: as it should
        elif mode == "gzip-bomb":
            self._send(200, BOMB, Content_Encoding="gzip")
        elif mode == "bomb":
            self._send(200, BOMB)
        elif mode == "html":
            page = b"<html><body><script>alert(1)</script>not an image</body></html>"
            self._send(200, chat("data:image/png;base64," + base64.b64encode(page).decode()))
        elif mode == "bad-base64":
            self._send(200, chat("data:image/png;base64,!!!this-is*not~base64\x1b[2J"))
        elif mode == "secret":
            log("Traceback (most recent call last):")
            log(f'  File "server.py", line 12, in handle: login(token="{token}")')
            log(f"huggingface_hub.errors.HfHubHTTPError: 401 Client Error for token {token}")
            self._send(500, json.dumps({"error": {"message": f"invalid token {token}", "code": 500}}).encode())
        elif mode == "escapes":
            log(f"ERROR server: {ESCAPES}")
            log(f"RuntimeError: {ESCAPES}")
            self._send(500, json.dumps({"error": {"message": ESCAPES}}).encode())
        elif mode == "hang":
            time.sleep(3600)
        elif mode in OOMS:
            oom_traceback(mode)
            self._send(500, json.dumps({"error": {"message": f"Image generation failed: {OOMS[mode][0]}"}}).encode())
        elif mode == "oom-body":
            self._send(500, json.dumps({"error": {"message": f"Image generation failed: {FULL}"}}).encode())
        else:
            self._send(200, chat("data:image/png;base64," + base64.b64encode(small_png()).decode()))


BOMB = b""


def main() -> None:
    global BOMB, PEAK_MIB
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mode", default="ok")
    p.add_argument("--metrics")
    p.add_argument("--peak-mib", type=float, default=PEAK_MIB)
    a = p.parse_args()
    if a.mode.startswith("load-oom"):
        oom_traceback(a.mode)
        sys.exit(1)
    if a.mode == "load-secret":
        token = os.environ.get("HF_TOKEN", "")
        log("Traceback (most recent call last):")
        log(f"  File \"load.py\", line 3, in <module>: {ESCAPES}")
        log(f"PermissionError: token {token} has no access {ESCAPES}")
        sys.exit(1)
    if a.mode == "gzip-bomb":  # made before the port opens: the request's deadline is for the runner
        BOMB = gzip_bomb()
    elif a.mode == "bomb":
        BOMB = chat("data:image/png;base64," + base64.b64encode(png(12000, 12000)).decode())
    Handler.mode, Handler.metrics, PEAK_MIB = a.mode, a.metrics, a.peak_mib
    log(f"hostile server mode {a.mode} on port {a.port}")
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer(("127.0.0.1", a.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
