"""The Qwen-Image engine (--arch qwen-image) on the CPU: diffusers' transformer under the tensor ledger."""

from __future__ import annotations

import traceback
from typing import TYPE_CHECKING

import numpy as np
import pytest
from PIL import Image

from tests.conftest import needs_diffusers

if TYPE_CHECKING:
    from runner.refserver.engine import GenerationRequest
    from runner.refserver.qwen_image.engine import QwenEngine

pytestmark = needs_diffusers  # diffusers is imported by the tests as they run (engine() below), not at collection

REFS = tuple(Image.new("RGB", (96, 96), c) for c in ((200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30)))
PROMPT = "Place the shapes from the reference images together on one table, in order."


def engine(*flags: str) -> QwenEngine:
    from runner.refserver.cli import build_parser, config_from_args
    from runner.refserver.engine import configure_torch
    from runner.refserver.qwen_image.engine import QwenEngine

    config = config_from_args(build_parser().parse_args(["--arch", "qwen-image", "--preset", "tiny", *flags]))
    configure_torch(config)
    return QwenEngine(config)


def request(refs: int, steps: int = 2, seed: int = 1) -> GenerationRequest:
    from runner.refserver.engine import GenerationRequest

    return GenerationRequest(prompt=PROMPT, references=REFS[:refs], width=128, height=128, steps=steps, seed=seed,
                             negative_prompt=" ")


def test_weights_are_counted_from_the_tensors_and_requests_are_deterministic() -> None:
    e = engine()
    assert e.mem.current() >= e.weight_bytes > 0  # the weights (and RoPE's tables) as the ledger saw them made
    a, b = e.generate(request(2)), e.generate(request(2))
    assert np.array_equal(np.asarray(a.images[0]), np.asarray(b.images[0]))
    assert a.peak_bytes == b.peak_bytes > e.weight_bytes
    other = e.generate(request(2, seed=2))
    assert not np.array_equal(np.asarray(a.images[0]), np.asarray(other.images[0]))


def test_each_reference_costs_the_same_in_diffusers_forward() -> None:
    e = engine()
    peaks = [e.generate(request(n)).peak_bytes for n in range(1, 5)]
    steps = np.diff(peaks)
    assert steps.min() > 0 and (steps.max() - steps.min()) <= 0.1 * steps.mean(), peaks


def test_cond_cache_host_moves_the_prefix_kv_off_the_accounted_device() -> None:
    """During the steps, the device cache holds every layer's condition K/V of both CFG passes; the host cache
    holds none of it on the device (a layer's copy visits only while that layer attends)."""
    live: dict[str, int] = {}
    for mode in ("device", "host"):
        e = engine("--cond-cache", mode)
        e.generate(request(4, steps=1), on_step=lambda n, s, e=e, mode=mode: live.setdefault(mode, e.mem.current()))
    p = e.p
    text_tokens = [len(t) for t in (e.stand_ins.text(PROMPT)[0], e.stand_ins.text(" ")[0])]
    kv = sum(p.layers * 2 * (t + 4 * p.ref_tokens) * p.dim * 4 for t in text_tokens)  # float32 K and V
    assert live["device"] - live["host"] == kv, (live, kv)


def test_an_accounted_oom_ends_in_diffusers_code_like_a_cuda_one() -> None:
    from runner.refserver.memory import as_raised_by_allocator, is_oom

    e = engine()
    full = e.generate(request(3)).peak_bytes
    tight = engine("--vram-gib", str((full - 1) / 2**30))
    with pytest.raises(Exception) as caught:
        tight.generate(request(3))
    exc = caught.value
    assert is_oom(exc) and str(exc).startswith("CUDA out of memory. Tried to allocate")
    frames = traceback.extract_tb(as_raised_by_allocator(exc).__traceback__)
    assert "ledger.py" not in frames[-1].filename  # the ledger's own frames are cut, as the allocator's are
    assert any("/diffusers/" in f.filename for f in frames), [f.filename for f in frames]


def test_the_weights_too_large_for_the_budget_fail_at_load_in_diffusers_init() -> None:
    from runner.refserver.memory import as_raised_by_allocator, is_oom

    with pytest.raises(Exception) as caught:
        engine("--vram-gib", str(4 / 1024))
    frames = traceback.extract_tb(as_raised_by_allocator(caught.value).__traceback__)
    assert is_oom(caught.value)
    assert any("/diffusers/" in f.filename and f.name == "__init__" for f in frames)


def test_layerwise_offload_keeps_the_blocks_off_the_device_but_the_running_one() -> None:
    resident, offloaded = engine(), engine("--cpu-offload")
    assert offloaded.mem.current() < resident.weight_bytes / 10  # built on the host: the blocks visit
    r, o = resident.generate(request(2)), offloaded.generate(request(2))
    block = resident.weight_bytes // resident.p.layers
    assert o.peak_bytes < r.peak_bytes - 2 * block
    assert np.array_equal(np.asarray(r.images[0]), np.asarray(o.images[0]))  # the same weights, moved
