"""The Qwen-Image engine: diffusers' transformer under a memory budget, the flags mapped onto diffusers' own
mechanisms, a flow-matching sampler with Qwen-Image's true CFG.

Flags → mechanisms:
- `--cpu-offload` / `--enable-layerwise-offload`: diffusers' `apply_group_offloading` (block level, one block per
  group, a side stream) on CUDA; on the CPU each block's weights are copied into the accounted memory while the
  block runs (what the group's onload is on a real device).
- `--enable-cpu-offload`: the whole transformer lives on the host and visits the device for each request.
- `--quantization fp8`: diffusers' `enable_layerwise_casting` (float8_e4m3fn storage, compute in --dtype);
  `int8`: our W8A8 linears in the blocks (runner.refserver.quant).
- expandable segments: the allocator's own setting (PYTORCH_CUDA_ALLOC_CONF, left to the caller here).
- `--cond-cache`: prefix.py (`retain`: runner.refserver.retain).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import TYPE_CHECKING

import torch
from PIL import Image
from torch import Tensor, nn
from torch.nn.attention import sdpa_kernel

from runner.refserver.config import ServerConfig
from runner.refserver.engine import (
    DTYPES,
    GenerationRequest,
    GenerationResult,
    Leaked,
    PinnedPool,
    make_profiler,
    warm_up,
)
from runner.refserver.ledger import TensorLedger
from runner.refserver.memory import AccountedMemory, format_size, make_device_memory
from runner.refserver.model import _DETERMINISTIC_SDPA, module_bytes
from runner.refserver.profiler import CACHE_NAME, ONLOAD_NAME, RETAINED_NAME
from runner.refserver.qwen_image import prefix as pfx
from runner.refserver.qwen_image.model import (
    LATENT_CHANNELS,
    VAE_FACTOR,
    QwenPreset,
    StandIns,
    build_transformer,
    pack,
    quantize_blocks,
    unpack,
)
from runner.refserver.retain import Retained, RetainedConditions, reference_key

if TYPE_CHECKING:
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel

log = logging.getLogger("refserver")


class HostWeights:
    """Parameters kept in host memory that visit the device on demand: `onload()` swaps in device copies (on
    the CPU, copies made under the ledger, so they count), `offload()` swaps the host ones back."""

    def __init__(self, module: nn.Module, device: torch.device, host: Callable[[], AbstractContextManager[None]],
                 labelled: Callable[[], AbstractContextManager[None]] = nullcontext) -> None:
        self.device = device
        self.labelled = labelled  # the device copies carry ONLOAD_NAME in an allocator snapshot
        self.tensors = [*module.parameters(), *module.buffers()]
        with host():
            self.host = [t.detach().to("cpu", copy=True) for t in self.tensors]
            if device.type == "cuda":
                self.host = [h.pin_memory() for h in self.host]
        for t, h in zip(self.tensors, self.host, strict=True):
            t.data = h
        self.nbytes = sum(h.numel() * h.element_size() for h in self.host)
        self.pinned_bytes = self.nbytes if device.type == "cuda" else 0

    def onload(self) -> None:
        with self.labelled():
            for t, h in zip(self.tensors, self.host, strict=True):
                t.data = h.clone() if self.device.type == "cpu" else h.to(self.device, non_blocking=True)

    def offload(self) -> None:
        for t, h in zip(self.tensors, self.host, strict=True):
            t.data = h

    @contextmanager
    def visiting(self) -> Iterator[None]:
        self.onload()
        try:
            yield
        finally:
            self.offload()


class QwenEngine:
    def __init__(self, config: ServerConfig) -> None:
        assert isinstance(config.preset, QwenPreset)
        self.config, self.p = config, config.preset
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = DTYPES[config.dtype]
        self.mem = make_device_memory(self.device, config.vram_bytes, config.whole_device)
        self.ledger = TensorLedger(self.mem) if isinstance(self.mem, AccountedMemory) else None
        self.cache_bytes = {"device": 0, "host": 0}
        self.pinned = PinnedPool()
        self.weights_pinned_bytes = 0
        self.host_pinned_bytes = 0
        self.visiting: HostWeights | None = None  # --enable-cpu-offload: the whole transformer, per request
        self.retained = RetainedConditions()  # --cond-cache retain: kept across requests
        self.leaked = Leaked()  # --fault leak
        self.stand_ins = StandIns(self.p, config.seed_weights)
        self.profiler = make_profiler(config.profiler, self.device, self.mem)
        t0 = time.perf_counter()
        with self.counted():
            self.model = self._load()
        self.load_seconds = time.perf_counter() - t0
        if self.profiler is not None:
            self.profiler.armed = False  # the load is over: only /start_profile … /stop_profile snapshots

    # --- memory ----------------------------------------------------------------------------------------
    def counted(self) -> AbstractContextManager[object]:
        """Around everything the model does: on the CPU the ledger counts it as device memory."""
        return self.ledger if self.ledger is not None else nullcontext()

    def host(self) -> AbstractContextManager[None]:
        return self.ledger.host() if self.ledger is not None else nullcontext()

    def _onload_label(self) -> AbstractContextManager[None]:
        """Weights brought onto the device for a request are named in a snapshot: they are not activations."""
        return self.mem.labelled(ONLOAD_NAME if self.profiler else "")

    # --- load --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _load(self) -> nn.Module:
        cfg = self.config
        offloaded = cfg.offload != "none"
        # Built where it will run, unless it is offloaded and not asked to be materialized on the device first
        # (vLLM-Omni 8484d85d's init_parameters does that under every flag set: the seed's 16 GB card).
        on_host = offloaded and not cfg.init_on_device and self.device.type == "cpu"
        where = self.host() if on_host else nullcontext()
        with where, torch.device(self.device):
            model = build_transformer(self.p, cfg.seed_weights, self.dtype)
        if cfg.quantization == "int8":
            quantize_blocks(model, "int8")
        elif cfg.quantization == "fp8":
            model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=self.dtype)
        self.params = sum(t.numel() for t in model.parameters())
        self.weight_bytes = module_bytes(model)
        pfx.install(model)
        if cfg.offload == "module":
            self.visiting = HostWeights(model, self.device, self.host, self._onload_label)
            self.weights_pinned_bytes = self.visiting.pinned_bytes
        elif cfg.offload == "layerwise":
            self._offload_blocks(model)
        self.device_weight_bytes = self.weight_bytes - (
            self.weight_bytes if cfg.offload == "module"
            else sum(module_bytes(b) for b in model.transformer_blocks) if cfg.offload == "layerwise" else 0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        self.host_pinned_bytes = self.weights_pinned_bytes
        return model

    def _offload_blocks(self, model: QwenImageTransformer2DModel) -> None:
        if self.device.type == "cuda":
            from diffusers.hooks import apply_group_offloading

            apply_group_offloading(model, onload_device=self.device, offload_device=torch.device("cpu"),
                                   offload_type="block_level", num_blocks_per_group=1, use_stream=True)
            self.weights_pinned_bytes = sum(module_bytes(b) for b in model.transformer_blocks)
            return
        for block in model.transformer_blocks:
            weights = HostWeights(block, self.device, self.host, self._onload_label)
            block.register_forward_pre_hook(lambda _m, _a, w=weights: w.onload())
            block.register_forward_hook(lambda _m, _a, _o, w=weights: w.offload())

    def warm_up(self) -> None:
        warm_up(self, self.p.default_side)

    def summary(self) -> str:
        c, p = self.config, self.p
        cap = "none" if c.vram_bytes is None else format_size(c.vram_bytes)
        return (f"refserver loaded: arch=qwen-image (diffusers QwenImageTransformer2DModel) preset={p.name} "
                f"device={self.device} dtype={c.dtype} quantization={c.quantization} offload={c.offload} "
                f"cond_cache={c.cond_cache} api={c.api} layers={p.layers} heads={p.heads}x{p.head_dim} "
                f"joint_attention_dim={p.joint_dim} ref_tokens={p.ref_tokens} params={self.params / 1e6:.2f}M "
                f"cond_cache_bytes_per_reference={self.cond_cache_bytes_per_reference()} "
                f"weight_bytes={self.weight_bytes} ({format_size(self.weight_bytes)}) vram_cap={cap} "
                f"threads={torch.get_num_threads()} load_s={self.load_seconds:.2f}")

    # --- sampling ----------------------------------------------------------------------------------------
    def generate(self, req: GenerationRequest, on_step: Callable[[int, int], None] | None = None
                 ) -> GenerationResult:
        t0 = time.perf_counter()
        self.mem.fit_to_device()
        self.mem.reset_peak()
        self.retained.new_request()
        try:
            with ExitStack() as stack:
                stack.enter_context(torch.inference_mode())
                stack.enter_context(self.counted())
                if req.leak_bytes:  # fault leak: part of this request's peak, and never freed
                    self.leaked.add(self, req.leak_bytes)
                if self.device.type == "cuda":
                    stack.enter_context(sdpa_kernel(_DETERMINISTIC_SDPA))
                if self.visiting is not None:
                    stack.enter_context(self.visiting.visiting())
                images, cond_tokens, text_tokens = self._generate(req, on_step)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return GenerationResult(tuple(images), self.mem.peak(), self.mem.peak_reserved(),
                                    time.perf_counter() - t0, cond_tokens, text_tokens)
        finally:
            self.cache_bytes = {"device": 0, "host": 0}

    def _prefix(self, target_tokens: int) -> pfx.Prefix:
        if self.config.cond_cache == "device":
            self.mem.kv_label = CACHE_NAME if self.profiler else ""
            return pfx.DevicePrefix(target_tokens, self.mem.labelled)
        pinned = None
        if self.device.type == "cuda" and self.config.pinned_pool:
            def pinned(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
                return self.pinned.acquire(shape, dtype)[1]
        return pfx.HostPrefix(target_tokens, self.device, self.p.layers, self.host, pinned)

    def _generate(self, req: GenerationRequest, on_step: Callable[[int, int], None] | None
                  ) -> tuple[list[Image.Image], int, int]:
        p, dev, dt = self.p, self.device, self.dtype
        cfg = req.true_cfg_scale > 1.0 and req.negative_prompt is not None
        prompts = [req.prompt, req.negative_prompt or ""] if cfg else [req.prompt]
        texts = [self.stand_ins.text(t).to(dev, dt) for t in prompts]
        encoded = [self.stand_ins.encode_reference(im) for im in req.references]
        refs = [e.to(dev, dt) for e in encoded]
        retain = self.config.cond_cache == "retain"
        cond = torch.cat(refs, dim=1) if refs and not retain else None
        h, w = req.height // VAE_FACTOR, req.width // VAE_FACTOR
        th, tw = h // 2, w // 2
        img_shapes = [[(1, th, tw)] + [(1, p.ref_grid, p.ref_grid)] * len(refs)]
        cached = self.config.cond_cache != "off"
        prefixes: list[pfx.Prefix] = []
        timesteps = torch.linspace(1.0, 0.0, req.steps + 1).tolist()
        gen = torch.Generator(device=dev).manual_seed(req.seed)
        images = []
        try:
            if retain:  # each reference's K/V kept across requests; the text's made for this request
                kept = [self._retained(slot, e, ref, texts[0], img_shapes, th * tw)
                        for slot, (e, ref) in enumerate(zip(encoded, refs, strict=True))]
                del refs
                self.mem.kv_label = CACHE_NAME if self.profiler else ""
                for text in texts:
                    own = pfx.DevicePrefix(th * tw, self.mem.labelled)
                    nothing = torch.zeros(1, 0, LATENT_CHANNELS * 4, device=dev, dtype=dt)
                    self._run(nothing, text, 0.0, img_shapes, own)
                    own.filling = False
                    prefixes.append(pfx.RetainedPrefix(own, kept))
                    self.cache_bytes["device"] += own.nbytes
            elif cached:  # the condition's K/V, made once at request start and kept to its end
                for text in texts:
                    prefix = self._prefix(th * tw)
                    nothing = torch.zeros(1, 0, LATENT_CHANNELS * 4, device=dev, dtype=dt)  # no references
                    self._run(cond if cond is not None else nothing, text, 0.0, img_shapes, prefix)
                    prefix.filling = False
                    prefixes.append(prefix)
                    self.cache_bytes["device" if isinstance(prefix, pfx.DevicePrefix) else "host"] += prefix.nbytes
            for n in range(req.num_outputs):
                x = pack(torch.randn((1, LATENT_CHANNELS, h, w), generator=gen, device=dev)).to(dt)
                for step in range(req.steps):
                    self.mem.fit_to_device()  # the context can grow mid-request (kernels for a new shape)
                    t, t_next = timesteps[step], timesteps[step + 1]
                    v = self._velocity(x, t, texts[0], cond, img_shapes, prefixes[0] if cached else None)
                    if cfg:
                        v_neg = self._velocity(x, t, texts[1], cond, img_shapes, prefixes[1] if cached else None)
                        comb = v_neg + req.true_cfg_scale * (v - v_neg)
                        # Qwen-Image's true CFG keeps the conditional prediction's norm per token
                        v = comb * (v.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True).clamp_min(1e-6))
                    x = x + (t_next - t) * v
                    if on_step is not None:
                        on_step(n, step)
                images.append(self.stand_ins.decode(unpack(x, th, tw), req.height, req.width))
        finally:
            for prefix in prefixes:
                prefix.close()
            self.mem.kv_label = ""
        cond_tokens = int(texts[0].shape[1]) + (int(cond.shape[1]) if cond is not None else 0)
        return images, cond_tokens, int(texts[0].shape[1])

    def _retained(self, slot: int, encoded: Tensor, ref: Tensor, text: Tensor,
                  img_shapes: list[list[tuple[int, int, int]]], target_tokens: int) -> list[tuple[Tensor, Tensor]]:
        """The reference's K/V in place `slot`, every layer: kept from an earlier request, else made now from the
        reference alone (no text, its own RoPE positions) and kept."""
        key = reference_key(slot, encoded.numpy())
        entry = self.retained.get(key)
        if entry is None:
            start = target_tokens + slot * self.p.ref_tokens
            prefix = pfx.DevicePrefix(target_tokens, self.mem.labelled, slice(start, start + self.p.ref_tokens))
            self.mem.kv_label = RETAINED_NAME if self.profiler else ""
            try:
                self._run(ref, text[:, :0], 0.0, img_shapes, prefix)
            finally:
                self.mem.kv_label = ""
            entry = Retained([prefix.kv[layer] for layer in range(self.p.layers)], prefix.nbytes)
            self.retained.put(key, entry)
        return entry.kv

    def cond_cache_bytes_per_reference(self) -> int:
        """Device-mode cache bytes one reference adds per CFG pass, and what `retain` keeps per reference (K and
        V, every layer)."""
        return 2 * self.p.layers * self.p.ref_tokens * self.p.dim * torch.empty((), dtype=self.dtype).element_size()

    def _run(self, hidden: Tensor, text: Tensor, t: float, img_shapes: list[list[tuple[int, int, int]]],
             prefix: pfx.Prefix | None) -> Tensor:
        timestep = torch.full((1,), t, device=self.device)
        return self.model(hidden_states=hidden, encoder_hidden_states=text, encoder_hidden_states_mask=None,
                          timestep=timestep, img_shapes=img_shapes, return_dict=False,
                          attention_kwargs=None if prefix is None else {"prefix": prefix})[0]

    def _velocity(self, x: Tensor, t: float, text: Tensor, cond: Tensor | None,
                  img_shapes: list[list[tuple[int, int, int]]], prefix: pfx.Prefix | None) -> Tensor:
        """The transformer's flow prediction for the target tokens."""
        if prefix is not None:  # the target alone; the condition is in the kept K/V
            return self._run(x, text[:, :0], t, img_shapes, prefix)
        joint = x if cond is None else torch.cat([x, cond], dim=1)  # diffusers' forward, unchanged
        return self._run(joint, text, t, img_shapes, None)[:, : x.shape[1]]
