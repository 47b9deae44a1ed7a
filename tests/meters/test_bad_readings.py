"""Issue 18 item 1: a bad meter reading never crashes the run nor becomes a peak, and a dripping or hanging
meter never stalls a step. Each meter is driven against a fake endpoint on 127.0.0.1 that answers what a
broken exporter answers: NaN and +Inf (valid Prometheus values), strings, wrong shapes, values ≥ 2^63 bytes,
negative values; or one byte every half second."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from runner.meters.base import PolledMeter, SourceUnavailable
from runner.meters.dcgm import DcgmMeter
from runner.meters.prometheus import PrometheusMeter
from runner.meters.server import ServerMetricsMeter
from runner.meters.sidecar_meter import SidecarMeter
from runner.run import dialects

MIB = 2**20
BAD_NUMBERS = ["NaN", "+Inf", "-Inf", "-5000", "1e30", "9.3e15"]  # MiB: the last two are ≥ 2^63 bytes and ≥ 1 PiB


class Endpoint:
    """A stdlib HTTP server whose answer to any GET is `answer(path) -> (status, body)`; `drip` sends the
    body one byte every 0.5 s instead."""

    def __init__(self, answer: Callable[[str], tuple[int, bytes]], drip: bool = False) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                status, body = outer.answer(self.path)
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    if outer.drip:
                        for b in body:
                            self.wfile.write(bytes([b]))
                            self.wfile.flush()
                            time.sleep(0.5)
                    else:
                        self.wfile.write(body)
                except OSError:
                    pass

            def log_message(self, *args: object) -> None:
                pass

        self.answer, self.drip = answer, drip
        ThreadingHTTPServer.daemon_threads = True
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def endpoint() -> Iterator[Callable[..., Endpoint]]:
    made: list[Endpoint] = []

    def make(answer: Callable[[str], tuple[int, bytes]], drip: bool = False) -> Endpoint:
        made.append(Endpoint(answer, drip))
        return made[-1]

    yield make
    for e in made:
        e.stop()


def within(seconds: float, call: Callable[[], object]) -> object:
    """call() on a thread; fails the test (instead of hanging it) when it takes longer than `seconds`."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s"
    assert time.monotonic() - t0 < seconds
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")


class Scripted(PolledMeter):
    extra_metrics = ("reserved",)

    def __init__(self, readings: list[object]) -> None:
        super().__init__("scripted", "device", 10)
        self.readings = readings

    def read(self) -> int:
        raise AssertionError("read_many is the scripted one")

    def read_many(self) -> tuple[int, ...]:
        return self.readings.pop(0)  # type: ignore[return-value]


def test_polled_meter_keeps_only_real_readings_and_its_columns_stay_aligned() -> None:
    good = (1000 * MIB, 10 * MIB)
    m = Scripted([(math.nan, 1), (math.inf, 1), ("123", 1), (2**63, 1), (-5000 * MIB, 1), (1, 2**64), (True, 1),
                  (5,), (5, 6, 7), good])
    for _ in range(10):
        m.sample_once()
    series, (reserved,) = m.series(), m.extra_series()
    assert series.value == (good[0],) and reserved.value == (good[1],) and len(series.t) == len(reserved.t) == 1
    peak = m.window_peak(0, time.time() + 1)
    assert peak.available and peak.bytes == good[0]
    assert m.provenance()["errors"] == 9


@pytest.mark.parametrize("value", BAD_NUMBERS)
def test_dcgm_meter_refuses_a_bad_framebuffer_figure(endpoint: Callable[..., Endpoint], value: str) -> None:
    page = (f'DCGM_FI_DEV_FB_USED{{gpu="0",UUID="GPU-a"}} {value}\n'
            f'DCGM_FI_DEV_FB_FREE{{gpu="0",UUID="GPU-a"}} 100\n').encode()
    e = endpoint(lambda path: (200, page))
    m = DcgmMeter(e.url, "GPU-a", 10)
    with pytest.raises(SourceUnavailable):
        m.read()
    m.sample_once()
    assert m.series().value == () and not m.window_peak(0, time.time() + 1).available


@pytest.mark.parametrize("value", BAD_NUMBERS)
def test_server_gauge_refuses_a_bad_figure(endpoint: Callable[..., Endpoint], value: str) -> None:
    page = f"# TYPE refserver_device_memory_bytes gauge\nrefserver_device_memory_bytes {value}\n".encode()
    e = endpoint(lambda path: (200, page))

    class Server:
        base_url = e.url

    m = ServerMetricsMeter(Server(), 10)  # type: ignore[arg-type]
    m.sample_once()
    assert m.series().value == () and not m.window_peak(0, time.time() + 1).available


def _prometheus(value: object, shape: str = "vector") -> bytes:
    if shape == "vector":
        result: object = [{"metric": {"gpu": "0"}, "value": [time.time(), value]}]
    elif shape == "string-result":
        result = "oops"
    elif shape == "no-value":
        result = [{"metric": {"gpu": "0"}}]
    else:
        result = [{"metric": {"gpu": "0"}, "value": value}]
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode()


@pytest.mark.parametrize(("value", "shape"), [*((v, "vector") for v in ["NaN", "+Inf", "-5000", "1e30", "abc"]),
                                              (5, "vector"), ("1", "string-result"), ("1", "no-value"),
                                              ("1", "flat")])
def test_prometheus_meter_refuses_bad_values_and_shapes(endpoint: Callable[..., Endpoint], value: object,
                                                       shape: str) -> None:
    e = endpoint(lambda path: (200, _prometheus(value, shape)))
    m = PrometheusMeter(e.url, "0", settle_s=0)
    m.start()
    peak = m.window_peak(time.time() - 1, time.time())
    assert not peak.available and peak.bytes is None and peak.reason
    m.stop()
    assert m.series().value == ()


def _sidecar(**over: object) -> bytes:
    now = time.time()
    return json.dumps({"since": now - 0.2, "until": now, "t_max": now - 0.1, "used_bytes": 1000 * MIB,
                       "reserved_bytes": None, "samples": 20, "available": True, "errors": 0, **over}).encode()


@pytest.mark.parametrize("over", [{"used_bytes": -5000 * MIB}, {"used_bytes": "123"}, {"used_bytes": 2**64},
                                  {"used_bytes": float("nan")}, {"since": "yesterday"}, {"samples": "many"},
                                  {"until": None}])
def test_sidecar_meter_refuses_a_bad_window(endpoint: Callable[..., Endpoint], over: dict[str, object]) -> None:
    e = endpoint(lambda path: (200, b"{}" if path.startswith("/info") else _sidecar(**over)))
    m = SidecarMeter(e.url, poll_hz=50)
    t0 = time.time()
    m.start()
    time.sleep(0.1)
    m.stop()
    peak = m.window_peak(t0, time.time())
    assert not peak.available and peak.bytes is None
    assert m.series().value == ()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -5000, 1e300, "512", True])
def test_a_response_peak_that_is_no_memory_figure_is_no_peak(value: object) -> None:
    assert dialects.server_peak({"peak_memory_mb": value}) is None
    assert dialects.server_peak({"metrics": {"peak_memory_mb": value}}) is None
    assert dialects.server_peak({"peak_memory_mb": 512.5}) is not None


BOUND_S = 2.0 + 2.5  # meters.base.SCRAPE_S plus slack for a loaded machine; a drip would take minutes


def test_dripping_dcgm_and_server_scrapes_end_at_their_deadline(endpoint: Callable[..., Endpoint]) -> None:
    page = b'DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-a"} 100\n' * 20
    e = endpoint(lambda path: (200, page), drip=True)
    m = DcgmMeter(e.url, "GPU-a", 10)
    with pytest.raises(SourceUnavailable, match="Overdue"):
        within(BOUND_S, m.read)

    class Server:
        base_url = e.url

    s = ServerMetricsMeter(Server(), 10)  # type: ignore[arg-type]
    within(BOUND_S, s.sample_once)
    assert s.series().value == ()


def test_dripping_sidecar_and_prometheus_never_hold_a_step(endpoint: Callable[..., Endpoint]) -> None:
    e = endpoint(lambda path: (200, _sidecar() if path.startswith("/peak") else _prometheus("100")), drip=True)
    side = SidecarMeter(e.url, poll_hz=5)
    within(2 * BOUND_S, side.start)  # /info and the first /peak
    t0 = time.time()
    peak = within(BOUND_S, lambda: side.window_peak(t0, time.time()))
    assert not peak.available  # type: ignore[attr-defined]
    within(2 * BOUND_S, side.stop)
    prom = PrometheusMeter(e.url, "0", settle_s=0)
    prom.start()
    peak = within(2 * BOUND_S, lambda: prom.window_peak(time.time() - 1, time.time()))  # two queries
    assert not peak.available  # type: ignore[attr-defined]
