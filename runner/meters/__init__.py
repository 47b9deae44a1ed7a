"""Meters named in a card's `meters` list → Meter objects for one server start."""

from __future__ import annotations

from runner.backends.base import RunningServer
from runner.matrix import Card
from runner.meters.base import Meter, PolledMeter, Series, SourceUnavailable, UnavailableMeter, peak_of


def build_meters(card: Card, server: RunningServer, hz: float) -> list[Meter]:
    """One meter per name, in the card's order: the first available one is the verdict's source."""
    meters: list[Meter] = []
    for name in card.meters:
        if name == "server":
            from runner.meters.server import ServerMetricsMeter

            meters.append(ServerMetricsMeter(server, min(hz, 20.0)))
        elif name == "host":
            from runner.meters.host import HostMemoryMeter

            meters.append(HostMemoryMeter(server, min(hz, 10.0)))
        else:
            meters.append(UnavailableMeter(name, "device", f"meter '{name}' is not built yet"))
    return meters


__all__ = ["Meter", "PolledMeter", "Series", "SourceUnavailable", "UnavailableMeter", "build_meters",
           "peak_of"]
