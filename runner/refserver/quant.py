"""Our quantized linears (no library installable here does W8A8 on the CPU and CUDA alike): int8 weights and
activations, and weight-only fp8 with a per-channel scale."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Int8Linear(nn.Module):
    """W8A8: int8 weight storage with a per-output-channel scale, activations rounded per token to int8
    levels on the fly (dynamic quantization); both dequantized for the matmul."""

    qweight: Tensor  # the registered buffers, typed (nn.Module's __getattr__ is Tensor | Module)
    scale: Tensor
    bias: Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-8) / 127.0
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        x_scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127.0
        x = torch.round(x / x_scale).clamp(-127, 127) * x_scale
        w = self.qweight.to(x.dtype) * self.scale[:, None].to(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


class Float8Linear(nn.Module):
    """Weight-only fp8: float8 e4m3 weight storage with a per-output-channel scale (1 byte per weight, as
    vLLM-Omni's `--quantization fp8` stores a diffusion transformer's linear weights), dequantized to the
    compute dtype for the matmul."""

    qweight: Tensor  # the registered buffers, typed (nn.Module's __getattr__ is Tensor | Module)
    scale: Tensor
    bias: Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-8) / torch.finfo(torch.float8_e4m3fn).max
        self.register_buffer("qweight", (w / scale[:, None]).to(torch.float8_e4m3fn))
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        w = self.qweight.to(x.dtype) * self.scale[:, None].to(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


QUANTIZED = {"int8": Int8Linear, "fp8": Float8Linear}
