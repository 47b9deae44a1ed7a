"""Hostile requests and flags against the reference server (issue 46: Q-1 to Q-4).

What a request makes the server hold is read where the kernel keeps it: the server process's VmHWM (its peak
resident memory) in /proc, before and after. Each memory test has a server of its own, so one test's peak never
hides another's.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import os
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from refserver_helpers import ROOT, Server, chat_body, free_port

MiB = 2**20
# What the refused requests may add to the server's peak: their bodies (a few MiB) and parsing; decoding one
# 8000 x 8000 reference alone is 183 MiB, four 2048 x 2048 ones 48 MiB.
BOUND = 40 * MiB

SERVERS = {  # one per memory test, and one for the requests refused by what they say
    "count": [],
    "header": [],
    "lock": ["--fault", "hang@1"],
    "body": [],
    "plain": [],
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    logs = tmp_path_factory.mktemp("hostile-logs")
    started = {name: Server(f"hostile-{name}", args, logs) for name, args in SERVERS.items()}
    yield started
    for s in started.values():
        s.stop()


def peak_rss(server: Server) -> int:
    """VmHWM of the server process, in bytes."""
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@functools.cache
def solid_png(width: int, height: int) -> bytes:
    """A valid black RGB PNG of any size, compressed to almost nothing (8000 x 8000: 182 KiB), written row by
    row so the test never holds the pixels."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    z = zlib.compressobj(9)
    row = b"\0" * (1 + 3 * width)
    data = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")


def body_with(png: bytes, count: int) -> bytes:
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    body = chat_body(height=64, width=64, num_inference_steps=1)
    body["messages"][0]["content"] += [{"type": "image_url", "image_url": {"url": uri}}] * count
    return json.dumps(body).encode()


def post(server: Server, content: bytes, timeout: float = 120) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", content=content,
                      headers={"content-type": "application/json"}, timeout=timeout)


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    """vLLM-Omni's error body, with this status."""
    assert r.status_code == status, r.text[:300]
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]
    return err


def test_references_beyond_the_limit_are_counted_before_any_is_decoded(servers: dict[str, Server]) -> None:
    s = servers["count"].ready()
    before = peak_rss(s)
    err = error_of(post(s, body_with(solid_png(8000, 8000), 5)), 400)
    assert "Received 5 input images. At most 4" in err["message"]
    assert peak_rss(s) - before < BOUND, f"the peak grew {(peak_rss(s) - before) / MiB:.0f} MiB"


def test_a_reference_declaring_more_pixels_than_the_preset_uses_is_refused_unread(servers: dict[str, Server]) -> None:
    s = servers["header"].ready()
    before = peak_rss(s)
    err = error_of(post(s, body_with(solid_png(8000, 8000), 1)), 400)
    assert "8000x8000" in err["message"] and "image_url" in err["param"]
    assert peak_rss(s) - before < BOUND, f"the peak grew {(peak_rss(s) - before) / MiB:.0f} MiB"
    chat = post(s, body_with(solid_png(2048, 2048), 1))  # the largest a reference may be is served
    assert chat.status_code == 200, chat.text[:300]


def thread_states(pid: int) -> list[str]:
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:  # the thread ended
            continue
        states.append(stat.rsplit(")", 1)[1].split()[0])
    return states


def wait_until_parked(pid: int, threads: int, timeout: float = 120) -> None:
    """Until the process has at least `threads` threads and every one of them is asleep (state S: blocked on a
    lock, an event or a socket; a thread decoding or waiting for the CPU is R), seen three times running."""
    deadline, quiet = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        states = thread_states(pid)
        quiet = quiet + 1 if len(states) >= threads and set(states) == {"S"} else 0
        if quiet == 3:
            return
        time.sleep(0.02)
    raise AssertionError(f"the server never settled: {thread_states(pid)}")


def test_requests_waiting_for_the_one_running_hold_no_decoded_references(servers: dict[str, Server]) -> None:
    """Request 1 hangs inside the lock (fault hang@1); two requests of four 2048 x 2048 references each then
    arrive together and wait. Decoded while they wait, they would hold 8 x 12 MiB of pixels."""
    s = servers["lock"].ready()
    hung = threading.Thread(target=lambda: _ignore(lambda: post(s, json.dumps(chat_body()).encode())), daemon=True)
    hung.start()
    while "fault hang@1" not in s.log():
        assert hung.is_alive() and s.proc.poll() is None, s.log()[-2000:]
        time.sleep(0.02)
    wait_until_parked(s.proc.pid, 0)
    threads, before = len(thread_states(s.proc.pid)), peak_rss(s)
    body = body_with(solid_png(2048, 2048), 4)
    for _ in range(2):
        threading.Thread(target=lambda: _ignore(lambda: post(s, body)), daemon=True).start()
    wait_until_parked(s.proc.pid, threads + 2)  # one worker thread each, asleep: waiting for the lock
    assert peak_rss(s) - before < BOUND, f"the peak grew {(peak_rss(s) - before) / MiB:.0f} MiB while they waited"


def _ignore(send: Any) -> None:
    with contextlib.suppress(httpx.HTTPError):  # the server is stopped with these requests still waiting
        send()


def test_a_body_past_the_cap_is_refused_unread(servers: dict[str, Server]) -> None:
    """The cap on tiny: four references of 2048 x 2048 RGBA pixels in base64 and a MiB (90.5 MB)."""
    s = servers["body"].ready()
    before = peak_rss(s)
    huge = b" " * 100_000_000
    err = error_of(post(s, huge), 413)
    assert "too large" in err["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: refused at the first chunk past the cap
        for _ in range(100):
            yield huge[:1_000_000]

    error_of(httpx.post(s.url + "/v1/chat/completions", content=chunks(), timeout=120), 413)
    assert peak_rss(s) - before < 120 * MiB  # at most the cap (86 MiB), read while it was sent
    assert post(s, json.dumps(chat_body()).encode()).status_code == 200  # and the server serves on


CHAT = {"messages": [{"role": "user", "content": "a cat"}]}


def chat_with(**extra: Any) -> bytes:
    return json.dumps({**CHAT, "extra_body": extra}).encode()


@pytest.mark.parametrize("content", [
    pytest.param(b'{"messages": [{"role": "user", "content": "a cat"}], "extra_body": {"width": Infinity}}',
                 id="width-Infinity"),
    pytest.param(b'{"messages": [{"role": "user", "content": "a cat"}], "extra_body": {"width": NaN}}',
                 id="width-NaN"),
    pytest.param(b'{"messages": [{"role": "user", "content": "a cat"}], "extra_body": '
                 b'{"num_inference_steps": Infinity}}', id="steps-Infinity"),
    pytest.param(b'{"messages": [{"role": "user", "content": "a cat"}], "extra_body": {"seed": 1e400}}',
                 id="seed-1e400"),
    pytest.param(b'{"messages": [{"role": "user", "content": "a cat"}], "extra_body": {"seed": ' + b"9" * 5000
                 + b"}}", id="seed-5000-digits"),
    pytest.param(chat_with(size="9" * 5000 + "x16"), id="size-5000-digits"),
    pytest.param(b"[" * 100_000, id="nested-100000-deep"),
    pytest.param(b'{"messages": [{"role": "user", "content": "\\ud800 a cat"}]}', id="lone-surrogate-prompt"),
    pytest.param(b'{"messages": [{"role": "user", "content": "a cat"}], "extra_body": {"negative_prompt": '
                 b'"\\udfff"}}', id="lone-surrogate-negative"),
])
def test_numbers_nesting_and_text_json_allows_answer_vllm_omnis_400(servers: dict[str, Server], content: bytes) -> None:
    err = error_of(post(servers["plain"].ready(), content), 400)
    assert len(err["message"]) < 300, err["message"]


@pytest.mark.parametrize("content", [
    pytest.param(b'{"prompt": "a cat", "n": Infinity}', id="n-Infinity"),
    pytest.param(b'{"prompt": "a cat", "seed": NaN}', id="seed-NaN"),
    pytest.param(b'{"prompt": "a cat", "size": "' + b"9" * 5000 + b'x16"}', id="size-5000-digits"),
])
def test_the_images_route_answers_them_alike(servers: dict[str, Server], content: bytes) -> None:
    r = httpx.post(servers["plain"].ready().url + "/v1/images/generations", content=content, timeout=60,
                   headers={"content-type": "application/json"})
    err = error_of(r, 400)
    assert err["type"] == "Bad Request" and len(err["message"]) < 300


def test_an_edit_with_a_5000_digit_seed_is_a_short_400(servers: dict[str, Server]) -> None:
    png = solid_png(64, 64)
    r = httpx.post(servers["plain"].ready().url + "/v1/images/edits", data={"prompt": "a cat", "seed": "9" * 5000},
                   files={"image": ("a.png", png, "image/png")}, timeout=60)
    assert len(error_of(r, 400)["message"]) < 300


@pytest.mark.parametrize("args", [
    ["--vram-gib", "nan"], ["--vram-gib", "inf"], ["--vram-gib", "1e400"], ["--vram-gib", "0"],
    ["--fault", "slow-load=inf"], ["--fault", "slow-load=nan"], ["--fault", "slow-load=-1"],
    ["--fault", "jitter=0:1e308"], ["--threads", "0"], ["--port", "70000"],
    ["--port", "9" * 5000],
], ids=lambda a: " ".join(a)[:30])
def test_a_flag_value_not_finite_and_in_range_is_one_line_and_exit_2(args: list[str]) -> None:
    """The old server loaded and then ended in a traceback (exit 1, the code of an OOM at load), or started
    and served (slow-load=nan): bounded here, and counted as a failure."""
    command = [sys.executable, "-m", "runner.refserver", "--port", str(free_port()), *args]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{args}: still running after 30 s (accepted, serving)")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and len(lines[0]) < 400, (done.returncode, done.stderr[-2000:])
