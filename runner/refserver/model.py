"""The network: a small two-stream diffusion transformer with deterministic random weights.

Conditioning tokens ([text | references]) form a stream that attends only among itself and never reads the
noisy latent or the timestep, so each layer's conditioning K/V is a per-request constant — a "prefix" that
can be cached (engine.py decides where). Latent tokens attend over [conditioning K/V | latent K/V].
Activations that the engine's memory ledger counts are announced through `mem.hold(...)`.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from runner.refserver.config import Preset
from runner.refserver.memory import DeviceMemory
from runner.refserver.quant import QUANTIZED

T_FREQ_DIM = 256
_WORD = re.compile(r"\w+|[^\w\s]", re.UNICODE)

Nbytes = Callable[[int], int]  # element count -> bytes in the compute dtype


def tokenize(text: str, vocab: int, max_tokens: int) -> list[int]:
    """Hashing tokenizer: a stable crc32 of each lower-cased word; id 0 is a BOS token always present."""
    ids = [1 + zlib.crc32(w.lower().encode()) % (vocab - 1) for w in _WORD.findall(text)]
    return [0, *ids][:max_tokens]


def reference_patches(img: Image.Image, preset: Preset) -> np.ndarray:
    """A reference resized to the fixed token grid and cut into patches: (ref_tokens, 3*p*p) uint8."""
    g, p = preset.ref_grid, preset.ref_patch_px
    arr = np.asarray(img.convert("RGB").resize((g * p, g * p), Image.Resampling.BICUBIC), dtype=np.uint8)
    return arr.reshape(g, p, g, p, 3).transpose(0, 2, 1, 3, 4).reshape(g * g, p * p * 3)


def sincos(pos: Tensor, dim: int) -> Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=pos.device, dtype=torch.float32) / half)
    args = pos.float()[:, None] * freqs[None]
    return torch.cat([args.sin(), args.cos()], dim=-1)


def pos2d(h: int, w: int, dim: int, device: torch.device) -> Tensor:
    rows = torch.arange(h, device=device).repeat_interleave(w)
    cols = torch.arange(w, device=device).repeat(h)
    return torch.cat([sincos(rows, dim // 2), sincos(cols, dim // 2)], dim=-1)


def position_features(coords: Tensor, gain: Tensor, m: int, head_dim: int) -> Tensor:
    """(L, 2) coordinates in [0, 1] and (L,) gains -> (L, m) Fourier features whose dot product peaks
    (at about 6 logits x gain) for tokens at the same place; gain 0 (text) means no position."""
    freqs = math.pi * 2.0 ** torch.arange(m // 4, device=coords.device, dtype=torch.float32)
    ang = coords.float()[:, :, None] * freqs  # (L, 2, m/4)
    feats = torch.cat([ang.cos(), ang.sin()], dim=-1).flatten(1)  # (L, m)
    alpha = math.sqrt(6.0 * math.sqrt(head_dim) / (m / 2))
    return feats * alpha * gain.float()[:, None]


def grid_coords(h: int, w: int, device: torch.device) -> Tensor:
    ys = (torch.arange(h, device=device, dtype=torch.float32) + 0.5) / h
    xs = (torch.arange(w, device=device, dtype=torch.float32) + 0.5) / w
    return torch.stack([ys.repeat_interleave(w), xs.repeat(h)], dim=-1)


def _heads(t: Tensor, h: int) -> Tensor:  # (1, L, D) -> (1, h, L, D/h)
    return t.unflatten(-1, (h, -1)).transpose(1, 2)


def _merge(t: Tensor) -> Tensor:  # (1, h, L, d) -> (1, L, h*d)
    return t.transpose(1, 2).flatten(2)



# PyTorch's default attention dispatch on an H200 picked a backend whose results vary between identical
# calls (three identical requests: PSNR ~30 dB between repeats, benchmarks/determinism.py); flash,
# memory-efficient and math attention each gave byte-identical repeats. CUDA is pinned to those.
_DETERMINISTIC_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    if q.is_cuda:
        with sdpa_kernel(_DETERMINISTIC_SDPA):
            return F.scaled_dot_product_attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v)



class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.heads, self.mlp_ratio = heads, mlp_ratio
        hidden = dim * mlp_ratio
        # conditioning stream
        self.c_qkv, self.c_out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.c_fc1, self.c_fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        # latent stream, modulated by the timestep (adaLN: shift/scale/gate for attention and MLP)
        self.x_mod = nn.Linear(dim, 6 * dim)
        self.x_qkv, self.x_out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.x_fc1, self.x_fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def _qkv(self, proj: nn.Module, h: Tensor, pf_q: Tensor, pf_k: Tensor,
             kv_named: Callable[[], AbstractContextManager[None]] = nullcontext) -> tuple[Tensor, Tensor, Tensor]:
        """Projects to heads; the last m dims of each q/k head carry position features, so attention
        prefers spatially aligned tokens (a latent cell <-> the same place in each reference)."""
        q, k, v = (_heads(t, self.heads) for t in proj(h).chunk(3, dim=-1))
        d, m = q.shape[-1], pf_q.shape[-1]

        def put(t: Tensor, pf: Tensor) -> Tensor:
            pos = pf.to(t.dtype)[None, None].expand(1, self.heads, -1, -1)
            return torch.cat([F.rms_norm(t[..., : d - m], (d - m,)), pos], dim=-1)

        with kv_named():  # the K a kept cache holds is this tensor (an allocator snapshot names it)
            k = put(k, pf_k)
        return put(q, pf_q), k, v

    def cond_forward(self, c: Tensor, pf: Tensor, mem: DeviceMemory, nb: Nbytes, chunk: int
                     ) -> tuple[Tensor, Tensor, Tensor]:
        """One layer of the conditioning stream: returns (next c, K, V). Queries and MLP rows go in chunks
        of at most `chunk` tokens so this stream never needs more scratch than the latent stream."""
        n, d = c.shape[1], c.shape[2]
        with mem.hold(nb(2 * n * d), "cond q + attention output"):
            q, k, v = self._qkv(self.c_qkv, F.layer_norm(c, (d,)), pf, pf, mem.labelled)
            with mem.labelled():  # a kept cache's K/V carry its name in an allocator snapshot
                k, v = k.contiguous(), v.contiguous()  # own storage: the K/V outlive the fused qkv tensor
            outs = []
            for s in range(0, n, chunk):
                with mem.hold(nb(self.heads * min(chunk, n - s) * n), "cond attention scores"):
                    outs.append(attention(q[:, :, s : s + chunk], k, v))
            c = c + self.c_out(_merge(torch.cat(outs, dim=2)))
        parts = []
        for s in range(0, n, chunk):
            with mem.hold(nb(min(chunk, n - s) * d * self.mlp_ratio), "cond mlp hidden"):
                cs = c[:, s : s + chunk]
                parts.append(cs + self.c_fc2(F.gelu(self.c_fc1(F.layer_norm(cs, (d,))))))
        return torch.cat(parts, dim=1), k, v

    def latent_forward(self, x: Tensor, pf: Tensor, temb: Tensor, k_c: list[Tensor], v_c: list[Tensor],
                       mem: DeviceMemory, nb: Nbytes) -> Tensor:
        """k_c, v_c: the condition's K and V in pieces ([text | reference ...] for a kept cache), joined here."""
        n, d = x.shape[1], x.shape[2]
        nk = n + sum(k.shape[2] for k in k_c)
        sh1, sc1, g1, sh2, sc2, g2 = (m[:, None] for m in self.x_mod(temb).chunk(6, dim=-1))
        scratch = 3 * n * d + 2 * nk * d + self.heads * n * nk + n * d  # qkv, joint K/V, scores, output
        with mem.hold(nb(scratch), "latent attention"):
            q, k, v = self._qkv(self.x_qkv, F.layer_norm(x, (d,)) * (1 + sc1) + sh1, pf, 0 * pf)
            a = attention(q, torch.cat([*k_c, k], dim=2), torch.cat([*v_c, v], dim=2))
            x = x + (1 + g1) * self.x_out(_merge(a))
        with mem.hold(nb(n * d * self.mlp_ratio), "latent mlp hidden"):
            h = F.layer_norm(x, (d,)) * (1 + sc2) + sh2
            x = x + (1 + g2) * self.x_fc2(F.gelu(self.x_fc1(h)))
        return x


class RefServerDiT(nn.Module):
    def __init__(self, p: Preset) -> None:
        super().__init__()
        self.p = p
        d = p.dim
        self.pos_dims = min(16, d // p.heads // 2) // 4 * 4  # head dims that carry position features
        self.tok_dim = p.latent_channels * p.patch**2
        # Built on the meta device and initialised by init_unit: an Embedding given its (empty) weight skips its
        # own normal_ init, which on meta tensors imports torch._dynamo (1.3 s of CPU at every server start).
        self.text_embed = nn.Embedding(p.vocab, d, _weight=torch.empty(p.vocab, d))
        self.ref_in = nn.Linear(3 * p.ref_patch_px**2, d)
        self.ref_slot = nn.Embedding(p.max_refs, d, _weight=torch.empty(p.max_refs, d))  # slot: order matters
        self.latent_in = nn.Linear(self.tok_dim, d)
        self.t_fc1, self.t_fc2 = nn.Linear(T_FREQ_DIM, d), nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d, p.heads, p.mlp_ratio) for _ in range(p.layers))
        self.final_mod, self.final_out = nn.Linear(d, 2 * d), nn.Linear(d, self.tok_dim)
        # tiny decoder latent -> RGB, kept in float32
        self.dec_conv = nn.Conv2d(p.latent_channels, 16, 3, padding=1)
        self.dec_rgb = nn.Conv2d(16, 3, 1)

    def block_list(self) -> list[Block]:
        """`blocks` as the Blocks they are (an nn.ModuleList's items are typed nn.Module)."""
        out = []
        for b in self.blocks:
            if not isinstance(b, Block):
                raise TypeError(f"blocks holds a {type(b).__name__}, not a Block")
            out.append(b)
        return out

    # --- inputs ---------------------------------------------------------------------------------
    def embed_text(self, ids: Tensor) -> Tensor:
        x = self.text_embed(ids)[None]
        return x + sincos(torch.arange(ids.shape[0], device=ids.device), self.p.dim).to(x.dtype)[None]

    def embed_ref(self, patches: Tensor, slot: int, dtype: torch.dtype) -> Tensor:
        """patches: (ref_tokens, 3*p*p) uint8 on the device."""
        x = self.ref_in((patches.to(dtype) / 127.5 - 1.0)[None])
        g = self.p.ref_grid
        pos = pos2d(g, g, self.p.dim, patches.device).to(x.dtype)
        return x + pos[None] + self.ref_slot.weight[slot].to(x.dtype)

    def latent_positions(self, th: int, tw: int, device: torch.device) -> Tensor:
        ones = torch.ones(th * tw, device=device)
        return position_features(grid_coords(th, tw, device), ones, self.pos_dims, self.p.dim // self.p.heads)

    def cond_positions(self, text_tokens: int, refs: int, device: torch.device) -> Tensor:
        """Text has no position; reference slot s is pulled towards the latent with gain 1/(1 + s/2),
        so the first reference shapes the layout most ("picture 1")."""
        g = self.p.ref_grid
        coords = grid_coords(g, g, device)
        parts = [torch.zeros(text_tokens, self.pos_dims, device=device)]
        for s in range(refs):
            gain = torch.full((g * g,), 1.0 / (1.0 + 0.5 * s), device=device)
            parts.append(position_features(coords, gain, self.pos_dims, self.p.dim // self.p.heads))
        return torch.cat(parts, dim=0)

    def embed_latent(self, tokens: Tensor, h: int, w: int) -> Tensor:
        x = self.latent_in(tokens.to(self.latent_in_dtype))
        return x + pos2d(h, w, self.p.dim, tokens.device).to(x.dtype)[None]

    def embed_time(self, t: float, device: torch.device) -> Tensor:
        f = sincos(torch.tensor([t * 1000.0], device=device), T_FREQ_DIM).to(self.latent_in_dtype)
        return F.silu(self.t_fc2(F.silu(self.t_fc1(f))))

    @property
    def latent_in_dtype(self) -> torch.dtype:
        return self.t_fc1.weight.dtype

    # --- outputs --------------------------------------------------------------------------------
    def final(self, x: Tensor, temb: Tensor) -> Tensor:
        shift, scale = (m[:, None] for m in self.final_mod(temb).chunk(2, dim=-1))
        return self.final_out(F.layer_norm(x, (x.shape[-1],)) * (1 + scale) + shift).float()

    def decode(self, latent: Tensor, height: int, width: int) -> Tensor:
        """(1, C, h, w) float32 latent -> (H, W, 3) uint8 image, smooth by construction (bilinear)."""
        y = self.dec_rgb(torch.tanh(self.dec_conv(latent)))
        y = F.avg_pool2d(y, self.p.patch)  # one colour per token: no patch-grid texture
        y = F.avg_pool2d(y, 3, stride=1, padding=1, count_include_pad=False)
        y = F.interpolate(y, size=(height, width), mode="bicubic", align_corners=False)
        # auto-contrast per channel, so a random network still yields a full range of colours
        y = (y - y.mean(dim=(2, 3), keepdim=True)) / (y.std(dim=(2, 3), keepdim=True) + 1e-3)
        return (torch.sigmoid(1.3 * y)[0].permute(1, 2, 0) * 255.0).round().clamp(0, 255).to(torch.uint8)


def _init_std(name: str, t: Tensor, dim: int) -> float:
    if name.endswith("bias"):
        return 0.02
    if "embed" in name or "slot" in name:
        return 1.0
    fan_in = math.prod(t.shape[1:]) if t.dim() > 1 else 1
    if "x_mod" in name or "final_mod" in name:
        return 0.5 / math.sqrt(fan_in)  # modest modulation keeps the residual stream stable
    return 1.0 / math.sqrt(fan_in)


def materialize(unit: nn.Module, device: torch.device) -> None:
    """`unit.to_empty(device)`, tensor by tensor through torch.empty: to_empty's empty_like on a meta tensor
    takes torch._refs' Python path, which imports sympy (0.38 CPU-s at every server start)."""
    for module in unit.modules():
        for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            fresh = torch.empty(t.shape, dtype=t.dtype, device=device)
            setattr(module, name, nn.Parameter(fresh, t.requires_grad) if isinstance(t, nn.Parameter) else fresh)


@torch.no_grad()
def init_unit(unit: nn.Module, prefix: str, device: torch.device, seed: int, dim: int) -> None:
    """Materialize a meta module on `device` with weights that depend only on (seed, parameter name), so
    load order, offload and quantization never change the base weights."""
    materialize(unit, device)
    for name, param in unit.named_parameters():
        full = f"{prefix}.{name}" if prefix else name
        g = torch.Generator(device=device).manual_seed(zlib.crc32(f"{seed}/{full}".encode()))
        param.copy_(torch.randn(param.shape, generator=g, device=device) * _init_std(full, param, dim))


def quantize_linears(block: nn.Module, method: str = "int8") -> None:
    for name, child in list(block.named_children()):
        if isinstance(child, nn.Linear):
            setattr(block, name, QUANTIZED[method](child))


def module_bytes(m: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])
