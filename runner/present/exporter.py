"""The run's own live metrics for Prometheus/Grafana (beside dcgm-exporter and the sidecar): progress,
step outcomes and the newest device-memory reading per card; and, on the same port, the live page for a user
without Grafana (runner.present.livepage: `/` and `/live.json`). Off unless `--metrics-port` is given."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from runner.core.records import SoakRequest, StepRecord
from runner.present.livepage import CSP, PAGE, LiveState, live_json
from runner.run.events import Events, Fanout  # noqa: F401  (Fanout: used by callers via this module)

# How long a connection may keep its handler thread without sending a whole request: a browser or Prometheus
# sends at once; an idle or stalled connection (181 of them held 75 threads, issue 46 L-2) is closed after it.
HANDLER_TIMEOUT_S = 5.0


class RunExporter(Events):
    def __init__(self, run_id: str, port: int, host: str = "127.0.0.1",
                 capacities: dict[str, int] | None = None) -> None:
        self.registry = CollectorRegistry()
        labels = ("run", "card", "flags")
        self.steps = Counter("runner_steps", "Finished steps by outcome", (*labels, "status", "failure"),
                             registry=self.registry)
        self.wall = Histogram("runner_step_seconds", "Request wall time of served steps", labels,
                              buckets=(0.1, 0.5, 1, 2, 5, 10, 20, 40, 60, 120, 300, 600), registry=self.registry)
        self.peak = Gauge("runner_step_peak_bytes", "Device peak of the last step (best available source)",
                          (*labels, "references", "source"), registry=self.registry)
        self.live_memory = Gauge("runner_device_memory_bytes", "Newest device-memory reading", ("run", "card"),
                            registry=self.registry)
        self.session = Gauge("runner_session_active", "1 while a card × flag set session runs", labels,
                             registry=self.registry)
        self.soak = Counter("runner_soak_requests", "Soak requests by outcome", (*labels, "status", "failure"),
                            registry=self.registry)
        self.planned = Gauge("runner_lane_steps_planned", "Steps planned per lane", ("run", "lane"),
                             registry=self.registry)
        self.run_id = run_id
        self.live = LiveState(run_id, capacities)
        self.server = serve(self.registry, self.live, host, port)
        self.thread = threading.Thread(target=self.server.serve_forever, name="run-exporter", daemon=True)
        self.thread.start()

    def lane_started(self, lane: str, cards: tuple[str, ...], total_steps: int) -> None:
        self.planned.labels(self.run_id, lane).set(total_steps)
        self.live.lane_started(lane, cards, total_steps)

    def session_started(self, card: str, flags: str, attempt: int) -> None:
        self.session.labels(self.run_id, card, flags).set(1)
        self.live.session(card, f"{flags}: starting the server" + (f" (attempt {attempt + 1})" if attempt else ""))

    def waiting(self, card: str, text: str) -> None:
        self.live.session(card, text)

    def session_ready(self, card: str, flags: str, ready_s: float | None, why: str | None = None) -> None:
        if ready_s is None:
            self.session.labels(self.run_id, card, flags).set(0)
        self.live.session(card, f"{flags}: serving (ready in {ready_s:.1f} s)" if ready_s is not None
                          else f"{flags}: server did not start" + (f" ({why})" if why else ""))

    def step_done(self, record: StepRecord) -> None:
        self.live.step_done(record)
        failure = record.failure.kind.value if record.failure else ""
        self.steps.labels(self.run_id, record.card, record.flags, record.status.value, failure).inc()
        if record.status == "ok" and record.wall_s is not None:
            self.wall.labels(self.run_id, record.card, record.flags).observe(record.wall_s)
        peak = record.peak("device")
        if peak and peak.bytes is not None:
            labels = (self.run_id, record.card, record.flags, str(record.references), peak.source)
            self.peak.labels(*labels).set(peak.bytes)

    def soak_started(self, card: str, flags: str, done: int, planned: int) -> None:
        self.live.soak_started(card, flags, done, planned)

    def soak_request(self, record: SoakRequest) -> None:
        card, flags = record.key.split("/", 1)
        self.live.soak_request(record)
        failure = record.failure.kind.value if record.failure else ""
        self.soak.labels(self.run_id, card, flags, record.status.value, failure).inc()

    def soak_finished(self, card: str, flags: str, stopped: str | None, line: str | None, sent: int) -> None:
        self.live.soak_finished(card, flags, stopped, line, sent)

    def memory(self, card: str, device_bytes: int | None) -> None:
        if device_bytes is not None:
            self.live_memory.labels(self.run_id, card).set(device_bytes)
            self.live.memory(card, device_bytes)

    def lane_done(self, lane: str) -> None:
        self.live.lane_done(lane)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve(registry: CollectorRegistry, live: LiveState, host: str, port: int) -> ThreadingHTTPServer:
    """/metrics for Prometheus, / and /live.json for a browser; anything else is a 404."""

    class Handler(BaseHTTPRequestHandler):
        timeout = HANDLER_TIMEOUT_S  # the socket's, for every read and write of this connection

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path == "/":
                self._send(PAGE.encode(), "text/html; charset=utf-8")
            elif path == "/live.json":
                self._send(live_json(live), "application/json")
            else:
                self.send_error(404)

        def _send(self, body: bytes, ctype: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Security-Policy", CSP)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # scraped every second: keep stderr quiet
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server
