"""Is the reference server's engine byte-deterministic on this device? Which attention backend breaks it?

    python3 benchmarks/determinism.py --device cuda --preset h200-24g --vram-gib 24 [--steps 8]

Generates the same request (1 reference, 1024x1024, fixed seed) three times in one process for each cache
mode and each scaled-dot-product-attention backend, and prints whether the PNGs are byte-identical and the
PSNR between repeats.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import sys
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="h200-24g")
    ap.add_argument("--vram-gib", default="24")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--backends", default="default,flash,efficient,math",
                    help="comma list of: default (the engine's own choice), flash, efficient, math")
    args = ap.parse_args()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from runner.refserver.cli import build_parser, config_from_args
    from runner.refserver.engine import Engine, GenerationRequest, configure_torch, png_bytes

    ref = Image.open(ROOT / "examples" / "refs" / "ref-1.png").convert("RGB")
    print(f"command: {' '.join(sys.argv)}; torch {torch.__version__}")
    backends = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "math": SDPBackend.MATH}
    for mode in ("off", "device"):
        cfg = config_from_args(build_parser().parse_args(
            ["--device", args.device, "--preset", args.preset, "--cond-cache", mode, "--vram-gib", args.vram_gib]))
        configure_torch(cfg)
        engine = Engine(cfg)
        req = GenerationRequest(prompt="shapes on a table", references=(ref,), width=1024, height=1024,
                                steps=args.steps, seed=2301)
        for name, backend in backends.items():
            if name not in args.backends.split(","):
                continue
            pngs = []
            try:
                for _ in range(3):
                    if backend is None:
                        pngs.append(png_bytes(engine.generate(req).images[0]))
                    else:
                        with sdpa_kernel([backend]):
                            pngs.append(png_bytes(engine.generate(req).images[0]))
            except Exception as exc:  # a backend that cannot run this shape, or OOM under the cap
                print(f"mode {mode:6s} sdpa {name:9s}: error {type(exc).__name__}: {str(exc)[:120]}")
                continue
            arrays = [np.asarray(Image.open(io.BytesIO(p)).convert("RGB"), dtype=np.float64) for p in pngs]
            psnrs = []
            for a in arrays[1:]:
                mse = float(np.mean((a - arrays[0]) ** 2))
                psnrs.append(float("inf") if mse == 0 else 10 * np.log10(255**2 / mse))
            digests = [hashlib.sha256(p).hexdigest()[:10] for p in pngs]
            print(f"mode {mode:6s} sdpa {name:9s}: identical={len(set(digests)) == 1} digests={digests} "
                  f"psnr_vs_first={[round(x, 2) for x in psnrs]}")
        del engine
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
