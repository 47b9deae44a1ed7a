"""`--api 0.32` (the default): today's vLLM-Omni returns its stage metrics only when a request asks
(`return_stage_metrics`, in extra_body or the root, "true"/"1"/"yes"/"on" for text), answers 0.0 when it
measured nothing (fault zero-peak), and takes today's flag spellings, mapped onto the refserver's mechanisms."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from refserver_helpers import STEPS, Server, chat_body, chat_pngs

from runner.refserver.cli import build_parser, config_from_args

Launch = Callable[..., Server]
REAL = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-omni-0.30"
READY_S = 300  # three servers start together on a shared machine


@pytest.fixture(scope="module")
def servers(launch: Launch) -> dict[str, Server]:
    """Started together (their start-up overlaps), each waited for where it is used."""
    return {"today": launch("api-0.32"), "r030": launch("api-0.30", "--api", "0.30"),
            "zero": launch("zero-peak", "--fault", "zero-peak@2", "--log-stats")}


def test_chat_metrics_only_when_asked(servers: dict[str, Server]) -> None:
    server = servers["today"].ready(READY_S)
    unasked = server.chat(chat_body(return_stage_metrics=None))
    assert unasked.status_code == 200 and "metrics" not in unasked.json()
    parts = unasked.json()["choices"][0]["message"]["content"]
    assert all("peak_memory_mb" not in p for p in parts)  # 0.32: nowhere, not even in the image part
    for where in ("extra_body", "root"):
        body = chat_body(return_stage_metrics=None)
        (body["extra_body"] if where == "extra_body" else body)["return_stage_metrics"] = "yes"
        metrics = server.chat(body).json()["metrics"]
        assert metrics["peak_memory_mb"] > 0 and metrics["stage_durations"]["diffusion"] > 0, where
    off = server.chat(chat_body(return_stage_metrics="off"))
    assert "metrics" not in off.json()
    # the same image whether asked or not: asking changes the answer's metadata only
    assert chat_pngs(unasked) == chat_pngs(server.chat(chat_body()))


def test_images_metrics_only_when_asked(servers: dict[str, Server]) -> None:
    server = servers["today"].ready(READY_S)
    body = {"prompt": "a lighthouse", "size": "64x64", "seed": 7, "num_inference_steps": STEPS,
            "negative_prompt": " "}
    plain = httpx.post(server.url + "/v1/images/generations", json=body, timeout=60).json()
    assert "metrics" not in plain and plain["data"]
    asked = httpx.post(server.url + "/v1/images/generations", json={**body, "return_stage_metrics": True},
                       timeout=60).json()
    assert asked["metrics"]["peak_memory_mb"] > 0
    png = base64.b64decode(asked["data"][0]["b64_json"])
    form = {"prompt": "edit", "size": "64x64", "seed": "7", "num_inference_steps": str(STEPS),
            "return_stage_metrics": "true"}
    edited = httpx.post(server.url + "/v1/images/edits", data=form, files=[("image[]", ("a.png", png, "image/png"))],
                        timeout=60).json()
    assert edited["metrics"]["peak_memory_mb"] > 0


def test_030_keeps_its_own_shape(servers: dict[str, Server]) -> None:
    """--api 0.30: the peak in every image part, asked or not (the release's shape), a top-level metrics null."""
    server = servers["r030"].ready(READY_S)
    body = server.chat(chat_body(return_stage_metrics=None)).json()
    assert body["metrics"] is None and body["choices"][0]["message"]["content"][0]["peak_memory_mb"] > 0


def _keys(doc: object) -> object:
    """A JSON document's shape: the keys of every object, the first item of every list."""
    if isinstance(doc, dict):
        return {k: _keys(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_keys(doc[0])] if doc else []
    return None


def test_030_answers_in_the_shapes_the_real_server_was_measured_in(servers: dict[str, Server]) -> None:
    """Each answer of --api 0.30 against the real 0.30.0 server's recorded one (tests/fixtures/vllm-omni-0.30):
    the same keys where the runner reads (the images API's whole body, the chat image part, /v1/models,
    /version, /health, the error objects), the same types and statuses."""
    server = servers["r030"].ready(READY_S)
    real = {p.stem: json.loads(p.read_text()) for p in REAL.glob("*.json")}
    assert httpx.get(server.url + "/health").json() == real["health"]
    assert httpx.get(server.url + "/version").json() == real["version"] == {"version": "0.30.0"}
    models = httpx.get(server.url + "/v1/models").json()
    assert _keys(models) == _keys(real["models"]) and models["data"][0]["id"] == "refserver"

    chat = server.chat({**chat_body(), "model": "not-served"}).json()  # chat does not check the model: served
    assert chat["metrics"] is None and chat["model"] == "refserver"
    part, real_part = chat["choices"][0]["message"]["content"][0], real["chat_peak_zero"]["choices"][0]["message"][
        "content"][0]
    assert _keys(part) == _keys(real_part)  # type, image_url.url, stage_durations {queue_wait_ms, stage_0_gen_ms}
    assert part["stage_durations"]["stage_0_gen_ms"] > 0

    body = {"prompt": "a lighthouse", "size": "64x64", "seed": 7, "num_inference_steps": STEPS, "model": "refserver"}
    images = httpx.post(server.url + "/v1/images/generations", json=body, timeout=60).json()
    assert _keys(images) == _keys(real["images_generations_64"])
    png = base64.b64decode(images["data"][0]["b64_json"])
    form = {"prompt": "edit", "size": "64x64", "seed": "7", "num_inference_steps": str(STEPS)}
    edited = httpx.post(server.url + "/v1/images/edits", data=form, files=[("image[]", ("a.png", png, "image/png"))],
                        timeout=60).json()
    assert _keys(edited) == _keys(real["images_edits"])

    wrong = httpx.post(server.url + "/v1/images/generations", json={**body, "model": "omni"}, timeout=60)
    assert wrong.status_code == 400
    assert _keys(wrong.json()) == _keys(real["error_400_model_mismatch"])
    assert {**wrong.json()["error"], "message": ""} == {**real["error_400_model_mismatch"]["error"], "message": ""}
    assert wrong.json()["error"]["message"] == "Model mismatch: request specifies 'omni' but server is running " \
                                                "'refserver'."
    missing = httpx.post(server.url + "/v1/images/generations", json={"size": "64x64"}, timeout=60).json()
    assert {**missing["error"], "message": ""} == {**real["error_400_missing_prompt"]["error"], "message": ""}
    no_image = httpx.post(server.url + "/v1/images/edits", data=form, timeout=60)  # measured: 422, its body not
    assert no_image.status_code == 422
    assert no_image.json()["error"]["type"] == "Unprocessable Entity" and no_image.json()["error"]["code"] == 422


def test_zero_peak_fault_answers_0(servers: dict[str, Server]) -> None:
    """A worker that measured nothing: vLLM-Omni's `float(peak or 0.0)` in the response; the gauge is set only
    by a peak above 0 (0.30.0, measured), so it still holds the request before."""
    server = servers["zero"].ready(READY_S)
    first = server.chat(chat_body()).json()["metrics"]
    assert first["peak_memory_mb"] > 0
    second = server.chat(chat_body()).json()["metrics"]
    assert second["peak_memory_mb"] == 0.0 and isinstance(second["peak_memory_mb"], float)
    assert second["stage_durations"]["diffusion"] > 0  # it did run
    gauge = [v for k, v in server.metrics().items() if k.startswith("vllm_omni:peak_memory_mb")]
    assert gauge == [pytest.approx(first["peak_memory_mb"], abs=1e-3)]


@pytest.mark.parametrize(("args", "offload", "quantization"), [
    (["--diffusion-offload-config", '{"mode": "layer"}'], "layerwise", "none"),
    (["--diffusion-offload-config", '{"mode": "module", "components": ["dit", "vae"]}'], "module", "none"),
    (["--diffusion-offload-config", '{"mode": "module", "components": ["vae"]}'], "none", "none"),  # no DiT
    (["--enable-cpu-offload"], "module", "none"),
    (["--enable-cpu-offload", "--enable-layerwise-offload"], "layerwise", "none"),  # layerwise wins
    (["--diffusion-quantization-config", '{"method": "fp8", "activation_scheme": "dynamic"}'], "none", "fp8"),
    (["--quantization", "int8", "--diffusion-quantization-config", '{"method": "int8"}'], "none", "int8"),
    (["--cache-backend", "tea_cache", "--cache-config", "{}", "--vae-use-slicing", "--vae-use-tiling",
      "--diffusion-kv-cache-dtype", "fp8", "--max-num-seqs", "1"], "none", "none"),
])
def test_current_flag_spellings_map_onto_the_mechanisms(args: list[str], offload: str, quantization: str) -> None:
    config = config_from_args(build_parser().parse_args(args))
    assert (config.offload, config.quantization, config.api) == (offload, quantization, "0.32")


@pytest.mark.parametrize(("args", "words"), [
    (["--diffusion-offload-config", '{"mode": "disk"}'], "mode 'disk'"),
    (["--diffusion-offload-config", '{"components": ["unet"]}'], "components"),
    (["--diffusion-quantization-config", '{"method": "gguf"}'], "method 'gguf'"),
    (["--quantization", "int8", "--diffusion-quantization-config", '{"method": "fp8"}'], "disagree"),
])
def test_bad_json_forms_are_one_line(args: list[str], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        config_from_args(build_parser().parse_args(args))


def test_not_json_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--diffusion-offload-config", "mode=layer"])
    assert exc.value.code == 2 and "not JSON" in capsys.readouterr().err


def test_the_flags_without_a_mechanism_are_named_in_the_log_line() -> None:
    from runner.refserver.cli import not_imitated

    args = build_parser().parse_args(["--cache-backend", "tea_cache", "--vae-use-tiling", "--max-num-seqs", "1",
                                      "--enable-cpu-offload"])
    assert not_imitated(args) == ["--cache-backend tea_cache", "--vae-use-tiling", "--max-num-seqs 1"]
    assert not_imitated(build_parser().parse_args(["--cache-backend", "none"])) == []
