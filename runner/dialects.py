"""Per-API request building and response parsing. Pure: bytes in, values out.

`vllm-omni-chat` is vLLM-Omni's working image path (chat completions, references as data-URI image_url
parts in order, generation parameters under a literal `extra_body` key); `openai-images` is the OpenAI
images/generations shape (no references).
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ImageRequest:
    model: str
    prompt: str
    references: tuple[tuple[str, bytes], ...]  # (mime type, bytes), in order
    seed: int
    steps: int
    size: tuple[int, int] | None
    true_cfg_scale: float | None = None
    negative_prompt: str | None = None


@dataclass(frozen=True)
class HttpCall:
    path: str
    body: dict[str, Any]


@dataclass(frozen=True)
class Parsed:
    image: bytes | None
    server_peak_mb: float | None
    problem: str | None  # why no image came back from a 200 response


def _data_uri(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def build(dialect: str, req: ImageRequest) -> HttpCall:
    if dialect == "vllm-omni-chat":
        extra: dict[str, Any] = {"num_inference_steps": req.steps, "seed": req.seed}
        if req.size:
            extra["width"], extra["height"] = req.size
        if req.true_cfg_scale is not None:
            extra["true_cfg_scale"] = req.true_cfg_scale
        if req.negative_prompt is not None:
            extra["negative_prompt"] = req.negative_prompt
        content: list[dict[str, Any]] = [{"type": "text", "text": req.prompt}]
        content += [{"type": "image_url", "image_url": {"url": _data_uri(m, d)}} for m, d in req.references]
        return HttpCall("/v1/chat/completions", {"model": req.model,
                                                  "messages": [{"role": "user", "content": content}],
                                                  "extra_body": extra})
    if dialect == "openai-images":
        body: dict[str, Any] = {"model": req.model, "prompt": req.prompt, "n": 1,
                                "response_format": "b64_json", "seed": req.seed,
                                "num_inference_steps": req.steps}
        if req.size:
            body["size"] = f"{req.size[0]}x{req.size[1]}"
        if req.true_cfg_scale is not None:
            body["true_cfg_scale"] = req.true_cfg_scale
        if req.negative_prompt is not None:
            body["negative_prompt"] = req.negative_prompt
        return HttpCall("/v1/images/generations", body)
    raise ValueError(f"unknown dialect {dialect!r}")


def _b64(text: str) -> bytes | None:
    if text.startswith("data:"):
        text = text.partition(",")[2]
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


def _peak(doc: dict[str, Any]) -> float | None:
    value = doc.get("peak_memory_mb")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def parse(dialect: str, body: bytes) -> Parsed:
    """Parse a 200 response body into the first image, or say why there is none."""
    try:
        doc = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return Parsed(None, None, f"response is not JSON: {body[:80]!r}")
    if not isinstance(doc, dict):
        return Parsed(None, None, "response JSON is not an object")
    peak = _peak(doc)
    if dialect == "vllm-omni-chat":
        try:
            content = doc["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            return Parsed(None, peak, "response has no choices[0].message.content")
        if isinstance(content, str):
            return Parsed(None, peak, f"content is text, not images: {content[:80]!r}")
        urls = [p.get("image_url", {}).get("url", "") for p in content
                if isinstance(p, dict) and p.get("type") == "image_url"]
    else:
        urls = [d.get("b64_json", "") for d in doc.get("data", []) if isinstance(d, dict)]
    if not urls:
        return Parsed(None, peak, "response holds no image")
    image = _b64(urls[0])
    if image is None:
        return Parsed(None, peak, "image is not valid base64")
    return Parsed(image, peak, None)
