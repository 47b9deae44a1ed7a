"""The conditioning prefix cache, as an attention processor on diffusers' own blocks.

Qwen-Image-Edit-Plus runs one joint attention over [text | target | references] at every denoising step, so
nothing about the condition can be kept: that is `--cond-cache off`, diffusers' forward unchanged. A causal
condition (vLLM-Omni's Qwen-Image-2.1 prefix cache) lets the condition attend only to itself, at timestep 0:
then each layer's condition K/V are a per-request constant. The model's own forward is run twice over:
once over the condition alone (`Prefix.filling`: the text stream and the reference tokens, K/V kept layer by
layer) and then once per step over the target alone, with an empty text stream (`Prefix.reading`: the
target's queries attend over [kept K/V | its own K/V]). The cache is kept on the device for the request
(`device`) or in host memory, copied in layer by layer (`host`); `retain` makes each reference's K/V from that
reference alone, once, and keeps it on the device across requests (runner.refserver.retain).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_qwenimage import (
    QwenDoubleStreamAttnProcessor2_0,
    apply_rotary_emb_qwen,
)
from torch import Tensor


class Prefix:
    """One CFG pass's condition K/V for one request, layer by layer."""

    def __init__(self, target_tokens: int, cond_freqs: slice | None = None) -> None:
        self.target_tokens = target_tokens
        # the RoPE positions of the condition's image tokens while filling: by default all the references, after
        # the target; one reference's own (`retain` fills one reference at a time)
        self.cond_freqs = cond_freqs if cond_freqs is not None else slice(target_tokens, None)
        self.filling = True
        self.nbytes = 0

    def keeping(self) -> AbstractContextManager[None]:
        """Around the making of what `put` keeps (the device cache names it for an allocator snapshot)."""
        return nullcontext()

    def put(self, layer: int, k: Tensor, v: Tensor) -> None:
        raise NotImplementedError

    def get(self, layer: int) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def parts(self, layer: int) -> tuple[list[Tensor], list[Tensor]]:
        """The condition's K and V of a layer, in pieces the reading attention joins with the target's."""
        k, v = self.get(layer)
        return [k], [v]

    def release(self, layer: int) -> None:
        """After a reading layer's attention: a staged copy may go."""

    def close(self) -> None:
        """At request end."""


class DevicePrefix(Prefix):
    def __init__(self, target_tokens: int, labelled: Callable[[], AbstractContextManager[None]],
                 cond_freqs: slice | None = None) -> None:
        super().__init__(target_tokens, cond_freqs)
        self.kv: dict[int, tuple[Tensor, Tensor]] = {}
        self.labelled = labelled

    def keeping(self) -> AbstractContextManager[None]:
        return self.labelled()

    def put(self, layer: int, k: Tensor, v: Tensor) -> None:
        self.kv[layer] = (k, v)
        self.nbytes += 2 * k.numel() * k.element_size()

    def get(self, layer: int) -> tuple[Tensor, Tensor]:
        return self.kv[layer]

    def close(self) -> None:
        self.kv.clear()


class RetainedPrefix(Prefix):
    """`--cond-cache retain`: the text's K/V made for this request (a DevicePrefix over the text alone), each
    reference's kept across requests (runner.refserver.retain); read as [text | reference 1 | reference 2 ...]."""

    def __init__(self, text: Prefix, references: list[list[tuple[Tensor, Tensor]]]) -> None:
        super().__init__(text.target_tokens)
        self.text, self.references = text, references
        self.filling = False
        self.nbytes = text.nbytes  # what this request adds; the kept references are the store's

    def parts(self, layer: int) -> tuple[list[Tensor], list[Tensor]]:
        k, v = self.text.get(layer)
        return [k, *(kv[layer][0] for kv in self.references)], [v, *(kv[layer][1] for kv in self.references)]

    def close(self) -> None:
        self.text.close()


class HostPrefix(Prefix):
    """K/V in host memory (page-locked on CUDA); a reading layer copies its own in and, on CUDA, the next
    layer's on a side stream while it computes."""

    def __init__(self, target_tokens: int, device: torch.device, layers: int,
                 host: Callable[[], AbstractContextManager[None]],
                 pinned: Callable[[tuple[int, ...], torch.dtype], Tensor] | None) -> None:
        super().__init__(target_tokens)
        self.device, self.layers, self.host, self.pinned = device, layers, host, pinned
        self.store: Tensor | None = None
        self.staged: dict[int, tuple[Tensor, Tensor, torch.cuda.Event | None]] = {}
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def put(self, layer: int, k: Tensor, v: Tensor) -> None:
        with self.host():
            if self.store is None:
                shape = (self.layers, 2, *k.shape)
                self.store = self.pinned(shape, k.dtype) if self.pinned else torch.empty(shape, dtype=k.dtype)
            self.store[layer, 0].copy_(k)
            self.store[layer, 1].copy_(v)
        self.nbytes += 2 * k.numel() * k.element_size()

    def _stage(self, layer: int) -> None:
        if layer >= self.layers or layer in self.staged or self.store is None:
            return
        hk, hv = self.store[layer, 0], self.store[layer, 1]
        if self.stream is None:  # the CPU: the copy is made under the ledger, so it counts as device memory
            self.staged[layer] = (hk.clone(), hv.clone(), None)
            return
        with torch.cuda.stream(self.stream):
            k, v = hk.to(self.device, non_blocking=True), hv.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        main = torch.cuda.current_stream(self.device)
        k.record_stream(main)  # made on the copy stream, used on the main one
        v.record_stream(main)
        self.staged[layer] = (k, v, event)

    def get(self, layer: int) -> tuple[Tensor, Tensor]:
        self._stage(layer)
        if self.stream is not None:
            self._stage(layer + 1)
        k, v, event = self.staged[layer]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        return k, v

    def release(self, layer: int) -> None:
        self.staged.pop(layer, None)

    def close(self) -> None:
        self.staged.clear()
        if self.stream is not None:  # no copy may still read the buffer the next request refills
            self.stream.synchronize()
        self.store = None


def _project(attn: Any, x: Tensor, text: bool) -> tuple[Tensor, Tensor, Tensor]:
    """A stream's Q/K/V by head, QK-normalized: (B, L, heads, head_dim)."""
    head_dim = attn.inner_dim // attn.heads
    if text:
        q, k, v = attn.add_q_proj(x), attn.add_k_proj(x), attn.add_v_proj(x)
        norm_q, norm_k = attn.norm_added_q, attn.norm_added_k
    else:
        q, k, v = attn.to_q(x), attn.to_k(x), attn.to_v(x)
        norm_q, norm_k = attn.norm_q, attn.norm_k
    q, k, v = (t.unflatten(-1, (-1, head_dim)) for t in (q, k, v))
    return (norm_q(q) if norm_q is not None else q), (norm_k(k) if norm_k is not None else k), v


def _rope(t: Tensor, freqs: Tensor) -> Tensor:
    if not t.shape[1]:
        return t  # no tokens (no references)
    # diffusers 0.42 annotates the return as a (cos, sin) pair; with use_real=False it is the one rotated tensor
    return apply_rotary_emb_qwen(t, freqs, use_real=False)  # type: ignore[return-value]


def _attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """(B, L, H, D) in and out, as diffusers' native attention backend."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


class PrefixAttnProcessor:
    """Installed on every block (its layer index known). Without a `prefix` it is diffusers' own processor."""

    def __init__(self, layer: int) -> None:
        self.layer = layer
        # diffusers 0.42 annotates the processor as returning one FloatTensor (it returns the (image, text) pair)
        # and its optional arguments as `FloatTensor = None`: typed here as what it takes and returns
        self.joint: Callable[..., tuple[Tensor, Tensor]]
        self.joint = QwenDoubleStreamAttnProcessor2_0()  # type: ignore[assignment]

    def __call__(self, attn: Any, hidden_states: Tensor, encoder_hidden_states: Tensor,
                 encoder_hidden_states_mask: Tensor | None = None, attention_mask: Tensor | None = None,
                 image_rotary_emb: tuple[Tensor, Tensor] | None = None, prefix: Prefix | None = None
                 ) -> tuple[Tensor, Tensor]:
        if prefix is None:
            return self.joint(attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                              attention_mask, image_rotary_emb)
        assert image_rotary_emb is not None
        img_freqs, txt_freqs = image_rotary_emb
        n = prefix.target_tokens  # the target comes first in img_shapes, as Qwen-Image-Edit-Plus orders it
        if prefix.filling:  # the condition alone: [text | references]
            tq, tk, tv = _project(attn, encoder_hidden_states, text=True)
            rq, rk, rv = _project(attn, hidden_states, text=False)
            tq, tk = _rope(tq, txt_freqs), _rope(tk, txt_freqs)
            rq, rk = _rope(rq, img_freqs[prefix.cond_freqs]), _rope(rk, img_freqs[prefix.cond_freqs])
            with prefix.keeping():
                k, v = torch.cat([tk, rk], dim=1), torch.cat([tv, rv], dim=1)
            out = _attend(torch.cat([tq, rq], dim=1), k, v).flatten(2, 3).to(tq.dtype)
            prefix.put(self.layer, k, v)
            del k, v
            seq_txt = encoder_hidden_states.shape[1]
            txt_out, img_out = out[:, :seq_txt], out[:, seq_txt:]
        else:  # the target alone, over the kept condition
            q, k, v = _project(attn, hidden_states, text=False)
            q, k = _rope(q, img_freqs[:n]), _rope(k, img_freqs[:n])
            ck, cv = prefix.parts(self.layer)
            img_out = _attend(q, torch.cat([*ck, k], dim=1), torch.cat([*cv, v], dim=1)).flatten(2, 3).to(q.dtype)
            del ck, cv
            prefix.release(self.layer)
            txt_out = img_out[:, :0]  # the text stream is empty while reading
        img_out = attn.to_out[0](img_out.contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        return img_out, attn.to_add_out(txt_out.contiguous())


def install(model: Any) -> None:
    for layer, block in enumerate(model.transformer_blocks):
        block.attn.set_processor(PrefixAttnProcessor(layer))

