"""diffusers' Qwen-Image transformer with random weights, and what stands in for the stages around it.

The denoiser is `QwenImageTransformer2DModel` itself (diffusers), built from a preset's config under a fixed
seed. There is no text encoder and no trained VAE: a prompt's words are hashed to rows of a fixed random table
of the text encoder's width (Qwen2.5-VL's 3584 at full width), and images become latents by an 8× area
downsample and a fixed random 3 → 16 channel projection, packed 2 × 2 into the transformer's 64 input channels
(Qwen-Image's VAE is 16 channels at 1/8 scale); decoding is the projection's pseudo-inverse, smoothed and
auto-contrasted. Both stand-ins live in host memory: on a real card the text encoder and the VAE are stages of
their own, and the memory this server emulates is the transformer's.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn

from runner.refserver.config import QwenPreset
from runner.refserver.model import tokenize
from runner.refserver.quant import QUANTIZED

if TYPE_CHECKING:
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel

LATENT_CHANNELS = 16  # Qwen-Image's VAE
VAE_FACTOR = 8
PATCH = 2  # latent cells per token side: 16 channels x 2 x 2 = the transformer's 64 input channels


def build_transformer(preset: QwenPreset, seed: int, dtype: torch.dtype) -> QwenImageTransformer2DModel:
    """diffusers' model, built where the caller's device context says, in `dtype`, its weights drawn from
    PyTorch's generator seeded with `seed` (diffusers' own initializers)."""
    # From its module: for a type checker diffusers' top-level name is the stand-in it exports without torch
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the compute dtype: no float32 copy on the way (as a real load)
    try:
        return QwenImageTransformer2DModel(**preset.config()).eval()
    finally:
        torch.set_default_dtype(previous)


def quantize_blocks(model: QwenImageTransformer2DModel, method: str) -> None:
    """Every nn.Linear inside the transformer blocks becomes our int8/fp8 linear (the embedders and the output
    head stay in the compute dtype, as vLLM-Omni's quantized DiT keeps them)."""
    for block in model.transformer_blocks:
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, QUANTIZED[method](child))


class StandIns:
    """The text encoder and VAE stand-ins: fixed random tables in host memory (float32)."""

    def __init__(self, preset: QwenPreset, seed: int) -> None:
        g = torch.Generator().manual_seed(seed + 7919)
        self.p = preset
        self.text_table = torch.randn(preset.vocab, preset.joint_dim, generator=g)
        self.to_latent = torch.randn(LATENT_CHANNELS, 3, generator=g) / math.sqrt(3)
        self.to_rgb = torch.linalg.pinv(self.to_latent)  # (3, 16)

    def text(self, prompt: str) -> Tensor:
        ids = torch.tensor(tokenize(prompt, self.p.vocab, self.p.max_text_tokens), dtype=torch.long)
        return self.text_table[ids][None]  # (1, L, joint_dim)

    def encode_reference(self, img: Image.Image) -> Tensor:
        """A reference resized to the preset's grid, as packed latent tokens: (1, ref_grid², 64)."""
        side = self.p.ref_grid * self.p.px_per_token
        arr = np.asarray(img.convert("RGB").resize((side, side), Image.Resampling.BICUBIC), dtype=np.float32)
        rgb = torch.from_numpy(arr).permute(2, 0, 1)[None] / 127.5 - 1.0  # (1, 3, side, side)
        lat = torch.einsum("oc,bchw->bohw", self.to_latent, F.avg_pool2d(rgb, VAE_FACTOR))
        return pack(lat)

    def decode(self, latent: Tensor, height: int, width: int) -> Image.Image:
        """(1, 16, h, w) latent -> an RGB image, smooth by construction and auto-contrasted per channel (the
        weights are random, so the raw range means nothing)."""
        y = torch.einsum("oc,bchw->bohw", self.to_rgb, latent.float().cpu())
        y = F.avg_pool2d(y, 3, stride=1, padding=1, count_include_pad=False)
        y = F.interpolate(y, size=(height, width), mode="bicubic", align_corners=False)
        y = (y - y.mean(dim=(2, 3), keepdim=True)) / (y.std(dim=(2, 3), keepdim=True) + 1e-3)
        rgb = (torch.sigmoid(1.3 * y)[0].permute(1, 2, 0) * 255.0).round().clamp(0, 255).to(torch.uint8)
        return Image.fromarray(rgb.numpy(), mode="RGB")


def pack(lat: Tensor) -> Tensor:
    """(1, 16, h, w) -> (1, h/2 * w/2, 64): Qwen-Image's 2 x 2 latent packing."""
    b, c, h, w = lat.shape
    t = lat.reshape(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 2, 4, 1, 3, 5)
    return t.reshape(b, (h // PATCH) * (w // PATCH), c * PATCH * PATCH)


def unpack(tokens: Tensor, th: int, tw: int) -> Tensor:
    b = tokens.shape[0]
    t = tokens.reshape(b, th, tw, LATENT_CHANNELS, PATCH, PATCH).permute(0, 3, 1, 4, 2, 5)
    return t.reshape(b, LATENT_CHANNELS, th * PATCH, tw * PATCH)
