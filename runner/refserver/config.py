"""Options of the reference server: model presets and the frozen server configuration."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from runner.refserver.faults import FaultPlan

CACHE_MODES = ("device", "host", "off", "retain")
DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "int8", "fp8")
OFFLOADS = ("none", "module", "layerwise")
# Which vLLM-Omni generation's HTTP behaviour to imitate: "0.32" (today's source, default: stage metrics only
# when asked, 0.0 when not measured), "0.30" (the 0.30.0 release) or "2025-12" (the Dec-2025 GitHub snapshot
# the seed's fork grew from). docs/refserver.md and docs/vllm-omni.md list the differences.
ARCHS = ("dit", "qwen-image")
API_GENERATIONS = ("0.32", "0.30", "2025-12")
RELEASES = ("0.32", "0.30")  # the generations that share the 0.30 release's request handling
DEFAULT_API = "0.32"


def max_ref_pixels(max_side: int) -> int:
    """The most pixels a reference may declare: a square of the largest output side. No preset uses more of a
    reference (it is resized down to the preset's reference grid, or names the size of an edit, which is at
    most max_side a side), and decoding one costs what it declares (width x height x 4 bytes at most)."""
    return max_side * max_side


@dataclass(frozen=True)
class Preset:
    """Shape of the diffusion transformer and the image geometry it serves."""

    name: str
    dim: int
    layers: int
    heads: int
    ref_tokens: int  # tokens per reference image (a square grid)
    mlp_ratio: int = 4
    vocab: int = 4096
    max_text_tokens: int = 64
    default_side: int = 128  # default output is about default_side² pixels
    max_pixels: int = 512 * 512
    max_side: int = 2048
    max_refs: int = 16  # reference slots in the network (the embedding table's size)
    ref_limit: int = 4  # references served per request (0.30: Qwen-Image-Edit-Plus's limit); --max-refs
    latent_channels: int = 4
    vae_factor: int = 8  # pixels per latent cell, as in an SD-style VAE
    patch: int = 2  # latent cells per token side
    ref_patch_px: int = 16  # pixels per reference-token side after resizing

    @property
    def ref_grid(self) -> int:
        return math.isqrt(self.ref_tokens)

    @property
    def max_ref_pixels(self) -> int:
        return max_ref_pixels(self.max_side)

    @property
    def px_per_token(self) -> int:
        return self.vae_factor * self.patch

    def validate(self) -> None:
        if self.ref_grid**2 != self.ref_tokens or self.ref_tokens < 1:
            raise ValueError(f"--ref-tokens must be a perfect square (got {self.ref_tokens})")
        if self.dim % self.heads or (self.dim // self.heads) % 2:
            raise ValueError(f"--dim {self.dim} must be a multiple of 2 x heads ({self.heads})")
        if not 1 <= self.ref_limit <= self.max_refs:
            raise ValueError(f"--max-refs must be between 1 and {self.max_refs} (got {self.ref_limit})")
        if self.layers < 1:
            raise ValueError(f"--layers must be >= 1 (got {self.layers})")


# GPU preset arithmetic (bf16, 2 bytes/element) is written out in docs/refserver.md.
PRESETS: dict[str, Preset] = {
    # CPU: 20 steps at 128x128 with one reference in well under a second on one core.
    "tiny": Preset(name="tiny", dim=96, layers=4, heads=4, ref_tokens=64),
    # CPU, roughly 10x the compute of tiny.
    "small": Preset(name="small", dim=192, layers=6, heads=6, ref_tokens=256, default_side=256,
                    max_pixels=768 * 768),
    # H200 capped at 24 GiB (an RTX 3090 stand-in): Qwen-Image-like token counts (a 1024² reference or
    # output is 4096 tokens); weights 14.7 GiB, device cond cache 1.56 GiB per reference per CFG pass,
    # so with CFG on, 2 references fit and 3 do not (cond-cache device); host/off fit 4.
    "h200-24g": Preset(name="h200-24g", dim=2560, layers=40, heads=20, ref_tokens=4096, vocab=8192,
                       max_text_tokens=256, default_side=1024, max_pixels=2048 * 2048),
    # H200 capped at 16 GiB (an RTX 5080 stand-in): weights 11.3 GiB, 1.34 GiB per reference per CFG pass:
    # with CFG on, 1 reference fits and 2 do not (cond-cache device).
    "h200-16g": Preset(name="h200-16g", dim=2304, layers=38, heads=18, ref_tokens=4096, vocab=8192,
                       max_text_tokens=256, default_side=1024, max_pixels=2048 * 2048),
}


@dataclass(frozen=True)
class QwenPreset:
    """The transformer's config (diffusers' names) and the image geometry it serves."""

    name: str
    layers: int
    heads: int
    head_dim: int
    joint_dim: int  # the text encoder's width (joint_attention_dim)
    rope_axes: tuple[int, int, int]  # frame, height, width; they sum to head_dim
    ref_grid: int  # a reference is resized to ref_grid x ref_grid tokens (ref_grid * 16 pixels a side)
    vocab: int = 4096
    max_text_tokens: int = 64
    default_side: int = 128
    max_pixels: int = 512 * 512
    max_side: int = 2048
    ref_limit: int = 4  # references served per request (0.30: Qwen-Image-Edit-Plus's limit); --max-refs
    max_refs: int = 16

    @property
    def dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def max_ref_pixels(self) -> int:
        return max_ref_pixels(self.max_side)

    @property
    def ref_tokens(self) -> int:
        return self.ref_grid**2

    @property
    def px_per_token(self) -> int:
        return 16  # the VAE's 8x and the 2 x 2 packing

    def config(self) -> dict[str, object]:
        return {"num_layers": self.layers, "attention_head_dim": self.head_dim,
                "num_attention_heads": self.heads, "joint_attention_dim": self.joint_dim,
                "in_channels": 64, "out_channels": 16,  # 16 latent channels, packed 2 x 2
                "axes_dims_rope": self.rope_axes}

    def validate(self) -> None:
        if sum(self.rope_axes) != self.head_dim or any(a % 2 for a in self.rope_axes):
            raise ValueError(f"rope axes {self.rope_axes} must be even and sum to the head dim {self.head_dim}")
        if not 1 <= self.ref_limit <= self.max_refs:
            raise ValueError(f"--max-refs must be between 1 and {self.max_refs} (got {self.ref_limit})")
        if self.layers < 1:
            raise ValueError(f"--layers must be >= 1 (got {self.layers})")


# Full width is the real model's: 24 heads x 128, joint_attention_dim 3584 (Qwen-Image has 60 layers, 20.4 B
# parameters). A 1024² reference is 64 x 64 tokens. The GPU presets' layer counts are set so the resident set
# tells the emulated card's story (docs/refserver.md has the arithmetic and the H200 measurements).
QWEN_PRESETS: dict[str, QwenPreset] = {
    # CPU: 4 layers, 4 heads x 32, 2.6 M parameters (10.5 MiB in float32 with RoPE's tables); a reference is
    # 8 x 8 tokens, so weights outweigh a reference's activations, as at full width.
    "tiny": QwenPreset(name="tiny", layers=4, heads=4, head_dim=32, joint_dim=64, rope_axes=(8, 12, 12),
                       ref_grid=8),
    # H200 capped at 24 GiB (an RTX 3090 stand-in): 34 layers, 11.59 B parameters, 21.60 GiB in bf16.
    "h200-24g": QwenPreset(name="h200-24g", layers=34, heads=24, head_dim=128, joint_dim=3584,
                           rope_axes=(16, 56, 56), ref_grid=64, vocab=8192, max_text_tokens=512,
                           default_side=1024, max_pixels=2048 * 2048),
    # H200 capped at 16 GiB (an RTX 5080 stand-in): the same 34 layers, which do not fit: built on the device
    # in bf16 they fail at load, as the seed's 5080 did under every flag set.
    "h200-16g": QwenPreset(name="h200-16g", layers=34, heads=24, head_dim=128, joint_dim=3584,
                           rope_axes=(16, 56, 56), ref_grid=64, vocab=8192, max_text_tokens=512,
                           default_side=1024, max_pixels=2048 * 2048),
}


AnyPreset = Preset | QwenPreset


def resolve_qwen_preset(name: str, layers: int | None, ref_limit: int | None) -> QwenPreset:
    if name not in QWEN_PRESETS:
        raise ValueError(f"unknown preset {name!r} for --arch qwen-image; choose from {', '.join(QWEN_PRESETS)}")
    preset = QWEN_PRESETS[name]
    overrides: dict[str, Any] = {k: v for k, v in (("layers", layers), ("ref_limit", ref_limit)) if v is not None}
    preset = replace(preset, **overrides) if overrides else preset
    preset.validate()
    return preset


@dataclass(frozen=True)
class ServerConfig:
    preset: Preset | QwenPreset
    arch: str = "dit"  # dit (our two-stream DiT) | qwen-image (diffusers' QwenImageTransformer2DModel)
    device: str = "cpu"
    dtype: str = "float32"
    quantization: str = "none"
    offload: str = "none"  # none | module (all blocks moved in per request) | layerwise (one block at a time)
    cond_cache: str = "device"
    vram_gib: float | None = None
    threads: int | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "refserver"
    seed_weights: int = 0
    log_level: str = "info"
    faults: FaultPlan = field(default_factory=FaultPlan)
    api: str = DEFAULT_API
    log_stats: bool = False  # vLLM-Omni exports its vllm_omni:* families only with --log-stats
    oom_reply: str = "detailed"  # detailed: the 500 carries the OOM text (0.30); mangled: log only (2025-12)
    whole_device: bool = True  # CUDA cap covers the CUDA context too (as a real card of vram_gib would)
    pinned_pool: bool = True  # host cond cache reuses one pinned buffer instead of one per request
    # vLLM-Omni 8484d85d's init_parameters: the whole unquantized parameter set is materialized on the device
    # before quantization or offload engage (the seed's 16 GB card failed there under every flag set)
    init_on_device: bool = False
    profiler: str | None = None  # vLLM-Omni's --profiler-config JSON (runner.refserver.profiler)

    @property
    def cpu_offload(self) -> bool:
        return self.offload != "none"

    @property
    def vram_bytes(self) -> int | None:
        return None if self.vram_gib is None else int(self.vram_gib * 2**30)


def resolve_preset(name: str, dim: int | None, layers: int | None, ref_tokens: int | None,
                   heads: int | None = None, ref_limit: int | None = None) -> Preset:
    """The named preset with command-line overrides applied and checked."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    preset = PRESETS[name]
    overrides: dict[str, Any] = {k: v for k, v in (("dim", dim), ("layers", layers), ("ref_tokens", ref_tokens),
                                   ("heads", heads), ("ref_limit", ref_limit)) if v is not None}
    if overrides:
        preset = replace(preset, **overrides)
    preset.validate()
    return preset
