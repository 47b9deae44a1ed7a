"""Notices when the runner itself did not run for a while (SIGSTOP or Ctrl-Z, then SIGCONT; a frozen VM).

A send timed across such a pause measured the pause, not the server (a 30 s SIGSTOP read as a 30 s request,
above request_timeout_s, counted as latency). A thread wakes every PERIOD_S on the monotonic clock, which
keeps running while the process is stopped; a wake-up more than LATE_S late is a pause, kept as a wall-clock
interval. LATE_S is far above what scheduling on a loaded machine delays a sleeping thread by.
"""

from __future__ import annotations

import threading
import time

PERIOD_S = 0.2
LATE_S = 5.0


class PauseWatch:
    def __init__(self, period_s: float = PERIOD_S, late_s: float = LATE_S) -> None:
        self.period_s, self.late_s = period_s, late_s
        self._pauses: list[tuple[float, float]] = []  # wall-clock (from, to)
        self._last = (time.monotonic(), time.time())
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pause-watch", daemon=True)

    def start(self) -> PauseWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            mono, wall = time.monotonic(), time.time()
            with self._lock:
                last_mono, last_wall = self._last
                if mono - last_mono - self.period_s > self.late_s:
                    self._pauses.append((last_wall + self.period_s, wall))
                self._last = (mono, wall)

    def paused_s(self, t0: float, t1: float) -> float:
        """Seconds of [t0, t1] (wall clock) during which this process was not running: recorded pauses, and
        one that has just ended but the watch thread has not run since (the caller woke first)."""
        with self._lock:
            pauses = list(self._pauses)
            last_mono, last_wall = self._last
        if time.monotonic() - last_mono - self.period_s > self.late_s:
            pauses.append((last_wall + self.period_s, time.time()))
        return sum(max(0.0, min(t1, b) - max(t0, a)) for a, b in pauses)
