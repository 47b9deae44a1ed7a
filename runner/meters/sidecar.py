"""`runner meter`: an NVML sampler that lives on a remote GPU host and keeps every peak for its readers.

It samples at hundreds of Hz beside the GPU and answers over HTTP:
  GET /peak[?reader=ID]  the maximum since this reader's last /peak (then resets): no peak between two polls
                         is lost, however slowly the runner polls
  GET /now               the newest sample
  GET /info              GPU (index, UUID, name, driver, total), target and achieved rate
  GET /idle              an idle baseline: memory now and the processes holding the GPU
  GET /metrics           Prometheus text (gauges now and max since the last scrape, its own reader)
Readers are independent, so the runner, Prometheus and a person with curl do not steal each other's
peaks. It listens on 127.0.0.1 unless told otherwise (`--host`): reach it through an SSH tunnel, or bind it
to the LAN address deliberately.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from runner.meters.base import SourceUnavailable, run_at_rate
from runner.meters.gpu import MemorySample, ReplaySource, SampleSource
from runner.meters.idle import measure_idle

READER_TTL_S = 600.0  # a reader silent this long is forgotten (one per runner session)


@dataclass
class _Window:
    since: float
    samples: int = 0
    errors: int = 0
    used: int | None = None
    reserved: int | None = None
    t_max: float | None = None
    touched: float = 0.0


class PeakTracker:
    """Per-reader maxima since each reader's last read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._windows: dict[str, _Window] = {}
        self.latest: MemorySample | None = None
        self.samples = 0
        self.errors = 0
        self.last_error: str | None = None

    def add(self, s: MemorySample) -> None:
        with self._lock:
            self.latest = s
            self.samples += 1
            for w in self._windows.values():
                w.samples += 1
                if w.used is None or s.used > w.used:
                    w.used, w.reserved, w.t_max = s.used, s.reserved, s.t

    def error(self, reason: str) -> None:
        with self._lock:
            self.errors += 1
            self.last_error = reason
            for w in self._windows.values():
                w.errors += 1

    def read(self, reader: str) -> dict[str, Any]:
        """The reader's window [since, until] and its maximum; a new window starts now."""
        now = time.time()
        with self._lock:
            for name in [n for n, w in self._windows.items() if now - w.touched > READER_TTL_S]:
                del self._windows[name]
            w = self._windows.get(reader)
            if w is None:  # first contact: the window is the newest sample alone
                s = self.latest
                w = _Window(since=s.t if s else now, samples=1 if s else 0, used=s.used if s else None,
                            reserved=s.reserved if s else None, t_max=s.t if s else None)
            self._windows[reader] = _Window(since=now, touched=now)
            return {"reader": reader, "since": w.since, "until": now, "samples": w.samples, "errors": w.errors,
                    "used_bytes": w.used, "reserved_bytes": w.reserved, "t_max": w.t_max,
                    "available": w.used is not None,
                    "reason": None if w.used is not None else (self.last_error or "no samples yet")}


class Sampler:
    """Reads the source at `hz` in a thread; a failing read is counted, never turned into a zero."""

    def __init__(self, source: SampleSource, hz: float) -> None:
        self.source, self.hz = source, hz
        self.tracker = PeakTracker()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sidecar-sampler", daemon=True)
        self.started_at = time.time()

    def start(self) -> None:
        self.started_at = time.time()
        self._thread.start()

    def sample_once(self) -> None:
        try:
            self.tracker.add(self.source.sample())
        except SourceUnavailable as exc:
            self.tracker.error(str(exc))
        except Exception as exc:  # keep sampling: the next read may work
            self.tracker.error(f"{type(exc).__name__}: {exc}")

    def _loop(self) -> None:
        run_at_rate(self._stop, self.hz, self.sample_once)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def info(self) -> dict[str, Any]:
        span = max(time.time() - self.started_at, 1e-9)
        return {"gpu": self.source.info().to_json(), "source": type(self.source).__name__,
                "target_hz": self.hz, "achieved_hz": round(self.tracker.samples / span, 2),
                "samples": self.tracker.samples, "errors": self.tracker.errors,
                "last_error": self.tracker.last_error, "started_at": self.started_at}


def metrics_text(sampler: Sampler) -> str:
    """Prometheus exposition of the sidecar's own gauges (names checked by the dashboard test)."""
    gpu = sampler.source.info()
    labels = f'UUID="{gpu.uuid or ""}",gpu="{"" if gpu.index is None else gpu.index}"'
    peak = sampler.tracker.read("prometheus")
    now = sampler.tracker.latest
    lines = []

    def gauge(name: str, help_: str, value: float | None) -> None:
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} gauge"])
        if value is not None:  # an absent sample, not a 0, when there is no reading
            lines.append(f"{name}{{{labels}}} {value}")

    gauge("runner_sidecar_memory_used_bytes", "NVML v2 used bytes, newest sample.", None if now is None else now.used)
    gauge("runner_sidecar_memory_reserved_bytes", "NVML v2 driver-reserved bytes, newest sample.",
          None if now is None else now.reserved)
    gauge("runner_sidecar_memory_used_max_bytes", "Maximum NVML used bytes since the previous scrape.",
          peak["used_bytes"])
    gauge("runner_sidecar_sample_rate_hz", "Achieved NVML sample rate.", sampler.info()["achieved_hz"])
    lines.extend(["# HELP runner_sidecar_samples_total NVML samples taken.",
                  "# TYPE runner_sidecar_samples_total counter",
                  f"runner_sidecar_samples_total{{{labels}}} {sampler.tracker.samples}"])
    return "\n".join(lines) + "\n"


def make_server(sampler: Sampler, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            query = parse_qs(url.query)
            if url.path == "/peak":
                payload: Any = sampler.tracker.read(query.get("reader", ["default"])[0])
            elif url.path == "/now":
                s = sampler.tracker.latest
                payload = {"available": s is not None, "reason": None if s else sampler.tracker.last_error,
                           "t": s and s.t, "used_bytes": s and s.used, "reserved_bytes": s and s.reserved,
                           "total_bytes": s and s.total}
            elif url.path == "/info":
                payload = sampler.info()
            elif url.path == "/idle":
                payload = measure_idle(sampler.source, "sidecar").to_json()
            elif url.path == "/metrics":
                self._send(200, metrics_text(sampler).encode(), "text/plain; version=0.0.4")
                return
            else:
                self._send(404, b'{"error": "unknown path"}')
                return
            self._send(200, json.dumps(payload).encode())

        def log_message(self, format: str, *args: Any) -> None:  # polled at several Hz: keep stderr quiet
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


class Sidecar:
    """Sampler + HTTP server in background threads (tests and embedding); `main` is the CLI around it."""

    def __init__(self, source: SampleSource, hz: float = 500.0, host: str = "127.0.0.1", port: int = 0) -> None:
        self.sampler = Sampler(source, hz)
        self.httpd = make_server(self.sampler, host, port)
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="sidecar-http", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        if isinstance(host, bytes):  # typeshed's address allows an AF_UNIX path; this server's is an INET host
            host = host.decode()
        return f"http://{host}:{port}"

    def start(self) -> Sidecar:
        self.sampler.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.sampler.stop()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="runner meter", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True, help="port to serve on (0: any free one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--gpu", default=None, help="GPU UUID or index (default: the only GPU)")
    parser.add_argument("--hz", type=float, default=500.0, help="NVML sample rate (default 500)")
    parser.add_argument("--fake-replay", type=Path, default=None,
                        help="replay `offset_s used [reserved]` lines instead of NVML (tests, demos)")
    parser.add_argument("--loop", action="store_true", help="with --fake-replay: start over at the end")
    args = parser.parse_args(argv)
    if args.hz < 1:
        parser.error("--hz must be at least 1")
    if args.fake_replay is not None:
        source: SampleSource = ReplaySource(args.fake_replay, loop=args.loop)
    else:
        from runner.meters.nvml import open_source

        try:
            source = open_source(args.gpu or None)  # "": the step had no GPU named
        except SourceUnavailable as exc:
            print(f"runner meter: {exc}", file=sys.stderr)
            return 2
    sidecar = Sidecar(source, args.hz, args.host, args.port).start()
    gpu = source.info()
    print(f"runner meter: serving {sidecar.url} (GPU {gpu.uuid} {gpu.name}, {args.hz:g} Hz)", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    sidecar.stop()
    return 0
