"""The run's own live metrics for Prometheus/Grafana (beside dcgm-exporter and the sidecar): progress,
step outcomes and the newest device-memory reading per card. Off unless `--metrics-port` is given."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from runner.core.records import StepRecord
from runner.run.events import Events, Fanout  # noqa: F401  (Fanout: used by callers via this module)


class RunExporter(Events):
    def __init__(self, run_id: str, port: int, host: str = "127.0.0.1") -> None:
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
        self.planned = Gauge("runner_lane_steps_planned", "Steps planned per lane", ("run", "lane"),
                             registry=self.registry)
        self.run_id = run_id
        self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)

    def lane_started(self, lane: str, cards: tuple[str, ...], total_steps: int) -> None:
        self.planned.labels(self.run_id, lane).set(total_steps)

    def session_started(self, card: str, flags: str, attempt: int) -> None:
        self.session.labels(self.run_id, card, flags).set(1)

    def session_ready(self, card: str, flags: str, ready_s: float | None, why: str | None = None) -> None:
        if ready_s is None:
            self.session.labels(self.run_id, card, flags).set(0)

    def step_done(self, record: StepRecord) -> None:
        failure = record.failure.kind.value if record.failure else ""
        self.steps.labels(self.run_id, record.card, record.flags, record.status.value, failure).inc()
        if record.status == "ok" and record.wall_s is not None:
            self.wall.labels(self.run_id, record.card, record.flags).observe(record.wall_s)
        peak = record.peak("device")
        if peak and peak.bytes is not None:
            labels = (self.run_id, record.card, record.flags, str(record.references), peak.source)
            self.peak.labels(*labels).set(peak.bytes)

    def memory(self, card: str, device_bytes: int | None) -> None:
        if device_bytes is not None:
            self.live_memory.labels(self.run_id, card).set(device_bytes)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
