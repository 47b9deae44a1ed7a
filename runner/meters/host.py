"""Host RAM held by the server (process tree RSS for `local`, container usage for `docker`): the evidence
that an offload flag moved memory from VRAM to host DRAM."""

from __future__ import annotations

from runner.backends.base import RunningServer
from runner.meters.base import Meter, PolledMeter, SourceUnavailable, UnavailableMeter
from runner.plan.matrix import Card


class HostMemoryMeter(PolledMeter):
    def __init__(self, server: RunningServer, hz: float) -> None:
        super().__init__("host", "host", hz)
        self.server = server

    def read(self) -> int:
        value = self.server.host_memory_bytes()
        if value is None:
            raise SourceUnavailable("server process not running")
        return value


def build(card: Card, server: RunningServer | None, hz: float) -> Meter:
    """The registry's factory: the server's host RAM, at most 10 Hz."""
    if server is None:
        return UnavailableMeter("host", "host", "no server to measure")
    return HostMemoryMeter(server, hz)
