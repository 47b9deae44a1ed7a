"""Per-API request building and response parsing. Pure: bytes in, values out.

`vllm-omni-chat` is vLLM-Omni's working image path (chat completions, references as data-URI image_url
parts in order, generation parameters under a literal `extra_body` key, which both the Dec-2025 snapshot and
0.30 read); `openai-images` is the OpenAI images/generations shape (no references); `openai-images-edits`
is the multipart images/edits route the OpenAI SDK uses for multi-image edits (vLLM-Omni 0.30: several
`image[]` files plus steps / true_cfg_scale / seed form fields).

The server's own peak (`peak_memory_mb`, MiB despite the name: bytes / 1024²) is read from every place a
vLLM-Omni generation puts it, and recorded with where it came from and what it measures.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runner.core.registry import DIALECTS, load
from runner.observe.reading import BadReading, to_bytes


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
    body: dict[str, Any]  # JSON body, or the form fields of a multipart call (when files are given)
    files: tuple[tuple[str, tuple[str, bytes, str]], ...] = ()  # multipart: (field, (filename, data, mime))

    def httpx_kwargs(self) -> dict[str, Any]:
        """What httpx.Client.post needs to send this call."""
        if self.files:
            return {"data": {k: str(v) for k, v in self.body.items()}, "files": list(self.files)}
        return {"json": self.body}


@dataclass(frozen=True)
class ServerPeak:
    """A `peak_memory_mb` the server reported in its response."""

    mib: float
    source: str  # where in the response, e.g. "choices[0].message.content[0].peak_memory_mb"
    measures: str  # "reserved" (vLLM-Omni 0.30: torch max_memory_reserved per request) or "unspecified"


@dataclass(frozen=True)
class Parsed:
    image: bytes | None
    server_peak: ServerPeak | None
    problem: str | None  # why no image came back from a 200 response


def _data_uri(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def chat(req: ImageRequest) -> HttpCall:
    """POST /v1/chat/completions: ordered image_url references, generation parameters in a literal
    `extra_body` key (the placement every vLLM-Omni generation reads)."""
    extra: dict[str, Any] = {"num_inference_steps": req.steps, "seed": req.seed}
    if req.size:
        extra["width"], extra["height"] = req.size
    extra |= _cfg(req)
    content: list[dict[str, Any]] = [{"type": "text", "text": req.prompt}]
    content += [{"type": "image_url", "image_url": {"url": _data_uri(m, d)}} for m, d in req.references]
    return HttpCall("/v1/chat/completions", {"model": req.model,
                                              "messages": [{"role": "user", "content": content}],
                                              "extra_body": extra})


def _cfg(req: ImageRequest) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if req.true_cfg_scale is not None:
        out["true_cfg_scale"] = req.true_cfg_scale
    if req.negative_prompt is not None:
        out["negative_prompt"] = req.negative_prompt
    return out


def _images_fields(req: ImageRequest) -> dict[str, Any]:
    """The OpenAI images fields with vLLM-Omni's extensions, shared by generations (JSON) and edits (form)."""
    fields: dict[str, Any] = {"model": req.model, "prompt": req.prompt, "n": 1, "response_format": "b64_json",
                              "seed": req.seed, "num_inference_steps": req.steps}
    if req.size:
        fields["size"] = f"{req.size[0]}x{req.size[1]}"
    return fields | _cfg(req)


def generations(req: ImageRequest) -> HttpCall:
    """POST /v1/images/generations (no references)."""
    return HttpCall("/v1/images/generations", _images_fields(req))


def edits(req: ImageRequest) -> HttpCall:
    """POST /v1/images/edits, multipart: one `image[]` part per reference, in order."""
    ext = {"image/png": "png", "image/jpeg": "jpg", "image/webp": "webp"}
    files = tuple(("image[]", (f"ref-{i + 1}.{ext.get(m, 'bin')}", d, m)) for i, (m, d) in enumerate(req.references))
    return HttpCall("/v1/images/edits", _images_fields(req), files)


def chat_images(doc: dict[str, Any]) -> list[str] | str:
    """The image URLs of a chat completion, or why there are none."""
    try:
        content = doc["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        return "response has no choices[0].message.content"
    if isinstance(content, str):
        return f"content is text, not images: {content[:80]!r}"
    return [p.get("image_url", {}).get("url", "") for p in content
            if isinstance(p, dict) and p.get("type") == "image_url"]


def images_data(doc: dict[str, Any]) -> list[str] | str:
    """images/generations and images/edits answer in the same shape: data[].b64_json."""
    return [d.get("b64_json", "") for d in doc.get("data", []) if isinstance(d, dict)]


def build(dialect: str, req: ImageRequest) -> HttpCall:
    """The HTTP call of a request in a dialect (its registry entry names the builder)."""
    builder: Callable[[ImageRequest], HttpCall] = load(DIALECTS.get(dialect).build)
    return builder(req)


def _b64(text: str) -> bytes | None:
    if text.startswith("data:"):
        text = text.partition(",")[2]
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


def _number(value: Any) -> float | None:
    """A peak_memory_mb that is a memory figure (reading.py: finite, not negative, below 1 PiB), else None:
    a NaN or -5000 in a response is no peak."""
    try:
        to_bytes(value, "peak_memory_mb", 2**20)
    except BadReading:
        return None
    return float(value)


def server_peak(doc: dict[str, Any]) -> ServerPeak | None:
    """The first `peak_memory_mb` found, in the order vLLM-Omni generations put it:
    0.30 chat: in each image part of choices[0].message.content (all parts carry the request's one figure);
    0.30 images API (and multi-stage chat): metrics.peak_memory_mb; older shapes: a top-level field."""
    try:
        content = doc["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        content = None
    if isinstance(content, list):
        for i, part in enumerate(content):
            if isinstance(part, dict) and (v := _number(part.get("peak_memory_mb"))) is not None:
                return ServerPeak(v, f"choices[0].message.content[{i}].peak_memory_mb", "reserved")
    metrics = doc.get("metrics")
    if isinstance(metrics, dict) and (v := _number(metrics.get("peak_memory_mb"))) is not None:
        return ServerPeak(v, "metrics.peak_memory_mb", "reserved")
    if (v := _number(doc.get("peak_memory_mb"))) is not None:
        return ServerPeak(v, "peak_memory_mb", "unspecified")
    return None


def parse(dialect: str, body: bytes) -> Parsed:
    """Parse a 200 response body into the first image, or say why there is none."""
    try:
        doc = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return Parsed(None, None, f"response is not JSON: {body[:80]!r}")
    if not isinstance(doc, dict):
        return Parsed(None, None, "response JSON is not an object")
    peak = server_peak(doc)
    urls = load(DIALECTS.get(dialect).images)(doc)
    if isinstance(urls, str):
        return Parsed(None, peak, urls)
    if not urls:
        return Parsed(None, peak, "response holds no image")
    image = _b64(urls[0])
    if image is None:
        return Parsed(None, peak, "image is not valid base64")
    return Parsed(image, peak, None)


@dataclass(frozen=True)
class Profiler:
    """How a server is asked for an allocator snapshot: its extra args, then POST start before the request and
    POST stop after it; it writes `<folder>/<timestamp>_<name>/<pattern>`."""

    args: tuple[str, ...]
    start_path: str
    stop_path: str
    pattern: str


def vllm_omni_profiler(folder: str) -> Profiler:
    """vLLM-Omni's spelling (vllm_omni/profiler/omni_torch_profiler.py): --profiler-config JSON, POST
    /start_profile and /stop_profile, DIR/<timestamp>_<name>/memory_snapshot_rank<N>.pickle."""
    config = {"profiler": "torch", "torch_profiler_dir": folder, "torch_profiler_with_memory": True}
    return Profiler(("--profiler-config", json.dumps(config)), "/start_profile", "/stop_profile",
                    "memory_snapshot_rank*.pickle")


def profiler(dialect: str, folder: str) -> Profiler | None:
    """The dialect's profiler interface for a folder as the server sees it; None: the server has none."""
    target = DIALECTS.get(dialect).profiler
    return None if target is None else load(target)(folder)

