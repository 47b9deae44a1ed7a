"""The engine: loads the model under a memory budget and runs the flow-matching sampler with a
per-request conditioning K/V cache held on the device, in host memory, or not at all — or, `retain`, each
reference's kept on the device across requests."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import torch
from PIL import Image
from torch import Tensor, nn

from runner.refserver.config import Preset, ServerConfig
from runner.refserver.memory import AccountedMemory, DeviceMemory, format_size, make_device_memory
from runner.refserver.model import (
    Block,
    RefServerDiT,
    init_unit,
    module_bytes,
    quantize_linears,
    reference_patches,
    tokenize,
)
from runner.refserver.profiler import CACHE_NAME, LEAK_NAME, RETAINED_NAME, LedgerHistory, Profiler, ProfilerConfig
from runner.refserver.retain import Retained, RetainedConditions, reference_key

if TYPE_CHECKING:  # diffusers is imported only when the qwen-image arch runs
    from runner.refserver.qwen_image.engine import QwenEngine

log = logging.getLogger("refserver")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str
    references: tuple[Image.Image, ...] = ()
    width: int = 128
    height: int = 128
    steps: int = 50
    seed: int = 0
    true_cfg_scale: float = 4.0
    negative_prompt: str | None = ""  # None: no negative prompt, so no true CFG (vLLM-Omni 0.30)
    num_outputs: int = 1
    guidance_scale: float | None = None  # accepted and recorded; this model has no distilled guidance
    leak_bytes: int = 0  # fault leak: device bytes this request allocates and never frees


@dataclass(frozen=True)
class GenerationResult:
    images: tuple[Image.Image, ...]
    peak_bytes: int  # allocated (CUDA: max_memory_allocated; CPU: the ledger)
    peak_reserved_bytes: int  # reserved (CUDA: max_memory_reserved, what vLLM-Omni 0.30 reports)
    seconds: float
    cond_tokens: int
    text_tokens: int


class Offloaded:
    """A block whose weights live on the host and visit the device only while the block runs."""

    def __init__(self, block: nn.Module, device: torch.device) -> None:
        self.device = device
        self.tensors = [*block.parameters(), *block.buffers()]
        pin = device.type == "cuda"
        self.host = [t.detach().to("cpu") for t in self.tensors]
        if pin:
            self.host = [h.pin_memory() for h in self.host]
        for t, h in zip(self.tensors, self.host, strict=True):
            t.data = h
        self.nbytes = sum(h.numel() * h.element_size() for h in self.host)
        self.pinned_bytes = self.nbytes if pin else 0

    @contextmanager
    def on_device(self, mem: DeviceMemory) -> Iterator[None]:
        with mem.hold(self.nbytes, "offloaded block weights"):
            if self.device.type == "cpu":  # nothing moves; the ledger counts only the running block
                yield
                return
            for t, h in zip(self.tensors, self.host, strict=True):
                t.data = h.to(self.device, non_blocking=True)
            try:
                yield
            finally:
                for t, h in zip(self.tensors, self.host, strict=True):
                    t.data = h


class CondSource:
    """Conditioning K/V for one CFG pass, layer by layer, for the whole request."""

    def __init__(self, engine: Engine, ids: Tensor, patches: list[Tensor]) -> None:
        self.e, self.ids, self.patches = engine, ids, patches
        self.tokens = ids.shape[0] + sum(p.shape[0] for p in patches)
        self.pf = engine.model.cond_positions(ids.shape[0], len(patches), engine.device)
        self.kv_bytes = engine.nb(2 * self.tokens * engine.p.dim)  # one layer's K and V

    def embed(self) -> tuple[Tensor, int]:
        """[text | ref 1 | ref 2 ...] tokens on the device, re-made from host inputs when needed."""
        e = self.e
        handle = e.mem.alloc(e.nb(self.tokens * e.p.dim), "cond hidden")
        parts = [e.model.embed_text(self.ids.to(e.device))]
        for slot, patch in enumerate(self.patches):
            with e.mem.hold(patch.numel() * (1 + e.elem), "reference patches"):
                parts.append(e.model.embed_ref(patch.to(e.device), slot, e.dtype))
        return torch.cat(parts, dim=1), handle

    def prefill(self) -> Iterator[tuple[int, Tensor, Tensor]]:
        """Runs the conditioning stream once, yielding each layer's (K, V) on the device."""
        c, c_handle = self.embed()
        yield from cond_stream(self.e, c, c_handle, self.pf, self.kv_bytes)

    def begin_step(self) -> None: ...
    def layer(self, layer: int, block: Block) -> tuple[list[Tensor], list[Tensor]]:
        """The condition's K and V of a layer, in pieces the latent's attention joins with its own."""
        raise NotImplementedError
    def end_layer(self, layer: int) -> None: ...
    def end_step(self) -> None: ...
    def close(self) -> None: ...


def cond_stream(e: Engine, c: Tensor, c_handle: int, pf: Tensor, kv_bytes: int
                ) -> Iterator[tuple[int, Tensor, Tensor]]:
    """Runs conditioning tokens `c` (their ledger handle `c_handle`, freed at the end) through every block,
    yielding each layer's (ledger handle of its K/V, K, V)."""
    for layer, block in enumerate(e.model.block_list()):
        with e.resident(layer):
            with e.mem.labelled():
                kv = e.mem.alloc(kv_bytes, "cond k/v")
            c, k, v = block.cond_forward(c, pf, e.mem, e.nb, e.chunk)
        yield kv, k, v
    e.mem.free(c_handle)


class DeviceCache(CondSource):
    """All layers' conditioning K/V resident on the device for the whole request."""

    def __init__(self, engine: Engine, ids: Tensor, patches: list[Tensor]) -> None:
        super().__init__(engine, ids, patches)
        self.kv: list[tuple[Tensor, Tensor]] = []
        self.handles: list[int] = []
        engine.mem.kv_label = CACHE_NAME if engine.profiler else ""  # the snapshot names the cache's K/V
        try:
            for handle, k, v in self.prefill():
                self.kv.append((k, v))
                self.handles.append(handle)
        finally:
            engine.mem.kv_label = ""
        engine.cache_bytes["device"] += self.kv_bytes * len(self.kv)

    def layer(self, layer: int, block: Block) -> tuple[list[Tensor], list[Tensor]]:
        k, v = self.kv[layer]
        return [k], [v]

    def close(self) -> None:
        for h in self.handles:
            self.e.mem.free(h)
        self.kv.clear()


class RetainedCache(DeviceCache):
    """`--cond-cache retain` (runner.refserver.retain): the text's K/V made for the request as DeviceCache makes
    them; each reference's made from that reference alone (its slot embedding and positions), once, and kept on
    the device across requests."""

    def __init__(self, engine: Engine, ids: Tensor, patches: list[Tensor]) -> None:
        super().__init__(engine, ids, [])  # the text alone
        self.references = [self._reference(slot, patch) for slot, patch in enumerate(patches)]
        self.tokens += sum(p.shape[0] for p in patches)

    def _reference(self, slot: int, patch: Tensor) -> Retained:
        e = self.e
        key = reference_key(slot, patch.numpy())
        entry = e.retained.get(key)
        if entry is not None:
            return entry
        tokens = patch.shape[0]
        pf = e.model.cond_positions(0, slot + 1, e.device)[-tokens:]  # this slot's positions
        kv_bytes = e.nb(2 * tokens * e.p.dim)
        handle = e.mem.alloc(e.nb(tokens * e.p.dim), "cond hidden")
        with e.mem.hold(patch.numel() * (1 + e.elem), "reference patches"):
            c = e.model.embed_ref(patch.to(e.device), slot, e.dtype)
        e.mem.kv_label = RETAINED_NAME if e.profiler else ""
        try:
            made = list(cond_stream(e, c, handle, pf, kv_bytes))
        finally:
            e.mem.kv_label = ""
        for h, _, _ in made:  # made whole: now it outlives the request's scope
            e.mem.keep(h)
        entry = Retained([(k, v) for _, k, v in made], kv_bytes * len(made), [h for h, _, _ in made])
        e.retained.put(key, entry)
        return entry

    def layer(self, layer: int, block: Block) -> tuple[list[Tensor], list[Tensor]]:
        k, v = self.kv[layer]
        return [k, *(r.kv[layer][0] for r in self.references)], [v, *(r.kv[layer][1] for r in self.references)]


class HostCache(CondSource):
    """Conditioning K/V kept in host memory (pinned on CUDA); each layer is copied to the device as it
    runs, the next layer's copy issued one layer ahead (double buffering)."""

    def __init__(self, engine: Engine, ids: Tensor, patches: list[Tensor]) -> None:
        super().__init__(engine, ids, patches)
        cuda = engine.device.type == "cuda"
        self.host: list[tuple[Tensor, Tensor]] = []
        self.slot: int | None = None
        store: Tensor | None = None  # one host buffer for all layers
        for layer, (handle, k, v) in enumerate(self.prefill()):
            if store is None:
                shape = (engine.p.layers, 2, *k.shape)
                if cuda and engine.config.pinned_pool:  # reused across requests: no per-request pinning
                    self.slot, store = engine.pinned.acquire(shape, k.dtype)
                else:  # one pinned allocation per request (the old behaviour, kept for the benchmark)
                    store = torch.empty(shape, dtype=k.dtype, pin_memory=cuda)
            store[layer, 0].copy_(k)
            store[layer, 1].copy_(v)
            self.host.append((store[layer, 0], store[layer, 1]))
            del k, v
            engine.mem.free(handle)
        nbytes = self.kv_bytes * len(self.host)
        engine.cache_bytes["host"] += nbytes
        if cuda and self.slot is None:  # pooled bytes are counted by the pool
            engine.host_pinned_bytes += nbytes
        self.stream = torch.cuda.Stream(engine.device) if cuda else None
        self.staged: dict[int, tuple[Tensor, Tensor, int, torch.cuda.Event | None]] = {}

    def _fetch(self, layer: int) -> None:
        if layer >= len(self.host) or layer in self.staged:
            return
        handle = self.e.mem.alloc(self.kv_bytes, "cond k/v staging")
        hk, hv = self.host[layer]
        if self.stream is None:
            self.staged[layer] = (hk.clone(), hv.clone(), handle, None)
            return
        with torch.cuda.stream(self.stream):
            k = hk.to(self.e.device, non_blocking=True)
            v = hv.to(self.e.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        main = torch.cuda.current_stream(self.e.device)
        k.record_stream(main)  # allocated on the copy stream, used on the main one
        v.record_stream(main)
        self.staged[layer] = (k, v, handle, event)

    def layer(self, layer: int, block: Block) -> tuple[list[Tensor], list[Tensor]]:
        self._fetch(layer)
        self._fetch(layer + 1)  # prefetch while this layer computes
        k, v, _, event = self.staged[layer]
        if event is not None:
            torch.cuda.current_stream(self.e.device).wait_event(event)
        return [k], [v]

    def end_layer(self, layer: int) -> None:
        _, _, handle, _ = self.staged.pop(layer)
        self.e.mem.free(handle)

    def close(self) -> None:
        for layer in list(self.staged):
            self.end_layer(layer)
        self.host.clear()
        if self.slot is not None:
            if self.stream is not None:  # no copy may still read the buffer the next request will refill
                self.stream.synchronize()
            self.e.pinned.release(self.slot)
            self.slot = None


class PinnedPool:
    """Grow-only page-locked host buffers, one per concurrent user (a CFG pass), reused across requests.

    Pinned with cudaHostRegister on plain host memory of exactly the needed size: PyTorch's caching host
    allocator (`pin_memory=True`) rounds each block up to a power of two and keeps freed blocks cached, which
    on the H200 gave a 29.4 GiB host peak and 5.5-13.8 s of erratic latency from per-request pinning."""

    def __init__(self) -> None:
        self.buffers: list[Tensor] = []
        self.busy: list[bool] = []
        self.registered: dict[int, bool] = {}  # slot -> pinned by cudaHostRegister (needs unregistering)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def acquire(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, Tensor]:
        need = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        slot = next((i for i, b in enumerate(self.busy) if not b), None)
        if slot is None:
            self.buffers.append(torch.empty(0, dtype=torch.uint8))
            self.busy.append(False)
            slot = len(self.buffers) - 1
        if self.buffers[slot].numel() < need:
            if self.registered.pop(slot, False):
                torch.cuda.cudart().cudaHostUnregister(self.buffers[slot].data_ptr())
            self.buffers[slot] = torch.empty(0, dtype=torch.uint8)  # drop the old one before growing
            self.buffers[slot], self.registered[slot] = self._pinned(need)
        self.busy[slot] = True
        return slot, self.buffers[slot][:need].view(dtype).view(shape)

    def release(self, slot: int) -> None:
        self.busy[slot] = False

    @staticmethod
    def _pinned(nbytes: int) -> tuple[Tensor, bool]:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
        if int(err) != 0:  # fall back to PyTorch's pinned allocator rather than fail the request
            log.warning("cudaHostRegister failed (%s); pinning through PyTorch's host allocator", err)
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), False
        return buf, True


class NoCache(CondSource):
    """Nothing kept: the conditioning tokens are re-embedded and run through every block at every step."""

    def begin_step(self) -> None:
        self.c, self.c_handle = self.embed()
        self.kv_handle: int | None = None

    def layer(self, layer: int, block: Block) -> tuple[list[Tensor], list[Tensor]]:
        self.kv_handle = self.e.mem.alloc(self.kv_bytes, "cond k/v")
        self.c, k, v = block.cond_forward(self.c, self.pf, self.e.mem, self.e.nb, self.e.chunk)
        return [k], [v]

    def end_layer(self, layer: int) -> None:
        if self.kv_handle is not None:
            self.e.mem.free(self.kv_handle)
            self.kv_handle = None

    def end_step(self) -> None:
        del self.c
        self.e.mem.free(self.c_handle)


CACHES: dict[str, type[CondSource]] = {"device": DeviceCache, "host": HostCache, "off": NoCache,
                                       "retain": RetainedCache}


class Leaked:
    """fault leak: device memory requests allocated and never freed (on CUDA real tensors; on the CPU the
    ledger's bytes, kept out of the request's scope), named in an allocator snapshot."""

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []
        self.nbytes = 0

    def add(self, engine: AnyEngine, nbytes: int) -> None:
        with engine.mem.labelled(LEAK_NAME if engine.profiler else ""):
            if engine.device.type == "cuda":
                self.tensors.append(torch.empty(nbytes, dtype=torch.uint8, device=engine.device))
            else:
                engine.mem.keep(engine.mem.alloc(nbytes, "left behind by fault leak"))
        self.nbytes += nbytes


class Engine:
    def __init__(self, config: ServerConfig) -> None:
        if not isinstance(config.preset, Preset):  # a QwenPreset belongs to --arch qwen-image (QwenEngine)
            raise TypeError(f"the dit engine needs a DiT preset, not a {type(config.preset).__name__}")
        self.config = config
        self.p = config.preset
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = DTYPES[config.dtype]
        self.elem = torch.empty((), dtype=self.dtype).element_size()
        self.mem = make_device_memory(self.device, config.vram_bytes, config.whole_device)
        self.cache_bytes = {"device": 0, "host": 0}
        self.weights_pinned_bytes = 0
        self.host_pinned_bytes = 0
        self.offloaded: dict[int, Offloaded] = {}
        self.pinned = PinnedPool()
        self.retained = RetainedConditions()  # --cond-cache retain: kept across requests
        self.leaked = Leaked()  # --fault leak
        self.chunk = 64
        self.load_seconds = 0.0
        self.profiler = make_profiler(config.profiler, self.device, self.mem)
        self.model = self._load()
        if self.profiler is not None:
            self.profiler.armed = False  # the load is over: only /start_profile … /stop_profile snapshots

    def nb(self, elements: int) -> int:
        return elements * self.elem

    @torch.no_grad()
    def _load(self) -> RefServerDiT:
        t0 = time.perf_counter()
        cfg, p = self.config, self.p
        with torch.device("meta"):
            model = RefServerDiT(p)
        self.params = sum(t.numel() for t in model.parameters())
        if cfg.init_on_device:
            self._materialize_skeleton()
        units: list[tuple[str, nn.Module, int | None]] = [
            (name, m, None) for name, m in model.named_children() if name != "blocks"
        ] + [(f"blocks.{i}", b, i) for i, b in enumerate(model.blocks)]
        self.weight_bytes = 0
        self.device_weight_bytes = 0
        for prefix, unit, index in units:
            init_unit(unit, prefix, self.device, cfg.seed_weights, p.dim)
            if not prefix.startswith("dec_"):  # the tiny decoder stays float32
                unit.to(self.dtype)
            if index is not None and cfg.quantization != "none":
                quantize_linears(unit, cfg.quantization)
            nbytes = module_bytes(unit)
            self.weight_bytes += nbytes
            if index is not None and cfg.cpu_offload:
                self.offloaded[index] = Offloaded(unit, self.device)
                self.weights_pinned_bytes += self.offloaded[index].pinned_bytes
            else:
                self.mem.alloc(nbytes, f"weights of {prefix}")  # the CPU ledger raises OOM past the budget
                self.device_weight_bytes += nbytes
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # hand back the float32 init temporaries' cached segments
        self.host_pinned_bytes = self.weights_pinned_bytes
        model.eval()
        self.load_seconds = time.perf_counter() - t0
        return model

    def _materialize_skeleton(self) -> None:
        """Every parameter at once, unquantized in the compute dtype, on the device (then released): what
        vLLM-Omni 8484d85d's init_parameters holds before quantization or offload engage. Past the cap this
        raises the allocator's own out-of-memory error, as a load failure."""
        nbytes = self.params * self.elem
        if self.device.type == "cuda":
            skeleton = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            del skeleton
            torch.cuda.empty_cache()
        else:
            self.mem.free(self.mem.alloc(nbytes, "the unquantized parameter skeleton (init on device)"))

    def warm_up(self) -> None:
        warm_up(self, 1024)

    def cond_cache_bytes_per_reference(self) -> int:
        """Device-mode cache bytes one reference adds, per CFG pass (K and V, every layer); what `retain` keeps
        per reference."""
        return self.nb(2 * self.p.layers * self.p.ref_tokens * self.p.dim)

    def summary(self) -> str:
        c = self.config
        cap = "none" if c.vram_bytes is None else format_size(c.vram_bytes)
        return (
            f"refserver loaded: preset={self.p.name} device={self.device} dtype={c.dtype} "
            f"quantization={c.quantization} offload={c.offload} cond_cache={c.cond_cache} api={c.api} "
            f"dim={self.p.dim} layers={self.p.layers} heads={self.p.heads} ref_tokens={self.p.ref_tokens} "
            f"params={self.params / 1e6:.2f}M weight_bytes={self.weight_bytes} "
            f"({format_size(self.weight_bytes)}) device_weight_bytes={self.device_weight_bytes} "
            f"cond_cache_bytes_per_reference={self.cond_cache_bytes_per_reference()} "
            f"({format_size(self.cond_cache_bytes_per_reference())} per CFG pass) vram_cap={cap} "
            f"threads={torch.get_num_threads()} load_s={self.load_seconds:.2f}"
            + (f" cap_scope={'whole-device' if getattr(self.mem, 'whole_device', False) else 'allocator'}"
               f" non_pytorch_bytes={getattr(self.mem, 'non_pytorch', 0)}" if self.device.type == "cuda" else "")
        )

    def resident(self, layer: int) -> AbstractContextManager[None]:
        off = self.offloaded.get(layer)
        if off is None or self.config.offload == "module":  # module: already moved in for the request
            return nullcontext()
        return off.on_device(self.mem)

    # --- sampling -------------------------------------------------------------------------------
    def generate(self, req: GenerationRequest, on_step: Callable[[int, int], None] | None = None
                 ) -> GenerationResult:
        t0 = time.perf_counter()
        self.mem.fit_to_device()  # CUDA whole-device cap: what the context grew by since the last request
        self.mem.reset_peak()
        self.retained.new_request()
        try:
            with self.mem.scope(), torch.inference_mode(), ExitStack() as moved:
                if req.leak_bytes:  # fault leak: part of this request's peak, and never freed
                    self.leaked.add(self, req.leak_bytes)
                if self.config.offload == "module":  # the whole block stack visits for the request
                    for off in self.offloaded.values():
                        moved.enter_context(off.on_device(self.mem))
                images, cond_tokens, text_tokens = self._generate(req, on_step)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return GenerationResult(tuple(images), self.mem.peak(), self.mem.peak_reserved(),
                                    time.perf_counter() - t0, cond_tokens, text_tokens)
        finally:
            self.cache_bytes = {"device": 0, "host": 0}
            self.host_pinned_bytes = self.weights_pinned_bytes

    def _generate(self, req: GenerationRequest, on_step: Callable[[int, int], None] | None
                  ) -> tuple[list[Image.Image], int, int]:
        p, dev = self.p, self.device
        cfg = req.true_cfg_scale > 1.0 and req.negative_prompt is not None
        patches = [torch.from_numpy(reference_patches(im, p)) for im in req.references]
        prompts = [req.prompt, req.negative_prompt or ""] if cfg else [req.prompt]
        ids = [torch.tensor(tokenize(t, p.vocab, p.max_text_tokens), dtype=torch.long) for t in prompts]
        h, w = req.height // p.vae_factor, req.width // p.vae_factor
        th, tw = h // p.patch, w // p.patch
        self.chunk = max(1, th * tw)  # cond scratch never exceeds the latent stream's
        timesteps = torch.linspace(1.0, 0.0, req.steps + 1).tolist()
        gen = torch.Generator(device=dev).manual_seed(req.seed)
        conds: list[CondSource] = []
        images = []
        try:
            for i in ids:  # the cache is built at request start and lives until request end
                conds.append(CACHES[self.config.cond_cache](self, i, patches))
            for n in range(req.num_outputs):
                latent_bytes = 4 * 4 * p.latent_channels * h * w  # float32 state, noise, velocity x2
                with self.mem.hold(latent_bytes, "latents"):
                    noise = torch.randn((1, p.latent_channels, h, w), generator=gen, device=dev)
                    x = self._patchify(noise)
                    for step in range(req.steps):
                        self.mem.fit_to_device()  # the context can grow mid-request (kernels for a new shape)
                        t, t_next = timesteps[step], timesteps[step + 1]
                        v = self._velocity(x, t, conds[0], th, tw)
                        if cfg:
                            v_neg = self._velocity(x, t, conds[1], th, tw)
                            comb = v_neg + req.true_cfg_scale * (v - v_neg)
                            # as Qwen-Image's true CFG: keep the conditional prediction's norm per token
                            v = comb * (v.norm(dim=-1, keepdim=True)
                                        / comb.norm(dim=-1, keepdim=True).clamp_min(1e-6))
                        x = x + (t_next - t) * v
                        if on_step is not None:
                            on_step(n, step)
                    rgb = self.model.decode(self._unpatchify(x, th, tw), req.height, req.width)
                images.append(Image.fromarray(rgb.cpu().numpy(), mode="RGB"))
        finally:
            for c in conds:
                c.close()
        return images, conds[0].tokens if conds else 0, int(ids[0].shape[0])

    def _velocity(self, x_tokens: Tensor, t: float, cond: CondSource, th: int, tw: int) -> Tensor:
        m = self.model
        with self.mem.hold(self.nb(x_tokens.shape[1] * self.p.dim), "latent hidden"):
            x = m.embed_latent(x_tokens, th, tw)
            pf = m.latent_positions(th, tw, self.device)
            temb = m.embed_time(t, self.device)
            cond.begin_step()
            for layer, block in enumerate(m.block_list()):
                with self.resident(layer):
                    ks, vs = cond.layer(layer, block)
                    x = block.latent_forward(x, pf, temb, ks, vs, self.mem, self.nb)
                    del ks, vs
                    cond.end_layer(layer)
            cond.end_step()
            x0 = m.final(x, temb)
            # the network predicts the clean latent; the flow velocity follows (x_t - x0) / t, so the
            # last Euler step lands exactly on the model's final estimate (no leftover noise)
            return (x_tokens - x0) / t

    def _patchify(self, lat: Tensor) -> Tensor:
        c, h, w, p = lat.shape[1], lat.shape[2], lat.shape[3], self.p.patch
        t = lat.reshape(1, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        return t.reshape(1, (h // p) * (w // p), c * p * p)

    def _unpatchify(self, tokens: Tensor, th: int, tw: int) -> Tensor:
        c, p = self.p.latent_channels, self.p.patch
        t = tokens.reshape(1, th, tw, c, p, p).permute(0, 3, 1, 4, 2, 5)
        return t.reshape(1, c, th * p, tw * p)


AnyEngine: TypeAlias = "Engine | QwenEngine"  # what the app serves: our DiT's engine or the Qwen-Image one


def make_profiler(config: str | None, device: torch.device, mem: DeviceMemory) -> Profiler | None:
    """--profiler-config (vLLM-Omni's): the load is recorded and observed too, so a load OOM has a snapshot."""
    if config is None:
        return None
    ledger = None
    if isinstance(mem, AccountedMemory):
        ledger = LedgerHistory()
        mem.history = ledger
    profiler = Profiler(ProfilerConfig.parse(config), device, ledger)
    if isinstance(mem, AccountedMemory):
        mem.on_oom = profiler.on_ledger_oom
    profiler.record_load()
    return profiler


def warm_up(engine: AnyEngine, side: int) -> None:
    """CUDA: one one-step request at the preset's size, so the kernels PyTorch loads lazily for large shapes
    sit in the context before the whole-device cap is worked out (CudaMemory.fit_to_device); a card too
    small for that request gets a tiny one. (H200: with either warm-up NVML v2 `used` stayed within the
    24 GiB cap at the 3-reference OOM, 23.73 GiB; docs/evidence/h200-fidelity.)"""
    if engine.device.type != "cuda":
        return
    for size in (side, 64):
        ref = Image.new("RGB", (64, 64), (120, 60, 30))
        req = GenerationRequest(prompt="warm up", references=(ref,), width=size, height=size, steps=1,
                                seed=0, true_cfg_scale=4.0, negative_prompt=" ")
        try:
            engine.generate(req)
            engine.retained = RetainedConditions()  # retain: the warm-up's reference is no request's
            break
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
    engine.mem.fit_to_device()


def configure_torch(config: ServerConfig) -> None:
    """Threads and determinism, before any model work."""
    if config.device.startswith("cuda"):
        # cuBLAS needs this to be deterministic; it must be set before the first cuBLAS call.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # Without it the caching allocator's fragmentation (GiBs reserved but unallocated under a cap)
        # decides the fit instead of the model; the seed found the same. Set the variable to override.
        # The Qwen-Image model keeps PyTorch's default: its fragmentation is part of the real model's story.
        if config.arch == "dit":
            os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    torch.set_num_threads(config.threads if config.threads else (1 if config.device == "cpu" else 4))
    # The eager-mode switch alone: the public torch.use_deterministic_algorithms also imports torch._inductor to
    # set its flag (1.3 s of CPU at every server start; the refserver never compiles).
    if hasattr(torch._C, "_set_deterministic_algorithms"):
        torch._C._set_deterministic_algorithms(True, warn_only=True)
    else:
        torch.use_deterministic_algorithms(True, warn_only=True)


def png_bytes(img: Image.Image) -> bytes:
    import io

    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
