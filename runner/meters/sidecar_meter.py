"""The runner's side of `runner meter`: polls the sidecar's /peak a few times a second.

Each poll returns the maximum of every NVML sample the sidecar took since this meter's previous poll, so
the sidecar's rate (hundreds of Hz), not the poll rate, decides which spikes are caught. The poll rate
only bounds how precisely a peak is placed: a window's peak may include up to one poll period before t0.
window_peak() polls once more when the window ends after the newest poll, so a request's last moments are
never left out. Times are mapped to this host's clock with an offset measured on every poll.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from runner.backends.base import RunningServer
from runner.core.records import Peak
from runner.core.registry import SidecarOptions
from runner.meters.base import Meter, Series, SourceUnavailable, scrape
from runner.meters.idle import IdleBaseline
from runner.observe import bounded, quote
from runner.observe.reading import BadReading, number, to_bytes
from runner.plan.matrix import Card


def _window(d: object) -> dict[str, Any]:
    """The sidecar's /peak answer, every figure checked (reading.py): times finite, bytes real memory
    figures or null, the sample count a count. Anything else is a BadReading: that poll failed."""
    if not isinstance(d, dict):
        raise BadReading("answer is not a JSON object")
    since, until = number(d.get("since"), "since"), number(d.get("until"), "until")
    if until < since:
        raise BadReading(f"window ends ({until}) before it starts ({since})")
    used = None if d.get("used_bytes") is None else to_bytes(d["used_bytes"], "used_bytes")
    reserved = None if d.get("reserved_bytes") is None else to_bytes(d["reserved_bytes"], "reserved_bytes")
    samples = 0 if d.get("samples") is None else number(d["samples"], "samples")
    errors = 0 if d.get("errors") is None else number(d["errors"], "errors")
    t_max = None if d.get("t_max") is None else number(d["t_max"], "t_max")
    available = d.get("available", used is not None)
    reason = d.get("reason")
    return {"since": since, "until": until, "used_bytes": used, "reserved_bytes": reserved,
            "samples": int(min(samples, 2**40)), "errors": int(min(errors, 2**40)), "t_max": t_max,
            "available": bool(available) and used is not None,
            "reason": None if reason is None else quote.console(reason)[:300]}


class SidecarMeter(Meter):
    source = "sidecar"
    metric = "device"

    def __init__(self, url: str, poll_hz: float = 5.0, timeout_s: float = 2.0) -> None:
        self.url = url.rstrip("/")
        self.poll_period = 1.0 / poll_hz
        self.reader = f"runner-{uuid.uuid4().hex[:12]}"
        self.client = bounded.client(timeout=timeout_s)
        self._lock = threading.Lock()  # one /peak at a time: each read resets the sidecar's window
        # one row per successful poll: (start, end, t_max, used, reserved, samples) in this host's clock
        self._rows: list[tuple[float, float, float | None, int | None, int | None, int]] = []
        self._outages: list[tuple[float, float, str]] = []
        self._last_ok: float | None = None
        self._polls = self._errors = 0
        self._last_error: str | None = None
        self._offset: float | None = None  # sidecar clock minus this host's clock
        self._offset_err: float | None = None
        self._info: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started_at: float | None = None

    # -- polling ---------------------------------------------------------------------------------------
    def poll(self) -> None:
        with self._lock:
            t_send = time.time()
            self._polls += 1
            try:  # under the scrape deadline: a dripping or hanging sidecar never holds a step for longer
                response = scrape(self.client, f"{self.url}/peak", params={"reader": self.reader})
                if response.status != 200:
                    raise SourceUnavailable(f"GET {self.url}/peak: HTTP {response.status}")
                d = _window(response.json())
            except (SourceUnavailable, ValueError) as exc:  # BadReading and bad JSON are ValueErrors
                self._errors += 1
                self._last_error = f"GET {self.url}/peak: {quote.console(exc)[:300]}"
                self._outages.append((self._last_ok or t_send, time.time(), self._last_error))
                return
            t_recv = time.time()
            offset, err = d["until"] - (t_send + t_recv) / 2, (t_recv - t_send) / 2
            if self._offset_err is None or err <= self._offset_err * 2:  # keep the tighter estimates
                self._offset, self._offset_err = offset, err
            off = self._offset or 0.0
            if not d["available"]:
                self._last_error = d["reason"] or "sidecar has no samples"
                self._outages.append((d["since"] - off, d["until"] - off, self._last_error))
            elif d["errors"]:
                self._outages.append((d["since"] - off, d["until"] - off,
                                      f"{d['errors']} failed NVML read(s) on the sidecar"))
            t_max = None if d["t_max"] is None else d["t_max"] - off
            self._rows.append((d["since"] - off, d["until"] - off, t_max, d["used_bytes"],
                               d["reserved_bytes"], d["samples"]))
            self._last_ok = t_recv

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_period):
            self.poll()

    def start(self) -> None:
        self._started_at = time.time()
        try:
            info = scrape(self.client, f"{self.url}/info").json()
            if not isinstance(info, dict):
                raise ValueError("answer is not a JSON object")
            self._info = {k: (v if isinstance(v, (int, float, type(None))) else quote.console(v)[:200])
                          for k, v in info.items() if isinstance(k, str)}
        except (SourceUnavailable, ValueError) as exc:
            self._last_error = f"GET {self.url}/info: {type(exc).__name__}: {quote.console(exc)[:200]}"
        self.poll()  # opens this reader's window on the sidecar
        self._thread = threading.Thread(target=self._loop, name="meter-sidecar", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        if self._thread is not None and not self.client.is_closed:
            self.poll()  # the tail since the last poll
            self.client.close()

    # -- answers ---------------------------------------------------------------------------------------
    def window_peak(self, t0: float, t1: float) -> Peak:
        with self._lock:
            newest = self._rows[-1][1] if self._rows else None
        if not self._stop.is_set() and (newest is None or newest < t1):
            self.poll()
        with self._lock:
            rows = [r for r in self._rows if r[1] >= t0 and r[0] <= t1 and r[3] is not None]
            outage = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b, _ in self._outages)
        if not rows:
            return Peak(source=self.source, metric=self.metric, bytes=None, samples=0, rate_hz=None, available=False,
                        reason=f"no sidecar samples in window ({self._last_error or 'sidecar silent'})")
        samples = sum(r[5] for r in rows)
        covered = max(r[1] for r in rows) - min(r[0] for r in rows)
        reason = None
        if outage > 0:
            reason = f"partial: sidecar unavailable for {outage:.2f} s of {t1 - t0:.2f} s ({self._last_error})"
        return Peak(source=self.source, metric=self.metric, bytes=max(r[3] for r in rows if r[3] is not None),
                    samples=samples,
                    rate_hz=round(samples / max(covered, 1e-9), 2), available=True, reason=reason)

    def series(self) -> Series:
        with self._lock:
            pts = [((r[2] if r[2] is not None else r[1]), r[3]) for r in self._rows if r[3] is not None]
        pts.sort()
        return Series(self.source, self.metric, tuple(p[0] for p in pts), tuple(int(p[1]) for p in pts))

    def latest(self) -> int | None:
        with self._lock:
            return next((r[3] for r in reversed(self._rows) if r[3] is not None), None)

    def provenance(self) -> dict[str, Any]:
        with self._lock:
            n = sum(r[5] for r in self._rows)
            have = any(r[3] is not None for r in self._rows)
            outages = [(round(a, 3), round(b, 3), why) for a, b, why in self._outages]
            reserved = [r[4] for r in self._rows if r[4] is not None]
        info = self._info or {}
        return {"source": self.source, "metric": self.metric, "available": have,
                "reason": None if have else (self._last_error or "no samples"), "samples": n,
                "url": self.url, "reader": self.reader, "gpu": info.get("gpu"),
                "target_hz": info.get("target_hz"), "sidecar_achieved_hz": info.get("achieved_hz"),
                "poll_hz": round(1 / self.poll_period, 2), "polls": self._polls, "errors": self._errors,
                "last_error": self._last_error, "edge_slack_s": self.poll_period,
                "clock_offset_s": None if self._offset is None else round(self._offset, 4),
                "clock_offset_err_s": None if self._offset_err is None else round(self._offset_err, 4),
                "reserved_bytes": {"min": min(reserved), "max": max(reserved)} if reserved else None,
                "outages": outages}


def _url(card: Card) -> str:
    options = card.meter_options["sidecar"]
    assert isinstance(options, SidecarOptions), "the registry pairs the sidecar with SidecarOptions"
    return options.sidecar_url


def build(card: Card, server: RunningServer | None, hz: float) -> Meter:
    """The registry's factory: polls the card's sidecar at `hz` (clamped to 2–10 Hz there)."""
    url = server.meter_url("sidecar")[0] if server is not None else None
    return SidecarMeter(url or _url(card), poll_hz=hz)


def idle(card: Card) -> IdleBaseline:
    """The idle baseline the sidecar takes on the GPU's own host (its figures checked like readings)."""
    url = _url(card).rstrip("/") + "/idle"
    try:
        with bounded.client() as client:
            response = scrape(client, url)
        if response.status != 200:
            raise SourceUnavailable(f"GET {url}: HTTP {response.status}")
        found = IdleBaseline.from_json(response.content)
        for name in ("used_bytes", "reserved_bytes", "total_bytes"):
            if getattr(found, name) is not None:
                to_bytes(getattr(found, name), f"sidecar /idle {name}")
        return found
    except SourceUnavailable as exc:
        return IdleBaseline("sidecar", False, str(exc))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # BadReading is a ValueError
        return IdleBaseline("sidecar", False, f"GET {url}: {type(exc).__name__}: {quote.console(exc)[:200]}")
