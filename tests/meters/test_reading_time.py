"""A polled reading is stamped when it was asked for, not when it came back: a scrape the server answered before a
short request, and that came back after it on a loaded host, is not the level the request left (a soak's floor
lagged one request behind in a 4-worker suite run, 2026-12-06). Driven: the fake scrape answers with the level at
the moment it was asked, and comes back after the request ended."""

from __future__ import annotations

from collections.abc import Callable

from runner.meters.base import PolledMeter
from tests.meters.test_nvml import FakeClock


class SlowScrape(PolledMeter):
    """A server gauge whose answer comes back `delay_s` after it was asked, with the level at the asking; what
    `in_flight` does (a whole short request) happens while the answer is on its way."""

    def __init__(self, clock: FakeClock, delay_s: float) -> None:
        super().__init__("server", "device", hz=20)
        self.clock = clock  # type: ignore[method-assign]
        self.level, self.delay_s = 10 << 20, delay_s
        self.in_flight: Callable[[], None] = lambda: None

    def read(self) -> int:
        level, asked = self.level, self.clock()
        self.in_flight()
        self.in_flight = lambda: None
        self.clock.t = asked + self.delay_s
        return level


def test_a_scrape_asked_before_a_request_and_back_after_it_is_not_its_floor() -> None:
    clock = FakeClock(1000.0)
    meter = SlowScrape(clock, delay_s=0.05)
    request: dict[str, float] = {}

    def short_request() -> None:  # 30 ms, leaving 2 MiB behind, sent and answered while the scrape is out
        request["sent"] = clock.t = 1000.01
        meter.level = 12 << 20
        request["answered"] = clock.t = 1000.04

    meter.in_flight = short_request
    meter.sample_once()  # asked at 1000.00 (10 MiB), back at 1000.05: inside the quiet window that follows
    clock.t = 1000.10
    meter.sample_once()  # asked in the quiet window: the level the request left
    quiet = (request["answered"], request["answered"] + 0.3)
    floor = meter.window_floor(*quiet)
    assert floor.available and floor.bytes == 12 << 20 and floor.samples == 1, floor
    # the scrape asked before the request says nothing of the request's own window either
    assert not meter.window_peak(request["sent"], request["answered"]).available
