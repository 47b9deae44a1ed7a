"""A polled reading is stamped when it was asked for, not when it came back: a scrape the server answered before a
short request, and that came back after it on a loaded host, is not the level the request left (a soak's floor
lagged one request behind in a 4-worker suite run, 2026-12-06). Driven: the fake scrape answers with the level at
the moment it was asked, and comes back after the request ended.

And a quiet window waits for a scrape still on its way: the level after the load was lost where the server's
first scrape after it came back after its quiet window (a starved host, 2026-12-07)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from runner.meters.base import PolledMeter, SourceUnavailable
from runner.plan.lanes import make_plan
from runner.plan.matrix import load_matrix
from runner.run.execute import Baselines, References, RunContext, SessionRunner
from runner.run.store import RunStore
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


class HeldScrape(PolledMeter):
    """A server gauge that fails while the server loads and whose first scrape after it is held until `release`."""

    def __init__(self) -> None:
        super().__init__("server", "device", hz=50)
        self.loading, self.asked, self.release = True, threading.Event(), threading.Event()

    def read(self) -> int:
        if self.loading:
            raise SourceUnavailable("connection refused")
        self.asked.set()
        self.release.wait(10)
        return 10 << 20


class QuietWindows(threading.Event):
    """The run's stop event, whose waits are the quiet windows: the first one passes with the scrape held, the
    next lets it come back and waits for it."""

    def __init__(self, meter: HeldScrape) -> None:
        super().__init__()
        self.meter, self.waits = meter, 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        if self.waits == 1:
            assert self.meter.asked.wait(10), "the scrape after the load was never asked"
        else:
            self.meter.release.set()
            for _ in range(1000):  # at most 10 s
                if self.meter.latest() is not None or super().wait(0.01):
                    break
        return False


def test_the_level_after_the_load_waits_for_a_scrape_still_on_its_way(matrix_dir: Path) -> None:
    matrix = load_matrix(matrix_dir / "matrix.toml")
    plan = make_plan(matrix)
    store = RunStore(matrix_dir / "run")
    meter = HeldScrape()
    windows = QuietWindows(meter)
    ctx = RunContext(matrix=matrix, plan=plan, store=store, run_id="r", stop=windows)
    runner = SessionRunner(ctx, plan.sessions[0], References(), Baselines(matrix, store))
    meter.start()
    try:
        while not meter.provenance()["errors"]:  # it has failed while the server loaded, and read nothing
            threading.Event().wait(0.01)
        meter.loading = False
        (level,) = runner.settle([meter])
    finally:
        meter.release.set()
        meter.stop()
    assert level.available and level.bytes == 10 << 20 and level.samples >= 1, level
    assert windows.waits >= 2  # the window was widened for it
