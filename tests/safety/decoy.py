"""A stand-in server for the safety tests: answers GET /health with 200, logs every request's path to a file,
holds POST requests open (so a runner waits in a request) or, with --images, answers each with a small PNG
(openai-images dialect) after 0.2 s; may fork a child that outlives it.

    python decoy.py PORT LOGFILE [--fork-child] [--images]
"""

from __future__ import annotations

import base64
import json
import os
import struct
import subprocess
import sys
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT, LOG = int(sys.argv[1]), sys.argv[2]


def _png() -> str:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = b"".join(b"\0" + b"".join(bytes((x * 30, y * 30, 90)) for x in range(8)) for y in range(8))
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 8, 8, 8, 2, 0, 0, 0)) + \
        chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    return base64.b64encode(png).decode()


PNG = _png()


class Handler(BaseHTTPRequestHandler):
    def _log(self) -> None:
        with open(LOG, "a") as f:
            f.write(f"{self.command} {self.path}\n")

    def do_GET(self) -> None:
        self._log()
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def do_POST(self) -> None:
        self._log()
        if "--images" not in sys.argv:
            time.sleep(3600)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        time.sleep(0.2)
        body = json.dumps({"data": [{"b64_json": PNG}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


if "--fork-child" in sys.argv:
    child = subprocess.Popen(["sleep", "300"])
    with open(LOG + ".child", "w") as f:
        f.write(str(child.pid))
server = ThreadingHTTPServer(("127.0.0.1", PORT), Handler)
with open(LOG + ".pid", "w") as f:
    f.write(str(os.getpid()))
server.serve_forever()
