"""vLLM-Omni 0.30 fidelity on the runner side, on real bytes: where the server's own peak is read, the
images/edits dialect, dropped references, the vllm_omni gauge, the CFG warning. Pure functions only; the
same paths run end to end against the reference server in tests/e2e/test_fidelity_e2e.py."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from runner.core.records import FailureClass, StepRecord, load
from runner.meters.server import read_gauges
from runner.observe.failures import references_dropped
from runner.plan.matrix import load_matrix
from runner.run import dialects

ROOT = Path(__file__).resolve().parents[2]


def png() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.arange(48, dtype=np.uint8).reshape(4, 4, 3)).save(out, "PNG")
    return out.getvalue()


def uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_server_peak_every_location_with_source_and_meaning() -> None:
    data = png()
    chat_030 = {"choices": [{"message": {"content": [
        {"type": "image_url", "image_url": {"url": uri(data)}, "stage_durations": {}, "peak_memory_mb": 23522.0}]}}]}
    p = dialects.parse("vllm-omni-chat", json.dumps(chat_030).encode())
    assert p.image == data
    assert p.server_peak == dialects.ServerPeak(23522.0, "choices[0].message.content[0].peak_memory_mb", "reserved")
    images_030 = {"data": [{"b64_json": base64.b64encode(data).decode()}], "metrics": {"peak_memory_mb": 812.5}}
    for dialect in ("openai-images", "openai-images-edits"):
        q = dialects.parse(dialect, json.dumps(images_030).encode())
        assert q.server_peak == dialects.ServerPeak(812.5, "metrics.peak_memory_mb", "reserved")
    multi_stage_chat = {**chat_030, "metrics": {"peak_memory_mb": 5.0}}
    multi_stage_chat["choices"][0]["message"]["content"][0].pop("peak_memory_mb")
    assert dialects.parse("vllm-omni-chat", json.dumps(multi_stage_chat).encode()).server_peak.source == \
        "metrics.peak_memory_mb"
    older = {"choices": chat_030["choices"], "peak_memory_mb": 7}
    older["choices"][0]["message"]["content"][0].pop("peak_memory_mb", None)
    assert dialects.parse("vllm-omni-chat", json.dumps(older).encode()).server_peak == \
        dialects.ServerPeak(7.0, "peak_memory_mb", "unspecified")
    none = {"data": [{"b64_json": base64.b64encode(data).decode()}], "metrics": {"peak_memory_mb": None}}
    assert dialects.parse("openai-images", json.dumps(none).encode()).server_peak is None


def test_old_records_with_server_peak_mb_still_load() -> None:
    old = {"key": "a/b/refs-1/f-seed-1", "card": "a", "flags": "b", "role": "default", "fixture": "f",
           "references": 1, "seed": 1, "status": "ok", "server_peak_mb": 12.5}
    r = load(StepRecord, old)
    assert (r.server_peak_mib, r.server_peak_source, r.server_peak_measures) == (12.5, "peak_memory_mb",
                                                                                 "unspecified")


def test_images_edits_dialect_is_multipart_in_order() -> None:
    req = dialects.ImageRequest(model="qwen-image", prompt="edit", references=(("image/png", b"one"),
                                ("image/png", b"two"), ("image/jpeg", b"three")), seed=7, steps=20,
                                size=(64, 32), true_cfg_scale=4.0, negative_prompt=" ")
    call = dialects.build("openai-images-edits", req)
    assert call.path == "/v1/images/edits"
    assert [f for f, _ in call.files] == ["image[]"] * 3
    assert [d for _, (_, d, _) in call.files] == [b"one", b"two", b"three"]
    assert call.body["num_inference_steps"] == 20 and call.body["true_cfg_scale"] == 4.0
    assert call.body["seed"] == 7 and call.body["size"] == "64x32" and call.body["negative_prompt"] == " "
    # what httpx actually puts on the wire
    kw = call.httpx_kwargs()
    wire = httpx.Request("POST", "http://127.0.0.1/v1/images/edits", **kw)
    body = wire.read()
    assert wire.headers["content-type"].startswith("multipart/form-data")
    assert body.count(b'name="image[]"') == 3 and b'name="true_cfg_scale"' in body
    assert body.index(b"one") < body.index(b"two") < body.index(b"three")
    chat = dialects.build("vllm-omni-chat", req)
    assert chat.httpx_kwargs() == {"json": chat.body}


def test_dropped_reference_from_the_log_window() -> None:
    window = ("INFO refserver: Diffusion chat request chatcmpl-1: ref_images=4\n"
              "WARNING refserver: Failed to decode reference image: cannot identify image file\n"
              "INFO refserver: request 3 id=chatcmpl-1 done status=200\n")
    f = references_dropped(log_window=window, sent=4, http_status=200)
    assert f is not None and f.kind == FailureClass.REFERENCES_DROPPED
    assert "served 3 of 4" in f.message and "Failed to decode reference image" in f.evidence[0]
    # a count below what was sent (e.g. references lost before decoding) also fails it
    lost = references_dropped(log_window="x: ref_images=2\n", sent=3, http_status=200)
    assert lost is not None and "served 2 of 3" in lost.message
    assert references_dropped(log_window="x: ref_images=4\n", sent=4, http_status=200) is None
    assert references_dropped(log_window="", sent=4, http_status=200) is None  # a server that logs nothing
    assert references_dropped(log_window=window, sent=0, http_status=200) is None


def test_server_gauges() -> None:
    ref = "# TYPE refserver_device_memory_bytes gauge\nrefserver_device_memory_bytes 1048576.0\n"
    assert read_gauges(ref) == ("current", 1048576)
    omni = ('# TYPE vllm_omni:peak_memory_mb gauge\nvllm_omni:peak_memory_mb{model_name="q",stage="0"} 23522.0\n'
            'vllm_omni:peak_memory_mb{model_name="q",stage="1"} 100.0\n')
    assert read_gauges(omni) == ("last-peak", 23522 * 2**20)
    assert read_gauges("# TYPE http_requests_total counter\nhttp_requests_total 3.0\n") is None


def test_true_cfg_without_negative_prompt_warns(tmp_path: Path, capsys) -> None:
    text = (ROOT / "examples" / "local.toml").read_text().replace('negative_prompt = " "\n', "")
    path = tmp_path / "m.toml"
    path.write_text(text.replace('"refs/', f'"{ROOT}/examples/refs/'))
    load_matrix(path)
    err = capsys.readouterr().err
    assert "true_cfg_scale = 4 without negative_prompt" in err and str(path) in err
    load_matrix(ROOT / "examples" / "local.toml")
    assert "negative_prompt" not in capsys.readouterr().err


def test_corrupt_ref_fault_parses() -> None:
    import pytest

    from runner.refserver.faults import FaultPlan

    assert FaultPlan.parse(["corrupt-ref=3"]).corrupt_ref == 3
    assert FaultPlan.parse([]).corrupt_ref is None
    with pytest.raises(ValueError, match="1-based reference number"):
        FaultPlan.parse(["corrupt-ref=0"])


@pytest.mark.parametrize(("value", "reason"), [
    (0.0, "metrics.peak_memory_mb: the server reported 0.0 (not measured)"),
    (0, "metrics.peak_memory_mb: the server reported 0.0 (not measured)"),
    (None, "metrics.peak_memory_mb: the server reported null (not measured)"),
    (float("nan"), "metrics.peak_memory_mb: the server reported 'nan': not a memory figure"),
    (-5.0, "metrics.peak_memory_mb: the server reported '-5.0': not a memory figure"),
])
def test_a_zero_or_no_figure_is_no_peak_and_says_why(value: object, reason: str) -> None:
    """vLLM-Omni answers float(peak or 0.0) when its worker measured nothing: never a 0-byte peak."""
    data = png()
    doc = {"choices": [{"message": {"content": [{"type": "image_url", "image_url": {"url": uri(data)}}]}}],
           "metrics": {"peak_memory_mb": value, "stage_durations": {"diffusion": 1.5, "vae": float("inf")}}}
    p = dialects.parse("vllm-omni-chat", json.dumps(doc).encode())
    assert p.image == data and p.server_peak is None and p.peak_unread == reason
    assert p.stage_durations == {"diffusion": 1.5}  # a non-finite duration is dropped
    # a real figure elsewhere in the same response wins, and then nothing is "unread"
    doc["choices"][0]["message"]["content"][0]["peak_memory_mb"] = 812.0
    q = dialects.parse("vllm-omni-chat", json.dumps(doc).encode())
    assert q.server_peak is not None and q.server_peak.mib == 812.0 and q.peak_unread is None


def test_every_dialect_asks_for_the_stage_metrics() -> None:
    req = dialects.ImageRequest("m", "p", (("image/png", b"x"),), 1, 2, None)
    assert dialects.build("vllm-omni-chat", req).body["extra_body"]["return_stage_metrics"] is True
    assert dialects.build("openai-images", req).body["return_stage_metrics"] is True
    edits = dialects.build("openai-images-edits", req).httpx_kwargs()
    assert edits["data"]["return_stage_metrics"] == "true"  # a form field, spelled as JSON


def test_a_zero_response_peak_falls_back_to_the_next_source() -> None:
    from runner.core.records import Peak
    from runner.run.step_records import with_response_peak

    gauge = Peak(source="server", metric="device", bytes=3 * 2**20, samples=5, rate_hz=20.0, available=True)
    peaks = with_response_peak([gauge], None, "metrics.peak_memory_mb: the server reported 0.0 (not measured)")
    assert [p.source for p in peaks] == ["server-response", "server"]
    assert not peaks[0].available and peaks[0].bytes is None and "not measured" in (peaks[0].reason or "")
    assert next(p for p in peaks if p.available) == gauge
