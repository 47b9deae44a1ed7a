"""Attention on the CPU: vLLM-Omni's own SDPA backend, dispatched to its plain `scaled_dot_product_attention`
path. 0.30.0's attention layer dispatches by platform (`AttentionImpl.forward`: rocm/cuda/npu/xpu/musa) and raises
NotImplementedError for any other; this backend's implementation takes that plain path directly."""

from __future__ import annotations

from typing import Any

import torch
from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend, SDPAImpl


class CpuSDPAImpl(SDPAImpl):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_metadata: Any = None) -> torch.Tensor:
        return self._forward_impl(query, key, value, attn_metadata, mask_mode="broadcast_k")


class CpuSDPABackend(SDPABackend):
    @staticmethod
    def get_impl_cls() -> type[CpuSDPAImpl]:
        return CpuSDPAImpl
