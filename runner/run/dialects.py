"""Per-API request building and response parsing. Pure: bytes in, values out.

`vllm-omni-chat` is vLLM-Omni's working image path (chat completions, references as data-URI image_url
parts in order, generation parameters under a literal `extra_body` key, which both the Dec-2025 snapshot and
0.30 read); `openai-images` is the OpenAI images/generations shape (no references); `openai-images-edits`
is the multipart images/edits route the OpenAI SDK uses for multi-image edits (vLLM-Omni 0.30: several
`image[]` files plus steps / true_cfg_scale / seed form fields).

The server's own peak (`peak_memory_mb`, MiB despite the name: bytes / 1024²) is read from every place a
vLLM-Omni generation puts it, and recorded with where it came from and what it measures. Every request asks
for it (`return_stage_metrics: true`: today's vLLM-Omni returns its `metrics` only when asked; older servers
ignore the key). A 0 (or null, or anything not a finite positive figure) is no reading: vLLM-Omni answers
`float(peak or 0.0)` when its worker measured nothing, so a 0.0 is "not measured", never a 0-byte peak.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runner.core.records import ServedModel, stage_seconds
from runner.core.registry import DIALECTS, load
from runner.observe import quote
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
        if self.files:  # form fields are text: a bool as JSON spells it (FastAPI and vLLM-Omni read "true")
            return {"data": {k: json.dumps(v) if isinstance(v, bool) else str(v) for k, v in self.body.items()},
                    "files": list(self.files)}
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
    peak_unread: str | None = None  # the response named a peak that is no reading (0.0: not measured)
    stage_durations: dict[str, float] | None = None  # metrics.stage_durations: seconds per stage


ASK_METRICS = "return_stage_metrics"  # the request key that makes today's vLLM-Omni return `metrics`
MAX_STAGES = 16  # stage_durations kept per response (a server's dict is untrusted)


def _data_uri(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def chat(req: ImageRequest) -> HttpCall:
    """POST /v1/chat/completions: ordered image_url references, generation parameters in a literal
    `extra_body` key (the placement every vLLM-Omni generation reads)."""
    extra: dict[str, Any] = {"num_inference_steps": req.steps, "seed": req.seed, ASK_METRICS: True}
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
                              "seed": req.seed, "num_inference_steps": req.steps, ASK_METRICS: True}
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


def _reading(value: Any) -> float | str:
    """A peak_memory_mb that is a memory figure (reading.py: finite, not negative, below 1 PiB) and above 0,
    else why it is none: a 0.0 or null is vLLM-Omni's "not measured", a NaN or -5000 no figure at all."""
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0):
        return f"the server reported {'null' if value is None else '0.0'} (not measured)"
    try:
        to_bytes(value, "peak_memory_mb", 2**20)
    except BadReading:
        return f"the server reported {str(value)[:40]!r}: not a memory figure"
    return float(value)


def _peak_places(doc: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """Every (place, value, what it measures) a response holds a peak_memory_mb at, in the order vLLM-Omni
    generations put it: 0.30 chat: in each image part of choices[0].message.content (all parts carry the
    request's one figure); the images API, multi-stage chat and today's chat when asked: metrics.peak_memory_mb;
    older shapes: a top-level field."""
    try:
        content = doc["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        content = None
    places = []
    if isinstance(content, list):
        places += [(f"choices[0].message.content[{i}].peak_memory_mb", part["peak_memory_mb"], "reserved")
                   for i, part in enumerate(content[:64]) if isinstance(part, dict) and "peak_memory_mb" in part]
    metrics = doc.get("metrics")
    if isinstance(metrics, dict) and "peak_memory_mb" in metrics:
        places.append(("metrics.peak_memory_mb", metrics["peak_memory_mb"], "reserved"))
    if "peak_memory_mb" in doc:
        places.append(("peak_memory_mb", doc["peak_memory_mb"], "unspecified"))
    return places


def server_peak(doc: dict[str, Any]) -> ServerPeak | None:
    """The first `peak_memory_mb` that is a reading (see _peak_places for the order)."""
    for place, value, measures in _peak_places(doc):
        if isinstance(v := _reading(value), float):
            return ServerPeak(v, place, measures)
    return None


def peak_unread(doc: dict[str, Any]) -> str | None:
    """Why a response that names a peak gives none (the first place's reason), or None: it gave one, or named
    none at all."""
    reasons = [(place, r) for place, value, _ in _peak_places(doc) if isinstance(r := _reading(value), str)]
    if not reasons or server_peak(doc) is not None:
        return None
    place, reason = reasons[0]
    return f"{place}: {reason}"


def stage_durations(doc: dict[str, Any]) -> dict[str, float] | None:
    """metrics.stage_durations (today's vLLM-Omni, when asked; 0.30: also in each chat image part): the
    server's own seconds per stage, the finite non-negative ones, names cut to 64 characters. 0.30.0 names
    its unit (`queue_wait_ms`, `stage_0_gen_ms`: milliseconds, measured): such a key becomes seconds under
    its name without the suffix (runner.core.records.stage_seconds); a key without a unit is seconds."""
    metrics = doc.get("metrics")
    found = metrics.get("stage_durations") if isinstance(metrics, dict) else None
    if not isinstance(found, dict):
        try:
            parts = doc["choices"][0]["message"]["content"]
            found = next((p["stage_durations"] for p in parts[:64] if isinstance(p, dict)
                          and isinstance(p.get("stage_durations"), dict)), None)
        except (KeyError, IndexError, TypeError):
            found = None
    if not isinstance(found, dict):
        return None
    found = stage_seconds({str(k): v for k, v in list(found.items())[:MAX_STAGES]})
    out = {k[:64]: float(v) for k, v in found.items()
           if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v < 1e7}
    return out or None


def parse(dialect: str, body: bytes) -> Parsed:
    """Parse a 200 response body into the first image, or say why there is none."""
    try:
        doc = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return Parsed(None, None, f"response is not JSON: {body[:80]!r}")
    if not isinstance(doc, dict):
        return Parsed(None, None, "response JSON is not an object")
    peak, unread, stages = server_peak(doc), peak_unread(doc), stage_durations(doc)
    urls = load(DIALECTS.get(dialect).images)(doc)
    if isinstance(urls, str):
        return Parsed(None, peak, urls, unread, stages)
    if not urls:
        return Parsed(None, peak, "response holds no image", unread, stages)
    image = _b64(urls[0])
    if image is None:
        return Parsed(None, peak, "image is not valid base64", unread, stages)
    return Parsed(image, peak, None, unread, stages)


# --- what the server serves ----------------------------------------------------------------------------------
# vLLM-Omni answers vLLM's OpenAI-compatible `GET /v1/models`: {"object": "list", "data": [{"id": <the served
# model: the path or --served-model-name>, "object": "model", "root": …, …}]} (0.30.0, measured). Its
# images/generations and images/edits refuse a request whose `model` is not that id (400 "Model mismatch:
# request specifies 'X' but server is running 'Y'."); its diffusion chat route serves it (200).
MODELS_PATH = "/v1/models"
MODELS_DEADLINE_S = 5.0  # one small JSON answer from a server that is ready
MODELS_BYTES = 1 << 20
MAX_MODELS = 16
MODEL_ID_CHARS = 256


def served_ids(status: int, body: bytes) -> tuple[str, ...] | str:
    """The model ids a /v1/models answer lists, in order (at most MAX_MODELS), or why it lists none."""
    if status != 200:
        return f"HTTP {status}"
    try:
        doc = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return "not JSON"
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        return "no `data` list"
    ids = tuple(m["id"] for m in data[:MAX_MODELS] if isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"])
    return ids or "no model id in `data`"


def served_model(table: str, sent: str, answer: tuple[str, ...] | str, route_checks: bool,
                 secrets: tuple[str, ...] = ()) -> ServedModel:
    """The `model` sent against what the server serves (`answer`: served_ids), with the one line to say when
    they differ: what to set in the matrix, and what becomes of the requests. The ids are server text: cut,
    masked and made one inert line before they are kept or shown."""
    if isinstance(answer, str):
        why = quote.console(quote.server_text(answer[:MODEL_ID_CHARS], secrets))  # an error may quote the server
        return ServedModel(sent=sent, matches=None, route_checks=route_checks,
                           note=f"GET {MODELS_PATH} gave no list of served models ({why}): the model {sent!r} is "
                                "sent unchecked")
    shown = tuple(quote.console(quote.server_text(i[:MODEL_ID_CHARS], secrets)) for i in answer)
    if sent in answer:
        return ServedModel(sent=sent, served=shown, matches=True, route_checks=route_checks)
    what = ("vLLM-Omni 0.30 refuses each of these requests with 400 \"Model mismatch\" (all are sent and "
            "recorded with the server's answer)" if route_checks else
            "its chat route does not check the model, so the requests are served")
    # json.dumps: a TOML basic string the user can paste (quotes and backslashes escaped)
    key = table if re.fullmatch(r"[A-Za-z0-9_-]+", table) else json.dumps(table)  # a TOML bare key, else quoted
    line = (f"[servers.{key}] model = {json.dumps(shown[0], ensure_ascii=False)}: the matrix's model {sent!r} "
            f"is not what the server serves {', '.join(repr(i) for i in shown)}; {what}")
    return ServedModel(sent=sent, served=shown, matches=False, route_checks=route_checks, note=quote.console(line))


@dataclass(frozen=True)
class Profiler:
    """How a server is asked for an allocator snapshot: its extra args, then POST start before the request and
    POST stop after it; it writes `<folder>/<timestamp>_<name>/<pattern>`, and a Chrome trace (`trace`) beside it
    where it has one. `warm_first`: a request must have run before the profiler starts (see vllm_omni_profiler).
    `endpoints_only`: a line of the server's log that shows it is one whose profiler starts only through its
    endpoints, so a load OOM (the port never opens) cannot be recorded and no pass is started for one."""

    args: tuple[str, ...]
    start_path: str
    stop_path: str
    pattern: str
    trace: str | None = None
    warm_first: bool = False
    endpoints_only: str | None = None  # a regular expression


def vllm_omni_profiler(folder: str) -> Profiler:
    """vLLM-Omni's spelling (vllm_omni/profiler/omni_torch_profiler.py): --profiler-config JSON, POST
    /start_profile and /stop_profile, DIR/<timestamp>_<name>/memory_snapshot_rank<N>.pickle."""
    # No Python stacks in the trace and no CUDA-time table at stop: the allocator snapshot records its own stacks, and
    # on the CPU stand the two took ~100 s of a 4-reference pass's /stop_profile (160k python_function events).
    config = {"profiler": "torch", "torch_profiler_dir": folder, "torch_profiler_with_memory": True,
              "torch_profiler_with_stack": False, "torch_profiler_dump_cuda_time_total": False}
    # warm_first: 0.30.0 runs /start_profile on the thread that serves requests only once a request has started its
    # busy loop; before that it starts the torch profiler on another thread than /stop_profile ends it on, and the
    # stop kills the server (a segfault in the profiler: measured on the real server, vLLM-Omni's
    # diffusion_engine.py collective_rpc). One request first puts both on the busy loop.
    # endpoints_only: vLLM's own banner, logged before the load; the reference server, which records its load under
    # the same config (runner/refserver/profiler.py), logs no such line
    return Profiler(("--profiler-config", json.dumps(config)), "/start_profile", "/stop_profile",
                    "memory_snapshot_rank*.pickle", trace="trace_rank*.json*", warm_first=True,
                    endpoints_only=r"vLLM server version [\w.+-]{1,40}")


def profiler(dialect: str, folder: str) -> Profiler | None:
    """The dialect's profiler interface for a folder as the server sees it; None: the server has none."""
    target = DIALECTS.get(dialect).profiler
    return None if target is None else load(target)(folder)

