"""The vLLM-Omni API contract over real HTTP, on a tiny CPU server."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
from refserver_helpers import STEPS, Server, chat_body, chat_pngs, decode, make_ref, png_uri, psnr

REFS = [make_ref(i) for i in range(4)]


def test_health(device_server: Server) -> None:
    r = httpx.get(device_server.url + "/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}


@pytest.mark.parametrize("count", [0, 1, 2, 4])
def test_multi_reference_chat(device_server: Server, count: int) -> None:
    resp = device_server.chat(chat_body(refs=REFS[:count]))
    body = resp.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == "refserver"
    assert isinstance(body["created"], int)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["peak_memory_mb"] > 0
    (png,) = chat_pngs(resp)
    img = decode(png)
    assert img.format == "PNG" and img.mode == "RGB" and img.size == (128, 128)
    # a picture, not a flat fill: several distinct colours, spread over the range
    px = np.asarray(img).reshape(-1, 3)
    assert len(np.unique(px, axis=0)) > 100 and px.std() > 20


def test_reference_order_matters(device_server: Server) -> None:
    (a,) = chat_pngs(device_server.chat(chat_body(refs=[REFS[0], REFS[1]])))
    (b,) = chat_pngs(device_server.chat(chat_body(refs=[REFS[1], REFS[0]])))
    assert a != b
    assert psnr(a, b) < 35


def test_reference_content_matters(device_server: Server) -> None:
    (a,) = chat_pngs(device_server.chat(chat_body(refs=[REFS[0], REFS[1]])))
    (b,) = chat_pngs(device_server.chat(chat_body(refs=[REFS[0], REFS[2]])))
    assert psnr(a, b) < 40


def test_prompt_matters(device_server: Server) -> None:
    (a,) = chat_pngs(device_server.chat(chat_body(prompt="a red barn at dusk", refs=REFS[:1])))
    (b,) = chat_pngs(device_server.chat(chat_body(prompt="a lighthouse in fog", refs=REFS[:1])))
    assert a != b
    assert psnr(a, b) < 60


def test_deterministic_same_request(device_server: Server) -> None:
    body = chat_body(refs=REFS[:2])
    (a,) = chat_pngs(device_server.chat(body))
    (b,) = chat_pngs(device_server.chat(body))
    assert a == b  # byte-identical PNG


def test_seed_changes_output(device_server: Server) -> None:
    (a,) = chat_pngs(device_server.chat(chat_body(refs=REFS[:1], seed=1)))
    (b,) = chat_pngs(device_server.chat(chat_body(refs=REFS[:1], seed=2)))
    assert psnr(a, b) < 40


def test_top_level_seed_and_n_ignored(device_server: Server) -> None:
    body = chat_body(refs=REFS[:1])
    (a,) = chat_pngs(device_server.chat(body))
    (b,) = chat_pngs(device_server.chat({**body, "seed": 99, "n": 3}))
    assert a == b


def test_http_urls_are_ignored(device_server: Server) -> None:
    body = chat_body(refs=REFS[:1])
    (a,) = chat_pngs(device_server.chat(body))
    body["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": "https://example.com/x.png"}})
    (b,) = chat_pngs(device_server.chat(body))
    assert a == b


def test_string_content_and_several_user_messages(device_server: Server) -> None:
    body = chat_body(prompt="a cat")
    body["messages"] = [{"role": "system", "content": "ignored"}, {"role": "user", "content": "a cat"},
                        {"role": "user", "content": [{"type": "text", "text": "on a sofa"}]}]
    (a,) = chat_pngs(device_server.chat(body))
    body["messages"] = [{"role": "user", "content": "a cat\non a sofa"}]
    (b,) = chat_pngs(device_server.chat(body))
    assert a == b


@pytest.mark.parametrize(("extra", "size"), [
    ({"height": 96, "width": 160}, (160, 96)),
    ({"size": "64x112", "height": None, "width": None}, (64, 112)),
])
def test_requested_size_honoured(device_server: Server, extra: dict, size: tuple[int, int]) -> None:
    (png,) = chat_pngs(device_server.chat(chat_body(refs=REFS[:1], **extra)))
    assert decode(png).size == size


def test_default_size_follows_first_reference(device_server: Server) -> None:
    wide, tall = make_ref(0, (200, 100)), make_ref(1, (90, 180))
    (a,) = chat_pngs(device_server.chat(chat_body(refs=[wide, tall], height=None, width=None)))
    (b,) = chat_pngs(device_server.chat(chat_body(refs=[tall, wide], height=None, width=None)))
    (c,) = chat_pngs(device_server.chat(chat_body(refs=[], height=None, width=None)))
    (wa, ha), (wb, hb), (wc, hc) = decode(a).size, decode(b).size, decode(c).size
    assert (wa, ha) == (176, 96)  # 2:1 at about 128² pixels, multiples of 16
    assert (wb, hb) == (96, 176)
    assert (wc, hc) == (128, 128)


def test_num_outputs_per_prompt(device_server: Server) -> None:
    pngs = chat_pngs(device_server.chat(chat_body(refs=REFS[:1], num_outputs_per_prompt=2)))
    assert len(pngs) == 2 and pngs[0] != pngs[1]


def test_true_cfg_scale(device_server: Server) -> None:
    r4 = device_server.chat(chat_body(refs=REFS[:2], true_cfg_scale=4.0))
    r0 = device_server.chat(chat_body(refs=REFS[:2], true_cfg_scale=0))  # 0 falls back to 4.0
    r1 = device_server.chat(chat_body(refs=REFS[:2], true_cfg_scale=1.0))  # CFG off: one pass
    assert chat_pngs(r4) == chat_pngs(r0)
    assert chat_pngs(r4) != chat_pngs(r1)
    # without CFG there is no negative pass, hence no second conditioning cache
    assert r1.json()["peak_memory_mb"] < r4.json()["peak_memory_mb"]


def test_images_endpoint(device_server: Server) -> None:
    body = {"prompt": "a lighthouse", "size": "64x96", "n": 2, "response_format": "b64_json", "seed": 7,
            "num_inference_steps": STEPS, "negative_prompt": "blurry", "true_cfg_scale": 4.0}
    r = httpx.post(device_server.url + "/v1/images/generations", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out["created"], int) and out["peak_memory_mb"] > 0
    pngs = [base64.b64decode(d["b64_json"]) for d in out["data"]]
    assert len(pngs) == 2
    assert all(decode(p).size == (64, 96) for p in pngs)
    again = httpx.post(device_server.url + "/v1/images/generations", json=body, timeout=60).json()
    assert [base64.b64decode(d["b64_json"]) for d in again["data"]] == pngs


def _bad(device_server: Server, path: str, content: bytes) -> dict:
    r = httpx.post(device_server.url + path, content=content, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["message"]
    return err


@pytest.mark.parametrize(("body", "param"), [
    (chat_body(prompt=""), "messages"),
    ({"messages": []}, "messages"),
    (chat_body(size="100x100", height=None, width=None), "extra_body.size"),
    (chat_body(height=120), "extra_body.size"),
    (chat_body(height=4096, width=4096), "extra_body.size"),
    (chat_body(num_inference_steps=0), "extra_body.num_inference_steps"),
    (chat_body(seed="abc"), "extra_body.seed"),
])
def test_chat_400_shapes(device_server: Server, body: dict, param: str) -> None:
    import json

    assert _bad(device_server, "/v1/chat/completions", json.dumps(body).encode())["param"] == param


def test_chat_400_bad_json_and_bad_uri(device_server: Server) -> None:
    import json

    _bad(device_server, "/v1/chat/completions", b'{"messages": [')
    body = chat_body(refs=REFS[:1])
    body["messages"][0]["content"][1]["image_url"]["url"] = "data:image/png;base64,@@not-base64@@"
    assert "image_url" in _bad(device_server, "/v1/chat/completions", json.dumps(body).encode())["param"]
    body["messages"][0]["content"][1]["image_url"]["url"] = "data:text/plain," + png_uri(REFS[0])
    _bad(device_server, "/v1/chat/completions", json.dumps(body).encode())
    body["messages"][0]["content"][1]["image_url"]["url"] = "data:image/png;base64," + base64.b64encode(
        b"not an image").decode()
    _bad(device_server, "/v1/chat/completions", json.dumps(body).encode())


def test_images_400_shapes(device_server: Server) -> None:
    _bad(device_server, "/v1/images/generations", b'{"prompt": ""}')
    _bad(device_server, "/v1/images/generations", b'{"prompt": "x", "size": "1000x10"}')
    _bad(device_server, "/v1/images/generations", b'{"prompt": "x", "response_format": "url"}')
    _bad(device_server, "/v1/images/generations", b"not json")


def test_metrics(device_server: Server) -> None:
    chat_pngs(device_server.chat(chat_body(refs=REFS[:1])))
    text = httpx.get(device_server.url + "/metrics").text
    for family in ("refserver_requests_total", "refserver_request_seconds", "refserver_device_memory_bytes",
                   "refserver_device_memory_peak_bytes", "refserver_device_memory_capacity_bytes",
                   "refserver_cond_cache_bytes", "refserver_host_pinned_bytes"):
        assert f"# TYPE {family.removesuffix('_total')}" in text, family
    m = device_server.metrics()
    assert m['refserver_requests_total{status="200"}'] >= 1
    assert m["refserver_request_seconds_count"] >= 1
    assert m["refserver_device_memory_bytes"] > 0
    assert m["refserver_device_memory_peak_bytes"] > m["refserver_device_memory_bytes"]
    # the per-request cache is freed at request end
    assert m['refserver_cond_cache_bytes{placement="device"}'] == 0
    assert 'refserver_cond_cache_bytes{placement="host"}' in m


def test_log_has_a_line_per_request(device_server: Server) -> None:
    resp = device_server.chat(chat_body(refs=REFS[:1]))
    rid = resp.json()["id"]
    lines = [ln for ln in device_server.log().splitlines() if rid in ln]
    assert any("start" in ln and "refs=1" in ln for ln in lines)
    assert any("done status=200" in ln and "run_s=" in ln and "peak_mb=" in ln for ln in lines)
