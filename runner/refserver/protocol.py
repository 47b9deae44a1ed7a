"""vLLM-Omni's HTTP API subset: request bodies -> GenerationRequest, results -> response bodies.

`api` picks the generation imitated: "0.32" (today's source), "0.30" (the 0.30.0 release) or "2025-12" (the
Dec-2025 snapshot); the two releases read requests alike and differ in where the stage metrics go (0.32: only
when the request asks with `return_stage_metrics`). docs/refserver.md tabulates the differences.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import random
import re
import reprlib
import secrets
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from PIL import Image

from runner.refserver.config import DEFAULT_API, RELEASES, AnyPreset
from runner.refserver.engine import GenerationRequest

DATA_URI = re.compile(r"^data:image/[A-Za-z0-9.+-]+;base64,(?P<data>.*)$", re.DOTALL)
SIZE = re.compile(r"^\s*(\d{1,9})\s*[xX*]\s*(\d{1,9})\s*$")  # a side of 10 digits is past every preset
DEFAULT_STEPS = 50
DEFAULT_TRUE_CFG = 4.0
MAX_STEPS = 1000
MAX_OUTPUTS = 8
SIDE_MULTIPLE = 16


# vLLM-Omni 0.30's chat fields that may sit at the request root as well as under `extra_body`
# (serving_chat.py: common root fields + existing control fields); `cfg_scale` is an alias.
ROOT_FIELDS = frozenset({"height", "width", "num_outputs_per_prompt", "seed", "quality", "num_inference_steps",
                         "guidance_scale", "true_cfg_scale", "num_frames", "guidance_scale_2", "layers",
                         "resolution", "size", "negative_prompt", "lora", "modalities"})
ROOT_ALIASES = {"cfg_scale": "true_cfg_scale"}
DROPPED_WARNING = "Failed to decode reference image"


@dataclass(frozen=True)
class Parsed:
    request: GenerationRequest
    received_refs: int  # references in the request, decodable or not
    dropped: tuple[str, ...] = ()  # why each undecodable reference was dropped (0.30 serves without it)
    metrics_asked: bool = False  # a truthy `return_stage_metrics` (0.32 returns `metrics` only then)


ASK_METRICS = "return_stage_metrics"


def asks_metrics(*places: Any) -> bool:
    """vLLM-Omni's truthy test of `return_stage_metrics` in the first place that holds it: "1", "true",
    "yes", "on" for text (any case), Python truth otherwise."""
    for place in places:
        if isinstance(place, dict) and ASK_METRICS in place:
            value = place[ASK_METRICS]
            return value.lower() in {"1", "true", "yes", "on"} if isinstance(value, str) else bool(value)
    return False


class BadRequest(Exception):
    """A refused request: 400 unless said (422: vLLM-Omni 0.30's edits without an image)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


class TooManyPixels(BadRequest):
    """A reference whose header declares more pixels than the preset can use: refused (never dropped as
    undecodable, which it is not)."""


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_type(endpoint: str, status: int, api: str) -> str:
    """The error's `type`, as vLLM-Omni 0.30.0 answered it (measured): the images routes raise HTTP errors that
    vLLM's handler names by their status phrase ("Bad Request", "Unprocessable Entity"); the chat route's own
    error responses and a failed generation's 500 say "BadRequestError" (measured on chat; the images routes'
    500 is taken to be alike)."""
    if api in RELEASES and endpoint in ("images", "edits") and status < 500:
        return HTTPStatus(status).phrase
    return "BadRequestError" if api in RELEASES or status < 500 else "InternalServerError"


_SHOWN = reprlib.Repr()  # keyword arguments only from Python 3.12
_SHOWN.maxlevel, _SHOWN.maxdict, _SHOWN.maxlist = 3, 4, 4
_SHOWN.maxstring = _SHOWN.maxother = _SHOWN.maxlong = 40


def shown(value: Any) -> str:
    """A request's value as an error message quotes it: repr (control characters and surrogates escaped), cut
    short without building the whole repr (a body may be deep or a number 4000 digits long)."""
    text = _SHOWN.repr(value)
    return text if len(text) <= 80 else text[:80] + "…"


def missing_field(field: str, body: Any) -> BadRequest:
    """vLLM's answer to a JSON body without a required field: pydantic's error, its location as the param
    (0.30.0, measured: `1 validation error:\n  {'type': 'missing', 'loc': 'body.prompt', ...}`)."""
    return BadRequest(f"1 validation error:\n  {{'type': 'missing', 'loc': 'body.{field}', 'msg': 'Field required', "
                      f"'input': {shown(body)}}}", f"body.{field}")


# --- parsing helpers ------------------------------------------------------------------------------
MAX_DIGITS = 20  # an integer literal longer than this is no parameter value (2**63 has 19 digits)
_SURROGATE = re.compile("[\ud800-\udfff]")  # after json.loads only a lone one is left (pairs are combined)


def _bounded_int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_DIGITS:
        raise BadRequest(f"invalid JSON body: a number of {len(literal.lstrip('-'))} digits (at most {MAX_DIGITS})")
    return int(literal)


def load_json(raw: bytes | str) -> Any:
    """A request body as JSON, or a BadRequest in vLLM-Omni's 400 body: not JSON, nested too deep for the
    parser, an integer literal too long to be any parameter (Python's own limit, 4300 digits, is a ValueError
    from deep inside json), or a string holding a lone surrogate (not text: pydantic refuses it as
    `string_unicode`, and it cannot be encoded in UTF-8 where the prompt is tokenized or an answer written).
    Infinity and NaN are JSON to Python as they are to vLLM's parser: the parameter that gets one refuses it."""
    try:
        body = json.loads(raw, parse_int=_bounded_int)
    except RecursionError:
        raise BadRequest("invalid JSON body: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadRequest(f"invalid JSON body: {exc}") from None
    if (where := lone_surrogate(body)) is not None:
        raise BadRequest(f"invalid JSON body: the string at {where} holds a lone surrogate, which is no text", where)
    return body


def lone_surrogate(value: Any) -> str | None:
    """Where the first string (or key) holding a lone surrogate is ("messages[0].content"), None when none does.
    Walked without recursion: the body's depth is whatever the JSON parser allowed."""
    stack: list[tuple[str, Any]] = [("body", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and _SURROGATE.search(item):
                return path
        elif isinstance(item, dict):
            for key, child in item.items():
                if not key.isascii() and _SURROGATE.search(key):
                    return f"{path} (a key)"
                stack.append((f"{path}.{key}" if path != "body" else key, child))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", child) for i, child in enumerate(item))
    return None


DATA_URI_FAILED = "could not decode the image in the data URI"


def data_uri_bytes(url: str, param: str) -> bytes:
    m = DATA_URI.match(url)
    if not m:
        raise BadRequest("malformed image data URI: expected data:image/<type>;base64,<data>", param)
    try:
        return base64.b64decode(m.group("data"), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadRequest(f"{DATA_URI_FAILED}: {exc}", param) from None


def open_reference(raw: bytes, param: str, preset: AnyPreset, failed: str) -> Image.Image:
    """The image with only its header read (PIL reads the size without decoding a pixel): a reference that
    declares more pixels than the preset can use is refused here, before any memory is spent on it.
    `failed` begins the message of an image that does not open."""
    try:
        img = Image.open(io.BytesIO(raw))
    except Exception as exc:  # whatever a crafted file makes a format plugin raise: it does not decode
        raise BadRequest(f"{failed}: {exc}", param) from None
    width, height = img.size
    if width * height > preset.max_ref_pixels:
        side = math.isqrt(preset.max_ref_pixels)
        raise TooManyPixels(f"the image declares {width}x{height} pixels, more than the {preset.max_ref_pixels} "
                            f"({side}x{side}) a reference may have on preset {preset.name}", param)
    return img


def decode_reference(img: Image.Image, param: str, failed: str) -> Image.Image:
    """The pixels of an image whose header passed open_reference, as RGB."""
    try:
        img.load()
        return img.convert("RGB")
    except Exception as exc:  # as in open_reference
        raise BadRequest(f"{failed}: {exc}", param) from None


def _int(value: Any, param: str, lo: int, hi: int) -> int:
    # Infinity and NaN are floats a JSON body may carry (int() of them raises): not integers
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or int(value) != value:
        raise BadRequest(f"{param} must be an integer (got {shown(value)})", param)
    if not lo <= int(value) <= hi:
        raise BadRequest(f"{param} must be between {lo} and {hi} (got {shown(value)})", param)
    return int(value)


def _float(value: Any, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(f"{param} must be a number (got {shown(value)})", param)
    return float(value)


def _parse_size(value: Any, param: str) -> tuple[int, int]:
    m = SIZE.match(value) if isinstance(value, str) else None
    if not m:
        raise BadRequest(f"{param} must look like 'WIDTHxHEIGHT' (got {shown(value)})", param)
    return int(m.group(1)), int(m.group(2))


def default_size(preset: AnyPreset, refs: tuple[Image.Image, ...]) -> tuple[int, int]:
    """Preset default pixel count, at the first reference's aspect ratio, in multiples of 16."""
    side = preset.default_side
    if not refs:
        return side, side
    w0, h0 = refs[0].size
    aspect = w0 / h0
    width = max(SIDE_MULTIPLE, round(math.sqrt(side * side * aspect) / SIDE_MULTIPLE) * SIDE_MULTIPLE)
    height = max(SIDE_MULTIPLE, round(math.sqrt(side * side / aspect) / SIDE_MULTIPLE) * SIDE_MULTIPLE)
    return min(width, preset.max_side), min(height, preset.max_side)


def round_size(width: int, height: int) -> tuple[int, int]:
    """0.30: sides are rounded down to a multiple of 16 (at least 16), not refused."""
    return (max(SIDE_MULTIPLE, width // SIDE_MULTIPLE * SIDE_MULTIPLE),
            max(SIDE_MULTIPLE, height // SIDE_MULTIPLE * SIDE_MULTIPLE))


def check_size(preset: AnyPreset, width: int, height: int, param: str) -> None:
    for name, v in (("width", width), ("height", height)):
        if v < SIDE_MULTIPLE or v % SIDE_MULTIPLE:
            raise BadRequest(f"{name} must be a positive multiple of {SIDE_MULTIPLE} (got {v})", param)
        if v > preset.max_side:
            raise BadRequest(f"{name} {v} exceeds the maximum side {preset.max_side}", param)
    if width * height > preset.max_pixels:
        raise BadRequest(f"size {width}x{height} exceeds the maximum of {preset.max_pixels} pixels "
                         f"for preset {preset.name}", param)


def _generation(preset: AnyPreset, params: dict[str, Any], prompt: str, refs: tuple[Image.Image, ...],
                outputs_key: str, prefix: str, api: str) -> GenerationRequest:
    """The generation parameters shared by the endpoints; `prefix` names where they were read."""
    width, height = default_size(preset, refs)
    if params.get("size") is not None:
        width, height = _parse_size(params["size"], f"{prefix}size")
    if params.get("width") is not None:
        width = _int(params["width"], f"{prefix}width", 1, 1 << 20)
    if params.get("height") is not None:
        height = _int(params["height"], f"{prefix}height", 1, 1 << 20)
    if api in RELEASES:
        width, height = round_size(width, height)
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
    if neg is None and api == "2025-12":
        neg = ""  # the snapshot ran true CFG with an empty negative prompt; 0.30 needs one given
    n = params.get(outputs_key)
    n = 1 if n is None else _int(n, f"{prefix}{outputs_key}", 1, MAX_OUTPUTS)
    check_ref_count(preset, len(refs), api)
    return GenerationRequest(prompt=prompt, references=refs, width=width, height=height, steps=steps,
                             seed=seed, true_cfg_scale=cfg, negative_prompt=neg, num_outputs=n,
                             guidance_scale=guidance)


def max_body_bytes(preset: AnyPreset, api: str) -> int:
    """The largest body a request this server serves can need: as many references as it takes, each of the most
    pixels a reference may declare stored uncompressed (RGBA), in base64, and a MiB for the rest."""
    limit = preset.ref_limit if api in RELEASES else preset.max_refs
    return limit * preset.max_ref_pixels * 4 * 4 // 3 + 2**20


def check_ref_count(preset: AnyPreset, count: int, api: str) -> None:
    limit = preset.ref_limit if api in RELEASES else preset.max_refs
    if count > limit:
        raise BadRequest(f"Received {count} input images. At most {limit} images are supported by this model.",
                         "image")


def merged_params(body: dict[str, Any], api: str) -> dict[str, Any]:
    """Chat generation parameters. 2025-12: only the literal `extra_body` key. 0.30: the request root too
    (the OpenAI SDK's flat extra_body), and a key given in both places is refused."""
    extra = body.get("extra_body")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise BadRequest("extra_body must be an object", "extra_body")
    if api not in RELEASES:
        return dict(extra)
    sources: dict[str, list[str]] = {}
    for key in body:
        if key in ROOT_FIELDS or key in ROOT_ALIASES:
            sources.setdefault(ROOT_ALIASES.get(key, key), []).append(f"request.{key}")
    for key in extra:
        sources.setdefault(ROOT_ALIASES.get(key, key), []).append(f"request.extra_body.{key}")
    twice = {k: v for k, v in sources.items() if len(v) > 1}
    if twice:
        details = "; ".join(f'"{k}": {", ".join(v)}' for k, v in sorted(twice.items()))
        raise BadRequest(f"Diffusion request parameters were provided more than once: {details}.")
    merged = {ROOT_ALIASES.get(k, k): v for k, v in extra.items()}
    merged.update({ROOT_ALIASES.get(k, k): v for k, v in body.items() if k in ROOT_FIELDS or k in ROOT_ALIASES})
    return merged


# --- endpoints ------------------------------------------------------------------------------------
def damaged(url: str) -> str:
    """The data URI with its image bytes cut to a quarter (fault corrupt-ref)."""
    head, _, data = url.partition(",")
    try:
        raw = base64.b64decode(data)
    except (binascii.Error, ValueError):
        return url
    return head + "," + base64.b64encode(raw[: max(1, len(raw) // 4)]).decode()


def parse_chat(body: Any, preset: AnyPreset, api: str = DEFAULT_API, corrupt_ref: int | None = None) -> Parsed:
    """POST /v1/chat/completions: prompt = text parts of user messages, references = data-URI image_url
    parts in order (http(s) URLs ignored). 0.30 drops (logs) a reference that does not decode and serves
    the rest; 2025-12 refuses it with a 400.

    What a request may make the server hold is bounded before it is spent: the references are counted before
    any is decoded (0.30 decodes, drops and then counts; a request with more than the limit of which some do
    not decode is refused here and served there), and each one's header is read before any pixel is."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    texts: list[str] = []
    uris: list[tuple[str, str]] = []  # (data URI, param) of each reference, in order
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
                if url.startswith("data:"):  # http(s) URLs are ignored, as upstream does
                    uris.append((url, f"messages[{i}].content[{j}].image_url"))
    check_ref_count(preset, len(uris), api)
    opened: list[tuple[Image.Image, str]] = []
    dropped: list[str] = []
    for number, (url, param) in enumerate(uris, 1):
        try:
            raw = data_uri_bytes(damaged(url) if number == corrupt_ref else url, param)
            opened.append((open_reference(raw, param, preset, DATA_URI_FAILED), param))
        except BadRequest as exc:
            if api not in RELEASES or isinstance(exc, TooManyPixels):
                raise
            dropped.append(exc.message)
    refs: list[Image.Image] = []
    for img, param in opened:
        try:
            refs.append(decode_reference(img, param, DATA_URI_FAILED))
        except BadRequest as exc:
            if api not in RELEASES:
                raise
            dropped.append(exc.message)
    prompt = "\n".join(t for t in texts if t.strip())
    if not prompt.strip():
        raise BadRequest("no prompt: the user messages carry no text", "messages")
    params = merged_params(body, api)
    prefix = "" if api in RELEASES else "extra_body."
    req = _generation(preset, params, prompt, tuple(refs), "num_outputs_per_prompt", prefix, api)
    return Parsed(req, len(uris), tuple(dropped), asks_metrics(body.get("extra_body"), body))


def parse_images(body: Any, preset: AnyPreset, model: str = "", api: str = DEFAULT_API) -> Parsed:
    """POST /v1/images/generations (OpenAI shape with vLLM-Omni's extensions)."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    prompt = body.get("prompt")
    if "prompt" not in body and api in RELEASES:
        raise missing_field("prompt", body)
    if not isinstance(prompt, str) or not prompt.strip():
        raise BadRequest("prompt must be a non-empty string", "prompt")
    check_model(body.get("model"), model, api)
    fmt = body.get("response_format", "b64_json")
    if fmt not in (None, "b64_json"):
        raise BadRequest("only response_format b64_json is supported", "response_format")
    params = {k: body.get(k) for k in ("size", "seed", "num_inference_steps", "negative_prompt",
                                       "true_cfg_scale", "guidance_scale", "n")}
    return Parsed(_generation(preset, params, prompt, (), "n", "", api), 0, metrics_asked=asks_metrics(body))


def check_model(asked: Any, served: str, api: str) -> None:
    """The images routes' check (0.30.0, measured: 400, type "Bad Request", param null); chat has none."""
    if api in RELEASES and asked is not None and served and asked != served:
        raise BadRequest(f"Model mismatch: request specifies '{asked}' but server is running '{served}'.")


UPLOAD_FAILED = "Failed to open uploaded file"


def parse_edits(form: dict[str, Any], files: list[tuple[str, bytes]], preset: AnyPreset, model: str,
                api: str = DEFAULT_API) -> Parsed:
    """POST /v1/images/edits (multipart): `image` or `image[]` files in order, `prompt`, `size` ("auto" =
    the first image's size), `n`, and vLLM-Omni's `negative_prompt`, `num_inference_steps`,
    `guidance_scale`, `true_cfg_scale`, `seed`. An upload that does not decode is a 400 here (0.30)."""
    prompt = form.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise BadRequest("Field 'prompt' is required", "prompt")
    check_model(form.get("model"), model, api)
    if form.get("response_format", "b64_json") != "b64_json":
        raise BadRequest("Only response_format 'b64_json' is supported now.", "response_format")
    if not files:  # 0.30.0 answers 422 (measured; the message is the refserver's)
        raise BadRequest("Field 'image' or 'url' is required", "image", 422)
    check_ref_count(preset, len(files), api)
    opened = [(open_reference(data, name, preset, UPLOAD_FAILED), name) for name, data in files]
    refs = [decode_reference(img, name, UPLOAD_FAILED) for img, name in opened]

    def num(key: str, kind: type) -> Any:
        value = form.get(key)
        if value is None or value == "":
            return None
        try:
            return kind(value)
        except ValueError:  # also Python's limit on the digits of an int
            raise BadRequest(f"{key} must be a {kind.__name__} (got {shown(value)})", key) from None

    params: dict[str, Any] = {"num_inference_steps": num("num_inference_steps", int), "seed": num("seed", int),
                              "true_cfg_scale": num("true_cfg_scale", float),
                              "guidance_scale": num("guidance_scale", float), "n": num("n", int),
                              "negative_prompt": form.get("negative_prompt")}
    size = form.get("size") or "auto"
    if size == "auto":
        params["width"], params["height"] = refs[0].size
    else:
        params["size"] = size
    return Parsed(_generation(preset, params, prompt, tuple(refs), "n", "", api), len(files),
                  metrics_asked=asks_metrics(form))


def png_b64(png: bytes) -> str:
    return base64.b64encode(png).decode("ascii")


def stage_durations(api: str, seconds: float, queue_s: float = 0.0) -> dict[str, float]:
    """0.30.0 names each duration's unit, milliseconds (measured: `queue_wait_ms`, `stage_0_gen_ms`); 0.32
    (not re-read) keeps the refserver's seconds under `diffusion`."""
    if api == "0.30":
        return {"queue_wait_ms": round(queue_s * 1000, 3), "stage_0_gen_ms": round(seconds * 1000, 3)}
    return {"diffusion": round(seconds, 4)}


def stage_metrics(peak_mb: float, seconds: float) -> dict[str, Any]:
    """0.32's `metrics`: `float(peak or 0.0)`, so a request that measured nothing reports 0.0."""
    return {"stage_durations": stage_durations("0.32", seconds), "peak_memory_mb": float(round(peak_mb, 3) or 0.0)}


def chat_response(model: str, pngs: list[bytes] | None, text_tokens: int, peak_mb: float,
                  request_id: str, api: str = DEFAULT_API, seconds: float = 0.0, asked: bool = False,
                  queue_s: float = 0.0) -> dict[str, Any]:
    """`pngs=None` gives the no-image shape: content is a plain string. 0.32 returns a top-level `metrics`
    (stage_durations, peak_memory_mb) only when `asked`; 0.30 puts them in each image part and answers a
    top-level `"metrics": null` (measured); 2025-12 (the refserver's older shape) a top-level
    `peak_memory_mb`."""
    per_image = {"stage_durations": stage_durations(api, seconds, queue_s), "peak_memory_mb": round(peak_mb, 3)}
    content: Any = "" if pngs is None else [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png_b64(p)},
         **(per_image if api == "0.30" else {})} for p in pngs
    ]
    if api in RELEASES and pngs is None:
        content = "Image generation completed but no images were produced."
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                     "message": {"role": "assistant", "content": content}}],
        "usage": {"prompt_tokens": text_tokens, "completion_tokens": 0, "total_tokens": text_tokens},
    }
    if api == "0.32" and asked:
        body["metrics"] = stage_metrics(peak_mb, seconds)
    elif api == "0.30":
        body["metrics"] = None
    if api not in RELEASES:
        body["peak_memory_mb"] = round(peak_mb, 3)
    return body


def images_response(pngs: list[bytes] | None, peak_mb: float, api: str = DEFAULT_API, seconds: float = 0.0,
                    size: tuple[int, int] | None = None, asked: bool = False, queue_s: float = 0.0
                    ) -> dict[str, Any]:
    """0.32: `metrics` only when `asked` (0.0 when not measured); 0.30: `metrics.peak_memory_mb` always (None
    when 0, as that release), each image with `url` and `revised_prompt` null and a `cot_output` null
    (measured); 2025-12 shape: top-level."""
    nulls = {"url": None, "revised_prompt": None} if api == "0.30" else {}
    body: dict[str, Any] = {"created": int(time.time()),
                            "data": [] if pngs is None else [{"b64_json": png_b64(p), **nulls} for p in pngs]}
    if api in RELEASES:
        body["output_format"] = "png"
        if size is not None:
            body["size"] = f"{size[0]}x{size[1]}"
    if api == "0.30":
        body["cot_output"] = None
    if api == "0.32" and asked:
        body["metrics"] = stage_metrics(peak_mb, seconds)
    elif api == "0.30":
        body["metrics"] = {"stage_durations": stage_durations(api, seconds, queue_s),
                           "peak_memory_mb": round(peak_mb, 3) or None}
    elif api not in RELEASES:
        body["peak_memory_mb"] = round(peak_mb, 3)
    return body


def new_request_id() -> str:
    return "chatcmpl-" + secrets.token_hex(16)
