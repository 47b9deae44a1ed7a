"""Sending is one small piece: a step's request sent back to back to a server in this process (a stdlib HTTP
server thread answering from a script), each answer classified; the record is then built purely."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

import httpx
import pytest
from PIL import Image

from runner.backends.base import ExitInfo, RunningServer
from runner.core.records import Failure, FailureClass, Peak, SendTime, Status, StepRecord
from runner.core.vocab import Role
from runner.plan.lanes import Step
from runner.run import dialects
from runner.run.sending import Sender, repeat_label
from runner.run.step_records import topped_up

STEP = Step("c", "f", "fx", 1, 7)


def png(shade: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (16, 16), (shade, 100, 150)).save(out, "PNG")
    return out.getvalue()


class Scripted:
    """A server answering POSTs from a script: an int is a PNG of that shade, a str a 500 with that text."""

    def __init__(self, script: list[int | str]) -> None:
        self.script, self.log = list(script), ""
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                answer = owner.script.pop(0)
                if isinstance(answer, str):
                    owner.log += answer + "\n"
                    status, data = 500, json.dumps({"error": {"message": answer}}).encode()
                else:
                    url = "data:image/png;base64," + base64.b64encode(png(answer)).decode()
                    status, data = 200, json.dumps({"choices": [{"message": {"content": [
                        {"type": "image_url", "image_url": {"url": url}}]}}]}).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    # what Sender asks of a RunningServer
    def log_size(self) -> int:
        return len(self.log)

    def read_log(self, start: int = 0) -> str:
        return self.log[start:]

    def exited(self) -> ExitInfo | None:
        return None

    def quote(self, text: str | bytes, limit: int = 4000) -> str:
        return (text.decode(errors="replace") if isinstance(text, bytes) else text)[:limit]

    def quote_failure(self, failure: Failure) -> Failure:
        return failure


@pytest.fixture
def serve() -> Iterator[Any]:
    made: list[Scripted] = []

    def sender(script: list[int | str]) -> Sender:
        made.append(server := Scripted(script))
        return Sender(client, cast(RunningServer, server), "vllm-omni-chat", 10.0, None, threading.Event())

    with httpx.Client() as client:
        yield sender
    for s in made:
        s.http.shutdown()
        s.http.server_close()


def call() -> dialects.HttpCall:
    return dialects.build("vllm-omni-chat", dialects.ImageRequest(model="m", prompt="p", references=(), seed=7,
                                                                  steps=2, size=None))


def test_repeats_time_every_send_and_find_the_first_repeat_unlike_the_first(serve: Any) -> None:
    sends = serve([10, 10, 30]).repeats(call(), 0, 3, label=repeat_label(3))
    assert len(sends.sends) == 3 and sends.failure is None
    assert sends.first is not None and sends.first.image_bytes is not None
    assert Image.open(io.BytesIO(sends.first.image_bytes)).getpixel((0, 0))[0] == 10
    assert sends.different is not None and Image.open(io.BytesIO(sends.different)).getpixel((0, 0))[0] == 30
    assert all(s.content == b"" for s in sends.sends)  # bodies are not kept past classification
    assert sends.t0 <= sends.sends[1].t0 <= sends.t1


def test_a_failing_repeat_ends_the_sends_and_is_named_by_its_place(serve: Any) -> None:
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    sends = serve([10, oom, 10]).repeats(call(), 0, 3, label=repeat_label(3))
    assert len(sends.sends) == 2 and sends.failure is not None
    assert sends.failure.kind == FailureClass.OOM
    assert sends.failure.message.startswith("send 2 of 3 of the same request: ")
    assert sends.first is not None and sends.different is None


def test_a_top_up_compares_with_the_recorded_image_and_adds_to_the_record(serve: Any) -> None:
    recorded = hashlib.sha256(png(10)).hexdigest()
    old = StepRecord(key="c/f/refs-1/fx-seed-7", card="c", flags="f", role=Role("default"), fixture="fx",
                     references=1, seed=7, status=Status.OK, started_at=1.0, wall_s=2.0, wall_samples_s=(2.0,),
                     sends=(SendTime(started_at=1.0, wall_s=2.0, timed=True),), image="fx-seed-7.png",
                     image_sha256=recorded,
                     deterministic=True, request={"sends": 1},
                     peaks=(Peak(source="nvml", metric="device", bytes=100, samples=5, rate_hz=10.0, available=True),))
    same = serve([10, 10]).repeats(call(), 1, 2, label=lambda i: f"send {i + 2}", against_sha256=recorded)
    assert same.different is None
    new = topped_up(old, same, (Peak(source="nvml", metric="device", bytes=300, samples=4, rate_hz=10.0,
                                     available=True),), None)
    assert len(new.wall_samples_s) == 3 and new.wall_samples_s[0] == 2.0 and len(new.sends) == 3
    assert new.deterministic is True and new.request["sends"] == 3 and new.status == Status.OK
    assert new.peaks == (Peak(source="nvml", metric="device", bytes=300, samples=9, rate_hz=10.0,
                              available=True),)  # the higher figure, samples summed

    changed = serve([30]).repeats(call(), 1, 1, label=lambda i: f"send {i + 2}", against_sha256=recorded)
    assert changed.different is not None  # the only send already differs from the recorded image
    assert topped_up(old, changed, (), 41.5).deterministic is False

    failed = serve(["Traceback: worker died"]).repeats(call(), 1, 1, label=lambda i: f"send {i + 2} (top-up)",
                                                        against_sha256=recorded)
    out = topped_up(old, failed, (), None)
    assert out.status == Status.FAILED and out.failure is not None
    assert out.failure.message.startswith("send 2 (top-up): ")
    assert out.wall_samples_s == (2.0,) and [s.timed for s in out.sends] == [True, False]
