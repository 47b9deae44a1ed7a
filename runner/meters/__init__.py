"""Meters named in a card's `meters` list → Meter objects for one server start."""

from __future__ import annotations

from runner.backends.base import RunningServer
from runner.matrix import Card
from runner.meters.base import Meter, PolledMeter, Series, SourceUnavailable, UnavailableMeter, peak_of
from runner.meters.idle import IdleBaseline, idle_baseline


def build_meter(name: str, card: Card, server: RunningServer | None, hz: float) -> Meter:
    """One meter; a source that cannot run here is an UnavailableMeter with the reason, never a zero."""
    if name == "server":
        from runner.meters.server import ServerMetricsMeter

        return ServerMetricsMeter(server, min(hz, 20.0))
    if name == "host":
        from runner.meters.host import HostMemoryMeter

        return HostMemoryMeter(server, min(hz, 10.0))
    if name == "nvml":
        from runner.meters.nvml import NvmlMeter, nvml_hz, open_source

        try:
            return NvmlMeter(open_source(card.gpu), nvml_hz(hz), server)
        except SourceUnavailable as exc:
            return UnavailableMeter("nvml", "device", str(exc))
    if name == "sidecar":
        if not card.sidecar_url:
            return UnavailableMeter("sidecar", "device", "card has no sidecar_url")
        from runner.meters.sidecar_meter import SidecarMeter

        return SidecarMeter(card.sidecar_url, poll_hz=min(max(hz, 2.0), 10.0))
    if name == "dcgm":
        if not card.dcgm_url:
            return UnavailableMeter("dcgm", "device", "card has no dcgm_url")
        from runner.meters.dcgm import DcgmMeter

        return DcgmMeter(card.dcgm_url, card.gpu, min(hz, 10.0))
    if name == "prometheus":
        if not card.prometheus_url:
            return UnavailableMeter("prometheus", "device", "card has no prometheus_url")
        from runner.meters.prometheus import PrometheusMeter

        return PrometheusMeter(card.prometheus_url, card.gpu)
    return UnavailableMeter(name, "device", f"unknown meter '{name}'")


def build_meters(card: Card, server: RunningServer, hz: float) -> list[Meter]:
    """One meter per name, in the card's order: the first available one is the verdict's source."""
    return [build_meter(name, card, server, hz) for name in card.meters]


__all__ = ["IdleBaseline", "Meter", "PolledMeter", "Series", "SourceUnavailable", "UnavailableMeter",
           "build_meter", "build_meters", "idle_baseline", "peak_of"]
