"""Scoring, response parsing and failure classification on real bytes."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
from PIL import Image

from runner.core.records import FailureClass
from runner.judge import scoring
from runner.observe.failures import classify_request, classify_start
from runner.run import dialects


def png(array: np.ndarray, mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.fromarray(array.astype(np.uint8), mode).save(out, "PNG")
    return out.getvalue()


def gradient(h: int = 32, w: int = 32) -> np.ndarray:
    ys, xs = np.mgrid[0:h, 0:w]
    return np.stack([xs * 8, ys * 8, (xs + ys) * 4], axis=-1) % 256


def test_psnr_and_ssim() -> None:
    a = gradient()
    noisy = np.clip(a + np.random.default_rng(0).normal(0, 5, a.shape), 0, 255)
    s = scoring.score(scoring.decode(png(noisy)), scoring.decode(png(a)), "base")
    assert 30 < s.psnr_db < 40 and 0.5 < s.ssim < 1 and s.size_match and not s.sanity.broken
    same = scoring.score(scoring.decode(png(a)), scoring.decode(png(a)), "base")
    assert same.psnr_db == scoring.PSNR_CAP_DB and same.ssim == 1.0


def test_size_mismatch_is_explicit() -> None:
    s = scoring.score(scoring.decode(png(gradient(32, 32))), scoring.decode(png(gradient(16, 32))), "b")
    assert s.psnr_db is None and s.size_match is False and "size mismatch" in s.reason


def test_transparent_and_flat_are_broken() -> None:
    rgba = np.concatenate([gradient(), np.zeros((32, 32, 1))], axis=-1)
    rgba[0, 0, 3] = 255
    t = scoring.sanity(scoring.decode(png(rgba, "RGBA")))
    assert t.broken and t.transparent_share > 0.99
    grey = scoring.sanity(scoring.decode(png(np.full((32, 32, 3), 128))))
    assert grey.broken and "flat" in grey.reasons[0]
    black = scoring.sanity(scoring.decode(png(np.zeros((32, 32, 3)))))
    assert black.nan_or_black and black.broken


def test_chat_request_shape_keeps_reference_order() -> None:
    req = dialects.ImageRequest("m", "edit", (("image/png", b"one"), ("image/png", b"two")), 7, 20, (64, 32))
    call = dialects.build("vllm-omni-chat", req)
    assert call.path == "/v1/chat/completions"
    parts = call.body["messages"][0]["content"]
    assert parts[0] == {"type": "text", "text": "edit"}
    assert [base64.b64decode(p["image_url"]["url"].split(",")[1]) for p in parts[1:]] == [b"one", b"two"]
    assert call.body["extra_body"] == {"num_inference_steps": 20, "seed": 7, "width": 64, "height": 32,
                                       "return_stage_metrics": True}  # today's vLLM-Omni: metrics only when asked
    assert "seed" not in call.body  # top-level seed is ignored by vLLM-Omni


def test_parse_chat_and_images_responses() -> None:
    data = png(gradient())
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    chat = {"choices": [{"message": {"content": [{"type": "image_url", "image_url": {"url": url}}]}}],
            "peak_memory_mb": 12.5}
    p = dialects.parse("vllm-omni-chat", json.dumps(chat).encode())
    assert p.image == data and p.server_peak.mib == 12.5 and p.problem is None
    text = {"choices": [{"message": {"content": "sorry"}}]}
    assert "content is text" in dialects.parse("vllm-omni-chat", json.dumps(text).encode()).problem
    assert "not JSON" in dialects.parse("vllm-omni-chat", b"{oops").problem
    images = {"data": [{"b64_json": base64.b64encode(data).decode()}]}
    assert dialects.parse("openai-images", json.dumps(images).encode()).image == data


def test_oom_from_log_window_not_body() -> None:
    f = classify_request(http_status=500, body='{"error":{"message":"Internal server error"}}',
                         log_window="INFO x\nERROR CUDA out of memory. Tried to allocate 2.00 GiB\n",
                         timed_out=False, server_exit=None, parse_problem=None)
    assert f.kind == FailureClass.OOM and "server log" in f.message and "Tried to allocate" in f.evidence[0]
    plain = classify_request(http_status=500, body="nope", log_window="", timed_out=False, server_exit=None,
                             parse_problem=None)
    assert plain.kind == FailureClass.HTTP_ERROR
    crash = classify_request(http_status=None, body="", log_window="bye", timed_out=False, server_exit=1,
                             parse_problem=None)
    assert crash.kind == FailureClass.CRASH and crash.exit_code == 1
    assert classify_request(http_status=200, body="", log_window="", timed_out=False, server_exit=None,
                            parse_problem=None) is None


def test_start_classification() -> None:
    assert classify_start(exit_code=1, oom_killed=False, timed_out=False,
                          log_tail="torch.OutOfMemoryError: CUDA out of memory. Tried").kind == FailureClass.OOM_AT_LOAD
    assert classify_start(exit_code=None, oom_killed=True, timed_out=False, log_tail="").kind == \
        FailureClass.OOM_AT_LOAD
    assert classify_start(exit_code=3, oom_killed=False, timed_out=False, log_tail="x").kind == FailureClass.LOAD_EXIT
    assert classify_start(exit_code=None, oom_killed=False, timed_out=True, log_tail="").kind == \
        FailureClass.READY_TIMEOUT
