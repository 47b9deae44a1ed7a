"""vLLM-Omni's HTTP API subset: request bodies -> GenerationRequest, results -> response bodies."""

from __future__ import annotations

import base64
import binascii
import io
import math
import random
import re
import secrets
import time
from typing import Any

from PIL import Image

from runner.refserver.config import Preset
from runner.refserver.engine import GenerationRequest

DATA_URI = re.compile(r"^data:image/[A-Za-z0-9.+-]+;base64,(?P<data>.*)$", re.DOTALL)
SIZE = re.compile(r"^\s*(\d+)\s*[xX*]\s*(\d+)\s*$")
DEFAULT_STEPS = 50
DEFAULT_TRUE_CFG = 4.0
MAX_STEPS = 1000
MAX_OUTPUTS = 8
SIDE_MULTIPLE = 16


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# --- parsing helpers ------------------------------------------------------------------------------
def decode_data_uri(url: str, param: str) -> Image.Image:
    m = DATA_URI.match(url)
    if not m:
        raise BadRequest("malformed image data URI: expected data:image/<type>;base64,<data>", param)
    try:
        raw = base64.b64decode(m.group("data"), validate=True)
        img = Image.open(io.BytesIO(raw))
        img.load()
    except (binascii.Error, ValueError, OSError, Image.DecompressionBombError) as exc:
        raise BadRequest(f"could not decode the image in the data URI: {exc}", param) from None
    return img.convert("RGB")


def _int(value: Any, param: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise BadRequest(f"{param} must be an integer (got {value!r})", param)
    if not lo <= int(value) <= hi:
        raise BadRequest(f"{param} must be between {lo} and {hi} (got {value})", param)
    return int(value)


def _float(value: Any, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(f"{param} must be a number (got {value!r})", param)
    return float(value)


def _parse_size(value: Any, param: str) -> tuple[int, int]:
    m = SIZE.match(value) if isinstance(value, str) else None
    if not m:
        raise BadRequest(f"{param} must look like 'WIDTHxHEIGHT' (got {value!r})", param)
    return int(m.group(1)), int(m.group(2))


def default_size(preset: Preset, refs: tuple[Image.Image, ...]) -> tuple[int, int]:
    """Preset default pixel count, at the first reference's aspect ratio, in multiples of 16."""
    side = preset.default_side
    if not refs:
        return side, side
    w0, h0 = refs[0].size
    aspect = w0 / h0
    width = max(SIDE_MULTIPLE, round(math.sqrt(side * side * aspect) / SIDE_MULTIPLE) * SIDE_MULTIPLE)
    height = max(SIDE_MULTIPLE, round(math.sqrt(side * side / aspect) / SIDE_MULTIPLE) * SIDE_MULTIPLE)
    return min(width, preset.max_side), min(height, preset.max_side)


def check_size(preset: Preset, width: int, height: int, param: str) -> None:
    for name, v in (("width", width), ("height", height)):
        if v < SIDE_MULTIPLE or v % SIDE_MULTIPLE:
            raise BadRequest(f"{name} must be a positive multiple of {SIDE_MULTIPLE} (got {v})", param)
        if v > preset.max_side:
            raise BadRequest(f"{name} {v} exceeds the maximum side {preset.max_side}", param)
    if width * height > preset.max_pixels:
        raise BadRequest(f"size {width}x{height} exceeds the maximum of {preset.max_pixels} pixels "
                         f"for preset {preset.name}", param)


def _generation(preset: Preset, params: dict[str, Any], prompt: str, refs: tuple[Image.Image, ...],
                outputs_key: str, prefix: str) -> GenerationRequest:
    """The generation parameters shared by both endpoints; `prefix` names where they were read."""
    width, height = default_size(preset, refs)
    if params.get("size") is not None:
        width, height = _parse_size(params["size"], f"{prefix}size")
    if params.get("width") is not None:
        width = _int(params["width"], f"{prefix}width", 1, 1 << 20)
    if params.get("height") is not None:
        height = _int(params["height"], f"{prefix}height", 1, 1 << 20)
    check_size(preset, width, height, f"{prefix}size")
    steps = params.get("num_inference_steps")
    steps = DEFAULT_STEPS if steps is None else _int(steps, f"{prefix}num_inference_steps", 1, MAX_STEPS)
    seed = params.get("seed")
    seed = random.randint(0, 2**31 - 1) if seed is None else _int(seed, f"{prefix}seed", 0, 2**63 - 1)
    cfg = params.get("true_cfg_scale")
    cfg = DEFAULT_TRUE_CFG if cfg is None else _float(cfg, f"{prefix}true_cfg_scale")
    if cfg < 0:
        raise BadRequest("true_cfg_scale must be >= 0", f"{prefix}true_cfg_scale")
    cfg = cfg or DEFAULT_TRUE_CFG  # 0 falls back to the default, as upstream
    guidance = params.get("guidance_scale")
    guidance = None if guidance is None else _float(guidance, f"{prefix}guidance_scale")
    neg = params.get("negative_prompt")
    if neg is not None and not isinstance(neg, str):
        raise BadRequest("negative_prompt must be a string", f"{prefix}negative_prompt")
    n = params.get(outputs_key)
    n = 1 if n is None else _int(n, f"{prefix}{outputs_key}", 1, MAX_OUTPUTS)
    if len(refs) > preset.max_refs:
        raise BadRequest(f"at most {preset.max_refs} reference images are supported", "messages")
    return GenerationRequest(prompt=prompt, references=refs, width=width, height=height, steps=steps,
                             seed=seed, true_cfg_scale=cfg, negative_prompt=neg or "", num_outputs=n,
                             guidance_scale=guidance)


# --- endpoints ------------------------------------------------------------------------------------
def parse_chat(body: Any, preset: Preset) -> GenerationRequest:
    """POST /v1/chat/completions: prompt = text parts of user messages, references = data-URI image_url
    parts in order (http(s) URLs ignored), parameters only from the literal `extra_body` key."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    texts: list[str] = []
    refs: list[Image.Image] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise BadRequest(f"messages[{i}] must be an object", "messages")
        if msg.get("role") != "user":
            continue
        content = msg.get("content")
        if isinstance(content, str):
            texts.append(content)
            continue
        if not isinstance(content, list):
            raise BadRequest(f"messages[{i}].content must be a string or a list of parts", "messages")
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise BadRequest(f"messages[{i}].content[{j}] must be an object", "messages")
            if part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif part.get("type") == "image_url":
                iu = part.get("image_url")
                url = iu.get("url") if isinstance(iu, dict) else iu
                if not isinstance(url, str):
                    raise BadRequest(f"messages[{i}].content[{j}].image_url.url must be a string", "messages")
                if url.startswith("data:"):
                    refs.append(decode_data_uri(url, f"messages[{i}].content[{j}].image_url"))
                # http(s) URLs are ignored, as upstream does
    prompt = "\n".join(t for t in texts if t.strip())
    if not prompt.strip():
        raise BadRequest("no prompt: the user messages carry no text", "messages")
    extra = body.get("extra_body")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise BadRequest("extra_body must be an object", "extra_body")
    return _generation(preset, extra, prompt, tuple(refs), "num_outputs_per_prompt", "extra_body.")


def parse_images(body: Any, preset: Preset) -> GenerationRequest:
    """POST /v1/images/generations (OpenAI shape with vLLM-Omni's extensions)."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise BadRequest("prompt must be a non-empty string", "prompt")
    fmt = body.get("response_format", "b64_json")
    if fmt not in (None, "b64_json"):
        raise BadRequest("only response_format b64_json is supported", "response_format")
    params = {k: body.get(k) for k in ("size", "seed", "num_inference_steps", "negative_prompt",
                                       "true_cfg_scale", "guidance_scale", "n")}
    return _generation(preset, params, prompt, (), "n", "")


def png_b64(png: bytes) -> str:
    return base64.b64encode(png).decode("ascii")


def chat_response(model: str, pngs: list[bytes] | None, text_tokens: int, peak_mb: float,
                  request_id: str) -> dict[str, Any]:
    """`pngs=None` gives the no-image shape: content is a plain string."""
    content: Any = "" if pngs is None else [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png_b64(p)}} for p in pngs
    ]
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                     "message": {"role": "assistant", "content": content}}],
        "usage": {"prompt_tokens": text_tokens, "completion_tokens": 0, "total_tokens": text_tokens},
        "peak_memory_mb": round(peak_mb, 3),
    }


def images_response(pngs: list[bytes] | None, peak_mb: float) -> dict[str, Any]:
    return {"created": int(time.time()),
            "data": [] if pngs is None else [{"b64_json": png_b64(p)} for p in pngs],
            "peak_memory_mb": round(peak_mb, 3)}


def new_request_id() -> str:
    return "chatcmpl-" + secrets.token_hex(16)
