"""The reference server's Qwen-Image engine (--arch qwen-image) on one emulated card: peak allocated, seconds and
the OOM of each reference count, in process (no HTTP), one JSON line per request. For the H200 (issue 28):

    python3 benchmarks/qwen_image_sweep.py h200-24g 24 --refs 1-6 [--side 1024] [-- refserver flags...]

Run once per allocator setting (PYTORCH_CUDA_ALLOC_CONF is read when CUDA starts). A load OOM is a line too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from PIL import Image


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("preset")
    ap.add_argument("vram_gib", type=float)
    ap.add_argument("--refs", default="1-6")
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--device", default="cuda")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    a.rest = argv[cut + 1:]  # the refserver's own flags
    lo, hi = (int(x) for x in a.refs.split("-"))

    import torch

    from runner.refserver.cli import build_parser, config_from_args
    from runner.refserver.engine import GenerationRequest, configure_torch
    from runner.refserver.memory import is_oom
    from runner.refserver.qwen_image.engine import QwenEngine

    flags = ["--arch", "qwen-image", "--preset", a.preset, "--device", a.device, "--vram-gib", str(a.vram_gib),
             *a.rest]
    cfg = config_from_args(build_parser().parse_args(flags))
    configure_torch(cfg)
    head = {"preset": a.preset, "vram_gib": a.vram_gib, "flags": a.rest, "side": a.side, "steps": a.steps}
    t0 = time.perf_counter()
    try:
        engine = QwenEngine(cfg)
        engine.warm_up()
    except Exception as exc:
        if not is_oom(exc):
            raise
        print(json.dumps({**head, "load": "oom", "message": str(exc)[:400]}), flush=True)
        return 0
    print(json.dumps({**head, "load_s": round(time.perf_counter() - t0, 2), "weight_bytes": engine.weight_bytes,
                      "device_weight_bytes": engine.device_weight_bytes,
                      "after_load_allocated": engine.mem.current()}), flush=True)
    ref = Image.new("RGB", (1024, 1024), (120, 60, 30))
    for n in range(lo, hi + 1):
        req = GenerationRequest(prompt="Compose the subjects of the reference images into one scene.",
                                references=(ref,) * n, width=a.side, height=a.side, steps=a.steps, seed=1,
                                negative_prompt=" ")
        try:
            r = engine.generate(req)
            print(json.dumps({**head, "refs": n, "peak_allocated": r.peak_bytes, "peak_reserved":
                              r.peak_reserved_bytes, "seconds": round(r.seconds, 3)}), flush=True)
        except Exception as exc:
            if not is_oom(exc):
                raise
            print(json.dumps({**head, "refs": n, "oom": str(exc)[:300]}), flush=True)
            break
        finally:
            if a.device.startswith("cuda"):
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
