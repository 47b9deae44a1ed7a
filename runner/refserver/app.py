"""The FastAPI app: endpoints, one-at-a-time execution, fault injection and error shapes."""

from __future__ import annotations

import gc
import itertools
import json
import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import anyio
import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from PIL import Image

from runner.refserver import protocol
from runner.refserver.bodycap import BodyCap
from runner.refserver.config import RELEASES, ServerConfig
from runner.refserver.engine import AnyEngine, GenerationRequest, GenerationResult, png_bytes
from runner.refserver.faults import hold_host_memory
from runner.refserver.memory import as_raised_by_allocator, is_oom
from runner.refserver.metrics import Metrics
from runner.refserver.protocol import BadRequest, error_body

log = logging.getLogger("refserver")

# GET /version of each release imitated: 0.30.0 measured; 0.32's by analogy (vLLM's route, the release's own
# version), not re-read
VERSIONS = {"0.30": "0.30.0", "0.32": "0.32.0"}

# What the Dec-2025 snapshot's client saw on a mid-request CUDA OOM: a 500 whose message hides the cause;
# the OOM text is only in the server log. 0.30 answers "Image generation failed: <the error text>".
GENERATION_FAILED = "Internal server error: generation failed"


@dataclass(frozen=True)
class Reply:
    status: int
    body: Any  # a JSON-able object, or str for a raw (possibly malformed) body

    def response(self) -> Response:
        if isinstance(self.body, str):
            return Response(self.body, status_code=self.status, media_type="application/json")
        return JSONResponse(self.body, status_code=self.status)


def _flush_logs() -> None:
    for h in logging.getLogger().handlers:
        h.flush()
    sys.stderr.flush()


class Service:
    """Executes generation requests strictly one at a time and applies the fault plan."""

    def __init__(self, engine: AnyEngine, config: ServerConfig, metrics: Metrics) -> None:
        self.engine, self.config, self.metrics = engine, config, metrics
        self.lock = threading.Lock()
        self.counter = itertools.count(1)
        self.stopping = threading.Event()  # releases hung requests at shutdown

    def parse(self, endpoint: str, raw: Any) -> protocol.Parsed:
        c = self.config
        if endpoint == "edits":
            form, files = raw
            return protocol.parse_edits(form, files, c.preset, c.model_name, c.api)
        body = protocol.load_json(raw)
        if endpoint == "chat":
            return protocol.parse_chat(body, c.preset, c.api, c.faults.corrupt_ref)
        return protocol.parse_images(body, c.preset, c.model_name, c.api)

    def execute(self, n: int, endpoint: str, raw: Any, rid: str) -> Reply:
        t0 = time.perf_counter()
        faults = self.config.faults.for_request(n)
        scrapes_at_arrival = self.metrics.scrapes
        # Parsing decodes the references: under the lock, so requests that arrive together hold one request's
        # decoded images at a time, never one set each while they wait.
        with self.lock:
            queue_s = time.perf_counter() - t0
            try:
                parsed = self.parse(endpoint, raw)
            except BadRequest as exc:
                return self.refuse(n, rid, endpoint, t0, exc.message, exc.param, exc.status)
            except Exception:  # a request this parser did not foresee: vLLM-Omni's error body, never plain text
                log.exception("request %d id=%s could not be parsed", n, rid)
                return self.refuse(n, rid, endpoint, t0, "Internal server error: the request could not be parsed",
                                 None, 500)
            req = replace(parsed.request, leak_bytes=self.config.faults.leak_bytes(n))
            if endpoint == "chat":  # vLLM-Omni 0.30's own lines: the count received, then each one dropped
                log.info("Diffusion chat request %s: ref_images=%d", rid, parsed.received_refs)
                for why in parsed.dropped:
                    log.warning("%s: %s", protocol.DROPPED_WARNING, why)
            log.info("request %d id=%s start endpoint=%s refs=%d size=%dx%d steps=%d seed=%d true_cfg=%.2f "
                     "cfg_runs=%s outputs=%d cond_cache=%s queue_s=%.3f faults=%s", n, rid, endpoint,
                     len(req.references), req.width, req.height, req.steps, req.seed, req.true_cfg_scale,
                     req.true_cfg_scale > 1 and req.negative_prompt is not None, req.num_outputs,
                     self.config.cond_cache, queue_s, ",".join(sorted(faults)) or "-")
            _flush_logs()
            if (mib := self.config.faults.host_mib(n)) > 0:
                log.warning("fault host-memory@%d: allocating %d MiB of host memory and keeping it", n, mib)
                _flush_logs()
                hold_host_memory(mib)
            if (delay := self.config.faults.delay_s(n)) > 0:  # fault jitter: a controlled latency
                time.sleep(delay)
            try:
                result = self.engine.generate(req, self._step_hook(n, faults))
            except Exception as exc:
                oom = is_oom(exc)
                if oom:  # the full allocator text and its traceback go to the log only, as upstream
                    log.error("request %d id=%s generation failed: %s", n, rid, exc,
                              exc_info=as_raised_by_allocator(exc))
                else:
                    log.exception("request %d id=%s generation failed", n, rid)
                message = (GENERATION_FAILED if self.config.oom_reply == "mangled"
                           else f"Image generation failed: {exc}")
                del exc
                reply = Reply(500, error_body(message, protocol.error_type(endpoint, 500, self.config.api), 500))
            else:
                reply = self._ok(n, endpoint, req, result, rid, faults, parsed.metrics_asked, queue_s)
                if "scraped" in faults and not self.metrics.wait_for_scrapes(scrapes_at_arrival + 2, 10.0):
                    log.warning("fault scraped@%d: /metrics was not scraped twice in 10 s; answering anyway", n)
            finally:
                gc.collect()
                if self.engine.device.type == "cuda":
                    torch.cuda.empty_cache()
            peak_mb = self.engine.mem.peak() / 2**20
            reserved_mb = self.engine.mem.peak_reserved() / 2**20
            # what the request left behind: the engine's memory now, after the collection above (/metrics:
            # refserver_device_memory_bytes)
            now_mb = self.engine.mem.current() / 2**20
            log.info("request %d id=%s done status=%d queue_s=%.3f run_s=%.3f total_s=%.3f peak_mb=%.2f "
                     "peak_reserved_mb=%.2f current_mb=%.2f", n, rid, reply.status, queue_s,
                     time.perf_counter() - t0 - queue_s, time.perf_counter() - t0, peak_mb, reserved_mb, now_mb)
            _flush_logs()
            return reply

    def refuse(self, n: int, rid: str, endpoint: str, t0: float, message: str, param: str | None,
             status: int = 400) -> Reply:
        log.info("request %d id=%s endpoint=%s status=%d total_s=%.3f error=%s", n, rid, endpoint, status,
                 time.perf_counter() - t0, message)
        return Reply(status, error_body(message, protocol.error_type(endpoint, status, self.config.api), status,
                                        param))

    def _step_hook(self, n: int, faults: frozenset[str]) -> Callable[[int, int], None] | None:
        if "exit" in faults:
            def hook(output: int, step: int) -> None:
                log.error("fault exit@%d: exiting with code 1 in the middle of the request", n)
                _flush_logs()
                os._exit(1)
            return hook
        if "hang" in faults:
            def hook(output: int, step: int) -> None:
                log.warning("fault hang@%d: this request will never return", n)
                _flush_logs()
                self.stopping.wait()
                raise RuntimeError("server shutting down during a hung request")
            return hook
        return None

    def _ok(self, n: int, endpoint: str, req: GenerationRequest, result: GenerationResult, rid: str,
            faults: frozenset[str], asked: bool = False, queue_s: float = 0.0) -> Reply:
        images = [apply_image_faults(im, req, faults, n) for im in result.images]
        pngs = None if "no-image" in faults else [png_bytes(im) for im in images]
        api = self.config.api
        # the releases report the allocator's reserved high-water mark; the older refserver shape, allocated;
        # fault zero-peak: a worker that measured nothing (vLLM-Omni reports 0.0)
        peak_mb = 0.0 if "zero-peak" in faults else \
            (result.peak_reserved_bytes if api in RELEASES else result.peak_bytes) / 2**20
        self.metrics.peak_memory(0.0 if "zero-peak" in faults else result.peak_reserved_bytes / 2**20)
        if endpoint == "chat":
            body = protocol.chat_response(self.config.model_name, pngs, result.text_tokens, peak_mb, rid, api,
                                          result.seconds, asked, queue_s)
        else:
            body = protocol.images_response(pngs, peak_mb, api, result.seconds, (req.width, req.height), asked,
                                            queue_s)
        if "malformed-json" in faults:
            text = json.dumps(body)
            return Reply(200, text[: max(1, len(text) // 2)])
        return Reply(200, body)


def apply_image_faults(img: Image.Image, req: GenerationRequest, faults: frozenset[str], n: int
                       ) -> Image.Image:
    w, h = img.size
    if "grey" in faults:
        img = Image.new("RGB", (w, h), (128, 128, 128))
    if "transparent" in faults:  # the seed's fp8 collapse: ~97% of pixels fully transparent
        alpha = np.where(np.random.default_rng(req.seed).random((h, w)) < 0.97, 0, 255).astype(np.uint8)
        img = img.convert("RGBA")
        img.putalpha(Image.fromarray(alpha, mode="L"))
    if "wrong-size" in faults:
        img = img.resize((max(8, w // 2), max(8, h // 2)), Image.Resampling.BILINEAR)
    return img


def create_app(engine: AnyEngine, config: ServerConfig) -> FastAPI:
    metrics = Metrics(engine, config)
    service = Service(engine, config, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        service.stopping.set()

    app = FastAPI(title="refserver", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    limit = protocol.max_body_bytes(config.preset, config.api)

    def too_large(path: str, limit: int) -> dict[str, Any]:
        endpoint = "chat" if path.endswith("/chat/completions") else "images"
        return error_body(f"Request body too large: more than {limit} bytes (the largest body a request this "
                          "server serves can need)", protocol.error_type(endpoint, 413, config.api), 413)

    app.add_middleware(BodyCap, limit=limit, refusal=too_large)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "healthy" if config.api in RELEASES else "ok"}

    @app.get("/v1/models")
    async def models() -> Response:
        if config.api not in RELEASES:  # the snapshot's pure-diffusion mode answered a plain-text 500
            return Response("Internal Server Error", status_code=500, media_type="text/plain")
        # vLLM's OpenAI-compatible list, as 0.30.0 answers it (measured): the served name is `id` and `root`
        now = int(time.time())
        permission = {"id": "modelperm-" + secrets.token_hex(8), "object": "model_permission", "created": now,
                      "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                      "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                      "organization": "*", "group": None, "is_blocking": False}
        return JSONResponse({"object": "list", "data": [
            {"id": config.model_name, "object": "model", "created": now, "owned_by": "vllm",
             "root": config.model_name, "parent": None, "max_model_len": None, "permission": [permission]}]})

    if config.api in RELEASES:
        @app.get("/version")
        async def version() -> dict[str, str]:
            return {"version": VERSIONS[config.api]}

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def generate(request: Request, endpoint: str) -> Response:
        n = next(service.counter)
        rid = protocol.new_request_id()
        t0 = time.perf_counter()
        raw = await request.body()
        # parsing and compute run in a worker thread so /health and /metrics stay responsive
        reply = await anyio.to_thread.run_sync(service.execute, n, endpoint, raw, rid)
        metrics.observe(reply.status, time.perf_counter() - t0)
        return reply.response()

    if engine.profiler is not None:  # vLLM-Omni registers these only with --profiler-config
        profiler = engine.profiler

        @app.post("/start_profile")
        async def start_profile() -> Response:
            return JSONResponse(await anyio.to_thread.run_sync(profiler.start))

        @app.post("/stop_profile")
        async def stop_profile() -> Response:
            # after the request in flight (one at a time): its OOM, or its end, is what the snapshot shows
            def stop() -> dict[str, Any]:
                with service.lock:
                    return profiler.stop()
            return JSONResponse(await anyio.to_thread.run_sync(stop))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generate(request, "chat")

    @app.post("/v1/images/generations")
    async def images(request: Request) -> Response:
        return await generate(request, "images")

    if config.api in RELEASES:
        @app.post("/v1/images/edits")
        async def edits(request: Request) -> Response:
            n = next(service.counter)
            rid = protocol.new_request_id()
            t0 = time.perf_counter()
            files: list[tuple[str, bytes]] = []
            fields: dict[str, Any] = {}
            try:
                form = await request.form()
                for key, value in form.multi_items():
                    if key in ("image", "image[]") and not isinstance(value, str):
                        files.append((value.filename or key, await value.read()))
                    elif isinstance(value, str):
                        fields[key] = value
            except Exception as exc:  # not a multipart form starlette can read: a 400 in vLLM-Omni's body
                reply = service.refuse(n, rid, "edits", t0, f"invalid multipart form: {protocol.shown(str(exc))}",
                                     None)
                metrics.observe(reply.status, time.perf_counter() - t0)
                return reply.response()
            reply = await anyio.to_thread.run_sync(service.execute, n, "edits", (fields, files), rid)
            metrics.observe(reply.status, time.perf_counter() - t0)
            return reply.response()

    return app
