"""Injected faults: load-time and per-request."""

from __future__ import annotations

import base64
import io
import json
import socket
import time

import httpx
import numpy as np
import pytest
from PIL import Image
from refserver_helpers import Server, chat_body, chat_pngs, decode

from runner.refserver.faults import FaultPlan


@pytest.fixture(scope="session")
def fault_replies(fleet: dict[str, Server]) -> dict[str, httpx.Response]:
    """Requests 1..5 on the faults server, in order (each fault names its request number)."""
    s = fleet["faults"].ready()
    kinds = ["malformed-json", "no-image", "wrong-size", "transparent", "grey"]
    return {k: s.chat(chat_body(height=128, width=96)) for k in kinds}


def test_malformed_json(fault_replies: dict[str, httpx.Response]) -> None:
    r = fault_replies["malformed-json"]
    assert r.status_code == 200
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.text)


def test_no_image(fault_replies: dict[str, httpx.Response]) -> None:
    r = fault_replies["no-image"]
    assert r.status_code == 200
    assert isinstance(r.json()["choices"][0]["message"]["content"], str)


def test_wrong_size(fault_replies: dict[str, httpx.Response]) -> None:
    (png,) = chat_pngs(fault_replies["wrong-size"])
    assert decode(png).size != (96, 128)


def test_transparent(fault_replies: dict[str, httpx.Response]) -> None:
    (png,) = chat_pngs(fault_replies["transparent"])
    img = decode(png)
    assert img.mode == "RGBA" and img.size == (96, 128)
    alpha = np.asarray(img)[..., 3]
    assert 0.95 < float(np.mean(alpha == 0)) < 0.99


def test_grey(fault_replies: dict[str, httpx.Response]) -> None:
    (png,) = chat_pngs(fault_replies["grey"])
    px = np.asarray(decode(png))
    assert px.shape == (128, 96, 3) and px.std() == 0


def test_hang_keeps_server_alive(fleet: dict[str, Server], fault_replies: dict[str, httpx.Response]) -> None:
    s = fleet["faults"]
    with pytest.raises(httpx.ReadTimeout):
        s.chat(chat_body(), timeout=3)  # request 6
    assert "fault hang@6" in s.log()
    assert httpx.get(s.url + "/health", timeout=2).status_code == 200
    assert s.proc.poll() is None


def test_exit_mid_request(fleet: dict[str, Server]) -> None:
    s = fleet["exit"].ready()
    chat_pngs(s.chat(chat_body()))  # request 1 is fine
    with pytest.raises(httpx.HTTPError):
        s.chat(chat_body())
    assert s.wait_exit(timeout=10) == 1
    log = s.log()
    assert "fault exit@2" in log and "request 2 " in log


def test_load_fail(fleet: dict[str, Server]) -> None:
    s = fleet["load_fail"]
    assert s.wait_exit() == 3
    assert "fault load-fail" in s.log()
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", s.port)) != 0


def test_slow_load_binds_late(launch) -> None:
    s = launch("slow", "--fault", "slow-load@2")
    deadline = time.monotonic() + 60
    while "refserver loaded" not in s.log():
        assert time.monotonic() < deadline and s.proc.poll() is None
        time.sleep(0.02)
    loaded = time.monotonic()
    with socket.socket() as sock:  # loaded, but not listening yet
        assert sock.connect_ex(("127.0.0.1", s.port)) != 0
    s.ready()
    assert time.monotonic() - loaded >= 1.8


def test_fault_plan_parsing() -> None:
    plan = FaultPlan.parse(["grey", "exit@3", "slow-load=1.5", "transparent@2", "load-fail"])
    assert plan.load_fail and plan.slow_load_s == 1.5
    assert plan.for_request(1) == {"grey"}
    assert plan.for_request(2) == {"grey", "transparent"}
    assert plan.for_request(3) == {"grey", "exit"}
    assert FaultPlan.parse(["slow-load@5"]).slow_load_s == 5
    for bad in ["nope", "exit", "hang@0", "grey@x", "slow-load=abc"]:
        with pytest.raises(ValueError):
            FaultPlan.parse([bad])


def test_host_memory_faults_name_their_size_and_request() -> None:
    plan = FaultPlan.parse(["host-memory=512@2", "load-host-memory=64"])
    assert plan.host_mib(2) == 512 and plan.host_mib(1) == 0 and plan.load_host_mib == 64
    assert plan.for_request(2) == {"host-memory"} and FaultPlan.parse([]).host_mib(1) == 0
    for bad in ["host-memory", "host-memory=512", "host-memory=x@2", "host-memory=512@0", "load-host-memory",
                "load-host-memory=0"]:
        with pytest.raises(ValueError, match="host-memory"):
            FaultPlan.parse([bad])


def test_jitter_is_a_seeded_uniform_sleep_per_request() -> None:
    plan = FaultPlan.parse(["jitter=0.2:0.4:7"])
    delays = [plan.delay_s(n) for n in range(1, 41)]
    assert all(0.2 <= d <= 0.4 for d in delays) and len(set(delays)) == 40
    assert min(delays) < 0.25 and max(delays) > 0.35  # spread over the range, not stuck at one end
    assert delays == [FaultPlan.parse(["jitter=0.2:0.4:7"]).delay_s(n) for n in range(1, 41)]  # every start
    assert delays != [FaultPlan.parse(["jitter=0.2:0.4:8"]).delay_s(n) for n in range(1, 41)]
    assert FaultPlan.parse(["jitter=1:1"]).delay_s(3) == 1.0 and FaultPlan.parse([]).delay_s(1) == 0.0
    for bad in ["jitter", "jitter=1", "jitter=2:1", "jitter=-1:1", "jitter=a:b", "jitter=0:1:x", "jitter=0:1:2:3"]:
        with pytest.raises(ValueError, match="jitter"):
            FaultPlan.parse([bad])


def test_unused_helpers_roundtrip() -> None:
    # the transparent fault's PNG must survive a decode/encode round trip with its alpha
    img = Image.new("RGBA", (4, 4), (1, 2, 3, 0))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    assert decode(base64.b64decode(base64.b64encode(buf.getvalue()))).mode == "RGBA"


def test_oom_message_matches_pytorch_prefix() -> None:
    from runner.refserver.memory import AccountedMemory, AccountedOutOfMemory, format_size

    assert format_size(20 * 2**20) == "20.00 MiB" and format_size(24 * 2**30) == "24.00 GiB"
    mem = AccountedMemory(capacity=2**20)
    mem.alloc(2**19, "a")
    with pytest.raises(AccountedOutOfMemory) as exc:
        mem.alloc(2**20, "b")
    assert str(exc.value).startswith("CUDA out of memory. Tried to allocate 1024.00 KiB. GPU 0 has a total "
                                     "capacity of 1024.00 KiB of which 512.00 KiB is free.")
    with mem.scope():  # the OOM path: a scope frees what was left allocated inside it
        mem.alloc(100, "c")
    assert mem.current() == 2**19 and mem.peak() == 2**19 + 100
