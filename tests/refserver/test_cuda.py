"""CUDA checks of the engine (no HTTP): run on a GPU host with `pytest tests/refserver/test_cuda.py`."""

from __future__ import annotations

import gc
import os

# before anything initializes CUDA (the skipif below does): the server sets the same in configure_torch
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np
import pytest
import torch
from refserver_helpers import make_ref

from runner.judge.scoring import psnr
from runner.refserver.config import ServerConfig, resolve_preset
from runner.refserver.engine import Engine, GenerationRequest, configure_torch, png_bytes
from runner.refserver.memory import is_oom

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
REFS = tuple(make_ref(i, (512, 384)) for i in range(4))


def engine(preset: str = "tiny", **kw: object) -> Engine:
    cfg = ServerConfig(preset=resolve_preset(preset, None, None, None), device="cuda", dtype="bfloat16", **kw)
    configure_torch(cfg)
    return Engine(cfg)


def release() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0)


def req(refs: int, side: int = 128, steps: int = 4) -> GenerationRequest:
    return GenerationRequest(prompt="a cat on a sofa", references=REFS[:refs], width=side, height=side,
                             steps=steps, seed=2301)


def test_cuda_determinism_and_cache_modes() -> None:
    out = {}
    for mode in ("device", "host", "off"):
        e = engine(cond_cache=mode)
        a, b = e.generate(req(2)), e.generate(req(2))
        assert png_bytes(a.images[0]) == png_bytes(b.images[0]), mode
        out[mode] = (np.asarray(a.images[0]), a.peak_bytes)
        del e
        release()
    print({m: v[1] for m, v in out.items()})
    assert psnr(out["device"][0], out["host"][0]) >= 40
    assert psnr(out["device"][0], out["off"][0]) >= 40
    assert out["device"][1] > out["host"][1] and out["device"][1] > out["off"][1]


def test_cuda_int8_and_offload() -> None:
    base = engine()
    ref = np.asarray(base.generate(req(1)).images[0])
    w, on_device = base.weight_bytes, base.device_weight_bytes
    del base
    release()
    q = engine(quantization="int8")
    assert q.weight_bytes < 0.7 * w
    assert 25 <= psnr(ref, np.asarray(q.generate(req(1)).images[0])) <= 50
    del q
    release()
    off = engine(offload="layerwise")
    assert off.device_weight_bytes < on_device / 2 and off.host_pinned_bytes > w / 2
    assert psnr(ref, np.asarray(off.generate(req(1)).images[0])) >= 40
    del off
    release()


def test_cuda_pinned_pool_reused_and_fp8() -> None:
    """The host cache's pinned buffers are allocated once and reused; the images match the device cache's."""
    dev = engine()
    ref = np.asarray(dev.generate(req(2)).images[0])
    w = dev.weight_bytes
    del dev
    release()
    pooled = engine(cond_cache="host")
    a = pooled.generate(req(2))
    first = pooled.pinned.nbytes
    assert first > 0 and pooled.pinned.buffers[0].is_pinned()
    b = pooled.generate(req(2))
    assert pooled.pinned.nbytes == first  # reused, not reallocated
    assert png_bytes(a.images[0]) == png_bytes(b.images[0])
    assert psnr(ref, np.asarray(a.images[0])) >= 40
    pooled.generate(req(4))
    assert pooled.pinned.nbytes > first  # grown once for the larger request
    del pooled
    release()
    f8 = engine(quantization="fp8")
    assert f8.weight_bytes < 0.7 * w
    assert psnr(ref, np.asarray(f8.generate(req(2)).images[0])) >= 25
    del f8
    release()


def test_cuda_whole_device_cap_counts_the_context() -> None:
    """Under --vram-gib the allocator may use the cap minus what the device holds outside PyTorch."""
    e = engine(vram_gib=2.0)
    assert e.mem.whole_device and e.mem.non_pytorch > 0
    e.generate(req(1))
    used = e.mem.device_used()
    assert used <= 2 * 2**30, used
    del e
    release()
    loose = engine(vram_gib=2.0, whole_device=False)
    assert loose.mem.non_pytorch == 0
    del loose
    release()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory < 30 * 2**30,
                    reason="needs a GPU with more than 30 GiB")
def test_h200_24g_crossing() -> None:
    """With --vram-gib 24 and cond-cache device, 2 references fit at 1024x1024 with CFG, 3 do not; the
    engine recovers; host/off caches fit 4."""
    e = engine("h200-24g", vram_gib=24.0)
    peaks = {n: e.generate(req(n, 1024, 2)).peak_bytes / 2**30 for n in (0, 1, 2)}
    print("device peaks GiB", peaks)
    with pytest.raises(Exception) as exc:
        e.generate(req(3, 1024, 2))
    assert is_oom(exc.value)
    exc = None
    release()
    torch.cuda.set_per_process_memory_fraction(24 * 2**30 / torch.cuda.get_device_properties(0).total_memory)
    assert e.generate(req(1, 1024, 2)).peak_bytes / 2**30 == pytest.approx(peaks[1], rel=0.01)
    del e
    release()
    for mode in ("host", "off"):
        e = engine("h200-24g", vram_gib=24.0, cond_cache=mode)
        r = e.generate(req(4, 1024, 2))
        print(mode, "4-ref peak GiB", r.peak_bytes / 2**30, "s", r.seconds)
        del e, r
        release()
