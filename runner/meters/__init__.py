"""Meters named in a card's `meters` list → Meter objects for one server start, through runner.core.registry."""

from __future__ import annotations

from runner.backends.base import RunningServer
from runner.core.registry import METERS, load
from runner.meters.base import Meter, PolledMeter, Series, SourceUnavailable, UnavailableMeter
from runner.meters.idle import IdleBaseline, idle_baseline
from runner.plan.matrix import Card


def build_meter(name: str, card: Card, server: RunningServer | None, hz: float) -> Meter:
    """One meter, at the run's rate clamped to the entry's limits; a source that cannot run here is an
    UnavailableMeter with the reason, never a zero."""
    if name not in METERS or METERS.get(name).factory is None:
        return UnavailableMeter(name, "device", f"unknown meter '{name}'")
    entry = METERS.get(name)
    provided = server.meter_url(name) if server is not None else (None, None)
    if provided != (None, None):
        url, why = provided
        if url is None:
            return UnavailableMeter(name, entry.metric, why or "the backend's meter did not start")
    elif entry.options is not None and name not in card.meter_options:
        return UnavailableMeter(name, entry.metric, f"card has no {', '.join(entry.options.model_fields)}")
    meter: Meter = load(entry.factory or "")(card, server, entry.clamp(hz))
    return meter


def build_meters(card: Card, server: RunningServer, hz: float) -> list[Meter]:
    """One meter per name, in the card's order: the first available one is the verdict's source."""
    return [build_meter(name, card, server, hz) for name in card.meters]


__all__ = ["IdleBaseline", "Meter", "PolledMeter", "Series", "SourceUnavailable", "UnavailableMeter",
           "build_meter", "build_meters", "idle_baseline"]
