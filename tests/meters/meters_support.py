"""Helpers for the meter tests: a dcgm-exporter replay on 127.0.0.1 and a real Prometheus beside it.

(A uniquely named module, not a package: tests/ has no __init__.py.)"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from tests.ports import free_port

FIXTURES = Path(__file__).parent / "fixtures"
GPU0_UUID = "GPU-4f9b6c2e-8a1d-3e57-b0c4-9d2e71a5f836"
MIB = 1 << 20
TOTAL_MIB, RESERVED_MIB = 143771, 615


def recorded_series() -> list[int]:
    """FB_USED MiB of the recorded session, one value per collection."""
    rows = [ln.split(",") for ln in (FIXTURES / "dcgm_series_h200.csv").read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]
    return [int(r[1]) for r in rows]


def _set(text: str, metric: str, gpu: str, value: str) -> str:
    pattern = re.compile(rf'^({metric}\{{[^}}]*gpu="{gpu}"[^}}]*\}}) \S+$', re.M)
    return pattern.sub(lambda m: f"{m.group(1)} {value}", text)


def metrics_server(render: Callable[[], str]) -> ThreadingHTTPServer:
    """An exporter on a free 127.0.0.1 port answering every GET with render()'s exposition text."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = render().encode()
            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # a scraper that gave up (its timeout, under load) is not the exporter's error

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


class ReplayExporter:
    """Serves the recorded dcgm-exporter scrape with GPU 0's FB values taken from a series.

    per_scrape: each GET advances one row (Prometheus, the only scraper, then sees every value once);
    otherwise the row is chosen by elapsed time / interval_s, like an exporter collecting every interval_s.
    """

    def __init__(self, values: list[int], *, per_scrape: bool, interval_s: float = 1.0,
                 template: str = "dcgm_h200_Hostname.prom") -> None:
        self.values, self.per_scrape, self.interval_s = values, per_scrape, interval_s
        self.template = (FIXTURES / template).read_text()
        self.served: list[tuple[float, int]] = []
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self.stopped = False
        self.httpd = metrics_server(self.render)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/metrics"

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.httpd.server_address[1]}"

    def render(self) -> str:
        with self._lock:
            if self.per_scrape:
                i = min(len(self.served), len(self.values) - 1)
            else:
                i = min(int((time.monotonic() - self._t0) / self.interval_s), len(self.values) - 1)
            used = self.values[i]
            self.served.append((time.time(), used))
        text = _set(self.template, "DCGM_FI_DEV_FB_USED", "0", str(used))
        text = _set(text, "DCGM_FI_DEV_FB_FREE", "0", str(TOTAL_MIB - RESERVED_MIB - used))
        return _set(text, "DCGM_FI_DEV_POWER_USAGE", "0", f"{100 + i * 37.5:.3f}")  # moves every collection

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.httpd.shutdown()
            self.httpd.server_close()


class PrometheusServer:
    def __init__(self, tmp: Path, targets: list[str], scrape_s: float = 1.0,
                 jobs: dict[str, list[str]] | None = None) -> None:
        """`targets` for one job `dcgm`, or `jobs`: job name → its targets (the names monitoring/ uses)."""
        self.port = free_port()
        config = tmp / "prometheus.yml"
        jobs = jobs if jobs is not None else {"dcgm": targets}
        config.write_text(
            "global:\n"
            f"  scrape_interval: {round(scrape_s * 1000)}ms\n"
            f"  scrape_timeout: {round(scrape_s * 1000)}ms\n"
            "scrape_configs:\n"
            + "".join(f"  - job_name: {name}\n"
                      "    static_configs:\n"
                      f"      - targets: [{', '.join(repr(t) for t in tt)}]\n" for name, tt in jobs.items())
        )
        self.log = (tmp / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.proc.returncode}: {(tmp / 'prometheus.log').read_text()}")
            try:
                if httpx.get(self.url + "/-/ready", timeout=0.5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("prometheus did not become ready in 20 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # our own child, by its handle
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


