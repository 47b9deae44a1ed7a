"""Prometheus metrics of the reference server, in a registry of its own."""

from __future__ import annotations

import math
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from runner.refserver.config import RELEASES, ServerConfig
from runner.refserver.engine import AnyEngine

BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, float("inf"))


class Metrics:
    def __init__(self, engine: AnyEngine, config: ServerConfig | None = None) -> None:
        r = self.registry = CollectorRegistry()
        self.scrapes = 0  # /metrics renders so far, for fault scraped
        self._scraped = threading.Condition()
        # vLLM-Omni 0.30's own gauge: the last request's peak, in MB of the allocator's *reserved* memory, per
        # stage (this server has one, "0"). 0.30.0 declares it on every page and sets it only with --log-stats,
        # after a request that measured a peak above 0 (measured): until then the family has no sample.
        self.vllm_peak = None
        self.log_stats = config is not None and config.log_stats
        if config is not None and config.api in RELEASES:
            self.vllm_peak = Gauge("vllm_omni:peak_memory_mb", "Peak GPU memory in MB observed during a "
                                   "stage's generation.", ["model_name", "stage"], registry=r)
            self.model_name = config.model_name
        mem = engine.mem
        self.requests = Counter("refserver_requests", "Generation requests by HTTP status", ["status"],
                                registry=r)
        for status in ("200", "400", "500"):
            self.requests.labels(status=status)
        self.seconds = Histogram("refserver_request_seconds", "Generation request wall time, arrival to "
                                 "response", buckets=BUCKETS, registry=r)
        Gauge("refserver_device_memory_bytes", "Engine device memory in use now (CUDA: "
              "torch.cuda.memory_allocated; CPU: accounted)", registry=r).set_function(mem.current)
        Gauge("refserver_device_memory_peak_bytes", "Peak engine device memory since start",
              registry=r).set_function(lambda: max(mem.lifetime_peak(), mem.current()))
        Gauge("refserver_device_memory_capacity_bytes", "Device memory cap (--vram-gib; CUDA without a cap: "
              "the device total; NaN: no cap)", registry=r).set_function(
            lambda: math.nan if mem.capacity is None else mem.capacity)
        cache = Gauge("refserver_cond_cache_bytes", "Conditioning K/V cache bytes now, by placement (retain's "
                      "kept entries included on the device)", ["placement"], registry=r)
        cache.labels(placement="device").set_function(lambda: engine.cache_bytes["device"] + engine.retained.nbytes)
        cache.labels(placement="host").set_function(lambda: engine.cache_bytes["host"])
        Gauge("refserver_cond_cache_retained_bytes", "Conditioning K/V kept on the device across requests "
              "(--cond-cache retain), now", registry=r).set_function(lambda: engine.retained.nbytes)
        Gauge("refserver_cond_cache_retained_entries", "References whose K/V --cond-cache retain keeps (one per "
              "reference and place in a request)", registry=r).set_function(lambda: len(engine.retained.entries))
        Gauge("refserver_cond_cache_retained_hits", "References of requests so far found kept (--cond-cache "
              "retain)", registry=r).set_function(lambda: engine.retained.hits)
        Gauge("refserver_leaked_bytes", "Device memory requests left behind on purpose (--fault leak)",
              registry=r).set_function(lambda: engine.leaked.nbytes)
        Gauge("refserver_host_pinned_bytes", "Pinned host memory now (host cond cache and offloaded "
              "weights on CUDA, the reusable pinned pool included; always 0 on CPU)", registry=r).set_function(
            lambda: engine.host_pinned_bytes + engine.pinned.nbytes)

    def peak_memory(self, reserved_mb: float) -> None:
        if self.vllm_peak is not None and self.log_stats and reserved_mb > 0:
            self.vllm_peak.labels(model_name=self.model_name, stage="0").set(reserved_mb)

    def observe(self, status: int, seconds: float) -> None:
        self.requests.labels(status=str(status)).inc()
        self.seconds.observe(seconds)

    def render(self) -> bytes:
        with self._scraped:
            self.scrapes += 1
            self._scraped.notify_all()
        return generate_latest(self.registry)

    def wait_for_scrapes(self, count: int, timeout_s: float) -> bool:
        """Block until /metrics has been rendered `count` times in all (fault scraped); False on timeout."""
        with self._scraped:
            return self._scraped.wait_for(lambda: self.scrapes >= count, timeout_s)
