"""Server-reported device memory: a gauge scraped from the server's own /metrics (the reference server
exports `refserver_device_memory_bytes`; vLLM-Omni exports none, which is recorded as such)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from runner.backends.base import RunningServer
from runner.meters.base import PolledMeter, SourceUnavailable, fetch_text

DEVICE_GAUGES = ("refserver_device_memory_bytes",)


def gauge_value(text: str, names: tuple[str, ...]) -> float | None:
    for family in text_string_to_metric_families(text):
        if family.name in names and family.samples:
            return max(s.value for s in family.samples)
    return None


class ServerMetricsMeter(PolledMeter):
    def __init__(self, server: RunningServer, hz: float) -> None:
        super().__init__("server", "device", hz)
        self.server = server
        self.client = httpx.Client(timeout=2.0)
        self.absent: str | None = None  # set once the server answered without any memory gauge

    @property
    def url(self) -> str:
        return self.server.base_url + "/metrics"  # read late: a container's port is known only once started

    def read(self) -> int:
        if self.absent:  # a server that answers without the gauge will not grow one: stop asking it
            raise SourceUnavailable(self.absent)
        text = fetch_text(self.client, self.url)
        value = gauge_value(text, DEVICE_GAUGES)
        if value is None:
            self.absent = f"{self.url} exports no device-memory gauge ({', '.join(DEVICE_GAUGES)})"
            raise SourceUnavailable(self.absent)
        return int(value)

    def stop(self) -> None:
        super().stop()
        self.client.close()
