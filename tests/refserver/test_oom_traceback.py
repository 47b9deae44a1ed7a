"""On an OOM the reference server logs a genuine traceback ending at its own model line that asked for the
memory, with PyTorch's full OOM text (allocated / reserved-but-unallocated), and its memory grows per
reference like a conditioning cache. In-process, on CPU (the accounted ledger); CUDA is the H200 script's."""

from __future__ import annotations

import io
import itertools
import logging
from pathlib import Path

import pytest
from PIL import Image

from runner.observe.oom import read_oom
from runner.refserver.cli import build_parser, config_from_args
from runner.refserver.engine import Engine, GenerationRequest, configure_torch
from runner.refserver.memory import as_raised_by_allocator, is_oom

ROOT = Path(__file__).resolve().parents[2]
REFS = tuple(Image.new("RGB", (64, 64), (40 * i, 90, 160 - 30 * i)) for i in range(4))


def _engine(*args: str) -> Engine:
    config = config_from_args(build_parser().parse_args(["--preset", "tiny", *args]))
    configure_torch(config)
    return Engine(config)


def _request(n: int) -> GenerationRequest:
    return GenerationRequest(prompt="shapes", references=REFS[:n], steps=2, seed=1, negative_prompt=" ")


def _logged(exc: BaseException) -> str:
    buf = io.StringIO()
    log = logging.getLogger("test-oom-traceback")
    handler = logging.StreamHandler(buf)
    log.addHandler(handler)
    try:
        log.error("request 1 generation failed: %s", exc, exc_info=as_raised_by_allocator(exc))
    finally:
        log.removeHandler(handler)
    return buf.getvalue()


def test_a_request_oom_logs_a_traceback_ending_at_the_model_line() -> None:
    engine = _engine("--vram-gib", str(7.75 / 1024))
    with pytest.raises(Exception) as caught:
        for n in range(5):
            engine.generate(_request(n))
    assert is_oom(caught.value)
    text = _logged(caught.value)
    assert "Traceback (most recent call last):" in text and "memory.py" not in text  # the ledger's frames cut
    oom = read_oom(log=text)
    assert oom is not None and oom.site is not None and oom.site.startswith("runner/refserver/model.py:")
    assert oom.function in ("cond_forward", "latent_forward")
    assert oom.reserved_unallocated_bytes == 0 and oom.allocated_bytes and oom.tried_bytes
    assert oom.capacity_bytes == round(7.75 * 2**20)
    for frame in oom.frames:  # genuine frames: each names a real line of the file it points at
        lines = (ROOT / frame.path).read_text().splitlines()
        assert lines[frame.line - 1].strip() == frame.code


def test_a_load_oom_names_the_load_path() -> None:
    with pytest.raises(Exception) as caught:
        _engine("--vram-gib", str(2.0 / 1024))
    oom = read_oom(log=_logged(caught.value))
    assert oom is not None and oom.site is not None and oom.site.startswith("runner/refserver/engine.py:")
    assert oom.function == "_load"


def test_memory_grows_per_reference_like_a_conditioning_cache() -> None:
    device, host = _engine(), _engine("--cond-cache", "host")
    peaks = {name: [e.generate(_request(n)).peak_bytes for n in range(4)] for name, e in
             (("device", device), ("host", host))}
    steps = {name: {b - a for a, b in itertools.pairwise(p)} for name, p in peaks.items()}
    assert len(steps["device"]) == 1 and len(steps["host"]) == 1  # linear in references, as a cache is
    cache = 2 * device.cond_cache_bytes_per_reference()  # K and V of every layer, two CFG passes
    (per_ref,) = steps["device"]
    (host_per_ref,) = steps["host"]
    assert per_ref >= cache  # one more reference adds its cache (and the attention over it) on the device
    assert per_ref - host_per_ref >= cache / 2  # in host memory, only the staged layers stay on the device
