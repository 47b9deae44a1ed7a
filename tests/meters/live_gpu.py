"""A "GPU" whose memory is the reference server's own accounting, for watching a real CPU run the way a GPU
host is watched: the NVML sidecar (runner.meters.sidecar, real code) and a dcgm-exporter-shaped endpoint both
read it, so the dashboard's DCGM and sidecar panels draw the run's real memory curve.

The reference server listens on a fixed port the test picks (matrix `port`), which is how the source finds it;
while it is down (loading, between sessions) the sidecar has no sample, and the dcgm endpoint reports an
empty card (0 MiB used), as a real idle GPU would.
"""

from __future__ import annotations

import math
import threading
import time

import httpx
from meters_support import metrics_server
from prometheus_client.parser import text_string_to_metric_families

from runner.meters.base import SourceUnavailable, run_at_rate
from runner.meters.gpu import GpuInfo, GpuProcess, MemorySample

MIB = 1 << 20
UUID = "GPU-7e3a1c55-0b2d-4f6e-9a41-5d8c2b0e9f17"
RESERVED_MIB = 1  # the driver's share of the emulated card, as FB_RESERVED reports it: used + free + reserved = total


class RefserverSource:
    """SampleSource: refserver_device_memory_bytes of the server on `port`, its cap as the total."""

    def __init__(self, port: int, total_bytes: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.total = total_bytes
        self.client = httpx.Client(timeout=1.0)
        self._lock = threading.Lock()

    def info(self) -> GpuInfo:
        return GpuInfo(0, UUID, "refserver (emulated card)", None, self.total, "0")

    def sample(self) -> MemorySample:
        try:
            with self._lock:
                text = self.client.get(self.url).text
        except httpx.HTTPError as exc:
            raise SourceUnavailable(f"{self.url}: {type(exc).__name__}") from None
        for family in text_string_to_metric_families(text):
            if family.name == "refserver_device_memory_bytes" and family.samples:
                return MemorySample(time.time(), int(family.samples[0].value), 0, self.total)
        raise SourceUnavailable(f"{self.url}: no refserver_device_memory_bytes")

    def processes(self) -> tuple[GpuProcess, ...]:
        return ()


class DcgmShapedExporter:
    """dcgm-exporter's exposition for one GPU (its label set, FB fields in MiB), collected every
    `interval_s` like `dcgm-exporter -c 500`. GPU_UTIL and POWER_USAGE are made up (the run records neither):
    util is the used share of the card, power moves every collection, so a panel's value can be told from a
    stale one. `collected` keeps (t, fields) of every collection: what was served."""

    def __init__(self, source: RefserverSource, interval_s: float = 0.5) -> None:
        self.source, self.interval_s = source, interval_s
        self.total_mib = source.total // MIB
        self.collected: list[tuple[float, dict[str, float]]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._collect()
        self._thread = threading.Thread(target=run_at_rate, args=(self._stop, 1 / interval_s, self._collect),
                                        daemon=True)
        self._thread.start()
        self.httpd = metrics_server(self.render)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.httpd.server_address[1]}"

    def _collect(self) -> None:
        try:
            used = math.ceil(self.source.sample().used / MIB)  # DCGM: whole MiB
        except SourceUnavailable:
            used = 0
        with self._lock:
            n = len(self.collected)
            fields = {"DCGM_FI_DEV_FB_USED": used, "DCGM_FI_DEV_FB_FREE": self.total_mib - RESERVED_MIB - used,
                      "DCGM_FI_DEV_FB_RESERVED": RESERVED_MIB,
                      "DCGM_FI_DEV_GPU_UTIL": round(100 * used / self.total_mib),
                      "DCGM_FI_DEV_POWER_USAGE": round(60 + (n % 40) * 2.5, 3)}
            self.collected.append((time.time(), fields))

    def render(self) -> str:
        with self._lock:
            fields = self.collected[-1][1]
        labels = (f'gpu="0",UUID="{UUID}",pci_bus_id="00000000:19:00.0",device="nvidia0",'
                  f'modelName="refserver (emulated card)",Hostname="live-test"')
        lines = []
        for name, value in fields.items():
            lines += [f"# HELP {name} {name}.", f"# TYPE {name} gauge", f"{name}{{{labels}}} {value}"]
        return "\n".join(lines) + "\n"

    def stop(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)
