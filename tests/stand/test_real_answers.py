"""Every answer shape the runner parses, from the real vLLM-Omni 0.30.0 server on its accounted card: chat with
references, images/generations, images/edits, an error body, /metrics with the --log-stats gauge, the profiler
endpoints (after a request: before one, /stop_profile kills the server), a request OOM inside vLLM-Omni's code and
the server serving on after it. One server start for the module (its tests build on each other's requests)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image

from runner.observe import failures, trace
from runner.observe.traceback import site_of, tracebacks
from runner.run import dialects
from tests.stand.conftest import TEXT_TO_IMAGE, RealServer, start, stop

# These tests start the real server (a minute a start under the suite's load): handed out with the slow tests
# (tests/conftest.py), before the quick ones, so that none of them is the last thing a worker does
pytestmark = pytest.mark.slow

CAPACITY_GIB = 0.25  # 256 MiB: 1-4 references at 256x256 serve (153-240 MiB), one at 1024x1024 does not
SERVED = "tiny-edit-plus"


def png(seed: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (64, 64), (40 * seed % 256, 90, 200 - 30 * seed % 200)).save(out, "PNG")
    return out.getvalue()


def request(n: int, size: tuple[int, int] = (256, 256)) -> dialects.ImageRequest:
    return dialects.ImageRequest(model=SERVED, prompt="make it blue", references=tuple(("image/png", png(i))
                                 for i in range(n)), seed=1, steps=2, size=size)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    folder = tmp_path_factory.mktemp("real-answers")
    config = {"profiler": "torch", "torch_profiler_dir": str(folder / "profile"), "torch_profiler_with_memory": True,
              "torch_profiler_with_stack": False, "torch_profiler_dump_cuda_time_total": False}
    s = start(folder / "server.log", "--served-model-name", SERVED, "--log-stats",
              "--profiler-config", json.dumps(config), env={"RUNNER_CARD_VRAM_GIB": str(CAPACITY_GIB)})
    yield s
    stop(s)


def send(server: RealServer, dialect: str, req: dialects.ImageRequest) -> httpx.Response:
    call = dialects.build(dialect, req)
    return httpx.post(server.base + call.path, timeout=180, **call.httpx_kwargs())


def test_chat_with_references_carries_the_peak_in_its_content_part(server: RealServer) -> None:
    answer = send(server, "vllm-omni-chat", request(2))
    assert answer.status_code == 200, answer.text[:500]
    doc = answer.json()
    assert doc["metrics"] is None  # 0.30.0 chat: the figures are per content part, never top-level
    part = doc["choices"][0]["message"]["content"][0]
    parsed = dialects.parse("vllm-omni-chat", answer.content)
    assert parsed.image is not None and Image.open(io.BytesIO(parsed.image)).size == (256, 256)
    assert parsed.server_peak is not None
    assert parsed.server_peak.source == "choices[0].message.content[0].peak_memory_mb"
    assert parsed.server_peak.mib == pytest.approx(part["peak_memory_mb"]) and 100 < parsed.server_peak.mib < 256
    assert parsed.stage_durations and all(v >= 0 for v in parsed.stage_durations.values())


def images_answer(answer: httpx.Response, dialect: str) -> None:
    """images/generations and images/edits: the figures top-level (`metrics`), the peak there too when the platform
    has one (0.30.0 writes null where its platform answers 0, as on a CPU without the card)."""
    assert answer.status_code == 200, (dialect, answer.text[:500])
    doc = answer.json()
    parsed = dialects.parse(dialect, answer.content)
    assert parsed.image is not None, dialect
    assert parsed.server_peak is not None and parsed.server_peak.source == "metrics.peak_memory_mb", dialect
    assert parsed.server_peak.mib == pytest.approx(doc["metrics"]["peak_memory_mb"]) and parsed.server_peak.mib > 1
    assert parsed.stage_durations, dialect


def test_edits_answer_with_top_level_metrics(server: RealServer) -> None:
    images_answer(send(server, "openai-images-edits", request(1)), "openai-images-edits")
    # without an image, edits is FastAPI's 422 (Edit-Plus cannot generate from text alone: a 500 on generations)
    answer = httpx.post(server.base + "/v1/images/edits", data={"model": SERVED, "prompt": "x"}, timeout=30)
    assert answer.status_code == 422


def test_generations_on_text_to_image_and_a_wrong_model(tmp_path: Path) -> None:
    s = start(tmp_path / "server.log", "--served-model-name", SERVED, model=TEXT_TO_IMAGE)
    try:
        images_answer(send(s, "openai-images", request(0)), "openai-images")
        wrong = send(s, "openai-images", dialects.ImageRequest(model="omni", prompt="x", references=(), seed=1,
                                                               steps=2, size=(256, 256)))
        assert wrong.status_code == 400
        message = wrong.json()["error"]["message"]
        assert message == f"Model mismatch: request specifies 'omni' but server is running '{SERVED}'."
        models = httpx.get(s.base + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [SERVED]
    finally:
        stop(s)


def test_a_bad_request_is_a_400_whose_body_names_the_field(server: RealServer) -> None:
    answer = httpx.post(server.base + "/v1/images/generations", json={"model": SERVED}, timeout=30)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "body.prompt" and "missing" in error["message"]


def test_metrics_export_the_peak_gauge_after_a_request(server: RealServer) -> None:
    assert send(server, "vllm-omni-chat", request(1)).status_code == 200
    text = httpx.get(server.base + "/metrics", timeout=10).text
    gauges = [line for line in text.splitlines() if line.startswith("vllm_omni:peak_memory_mb{")]
    assert gauges and float(gauges[0].rsplit(" ", 1)[1]) > 100


def test_profiler_after_a_request_writes_a_trace_with_memory_events_and_no_snapshot(
        server: RealServer, tmp_path: Path) -> None:
    assert send(server, "vllm-omni-chat", request(1)).status_code == 200  # the busy loop runs: safe to profile
    assert httpx.post(server.base + "/start_profile", timeout=30).status_code == 200
    assert send(server, "vllm-omni-chat", request(1)).status_code == 200
    assert httpx.post(server.base + "/stop_profile", timeout=180).status_code == 200
    assert server.proc.poll() is None
    profile = server.log.parent / "profile"
    assert not list(profile.rglob("memory_snapshot_rank*.pickle"))  # no allocator history on a CPU
    (found,) = profile.rglob("trace_rank0.json*")
    memory = trace.read_bytes(found.read_bytes())
    assert memory.device == "CPU" and memory.events > 100
    assert memory.peak_allocated is not None and 50 * 2**20 < memory.peak_allocated < 2**30


def test_a_request_past_the_card_is_a_500_with_pytorchs_text_and_the_server_serves_on(server: RealServer) -> None:
    answer = send(server, "vllm-omni-chat", request(4, (1024, 1024)))
    assert answer.status_code == 500
    body = answer.json()["error"]
    assert body["message"].startswith("Image generation failed: CUDA out of memory. Tried to allocate")
    assert "GPU 0 has a total capacity of 256.00 MiB" in body["message"]
    # the server's own log holds the traceback; its site is a line of vLLM-Omni's code
    (frames, _), *_ = [t for t in reversed(tracebacks(server.text())) if "OutOfMemoryError" in t[1]]
    site, _, _, why = site_of(frames)
    assert site is not None and site.startswith("vllm_omni/diffusion/"), (site, why)
    observed = failures.classify_request(http_status=500, body=answer.text, log_window=server.text()[-20000:],
                                         timed_out=False, server_exit=None, parse_problem=None)
    assert observed is not None and observed.kind.value == "oom"
    assert observed.oom is not None and observed.oom.site == site
    assert send(server, "vllm-omni-chat", request(1)).status_code == 200  # it serves on
