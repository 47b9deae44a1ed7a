"""`python -m runner.refserver` / `runner refserver`: load the model, then (only then) bind the port."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from runner.refserver.config import CACHE_MODES, DTYPES, PRESETS, QUANTIZATIONS, ServerConfig, resolve_preset
from runner.refserver.faults import FaultPlan

log = logging.getLogger("refserver")

EXIT_OOM = 1
EXIT_USAGE = 2
EXIT_LOAD_FAIL = 3


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="runner refserver",
        description="Reference diffusion server: a small real diffusion transformer behind vLLM-Omni's API.",
    )
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="port to bind after the model loads (default 8000)")
    ap.add_argument("--model", default="refserver", help="served model name echoed in responses")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model size preset (default tiny)")
    ap.add_argument("--dim", type=int, help="override the preset's hidden size")
    ap.add_argument("--layers", type=int, help="override the preset's number of blocks")
    ap.add_argument("--heads", type=int, help="override the preset's attention heads")
    ap.add_argument("--ref-tokens", type=int, help="override tokens per reference image (a perfect square)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    ap.add_argument("--dtype", choices=DTYPES, help="compute dtype (default float32 on cpu, bfloat16 on cuda)")
    ap.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                    help="int8: W8A8 linear layers in the blocks (int8 weight storage)")
    ap.add_argument("--cpu-offload", action="store_true",
                    help="blocks' weights live on the host and visit the device one block at a time")
    ap.add_argument("--cond-cache", default="device", choices=CACHE_MODES,
                    help="where the per-request conditioning K/V lives (default device)")
    ap.add_argument("--vram-gib", type=float,
                    help="device memory cap in GiB (CUDA: real cap; CPU: accounted budget)")
    ap.add_argument("--threads", type=int, help="torch threads (default 1 on cpu)")
    ap.add_argument("--seed-weights", type=int, default=0, help="seed of the random weights (default 0)")
    ap.add_argument("--fault", action="append", default=[], metavar="KIND[@N]",
                    help="inject a fault (repeatable): load-fail, slow-load=SECONDS, jitter=MIN:MAX[:SEED], "
                         "exit@N, hang@N, malformed-json[@N], no-image[@N], wrong-size[@N], transparent[@N], grey[@N]")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return ap


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    preset = resolve_preset(args.preset, args.dim, args.layers, args.ref_tokens, args.heads)
    device = args.device
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"--device must be cpu or cuda[:N] (got {device!r})")
    dtype = args.dtype or ("float32" if device == "cpu" else "bfloat16")
    if args.vram_gib is not None and args.vram_gib <= 0:
        raise ValueError("--vram-gib must be > 0")
    return ServerConfig(preset=preset, device=device, dtype=dtype, quantization=args.quantization,
                        cpu_offload=args.cpu_offload, cond_cache=args.cond_cache, vram_gib=args.vram_gib,
                        threads=args.threads, host=args.host, port=args.port, model_name=args.model,
                        seed_weights=args.seed_weights, log_level=args.log_level,
                        faults=FaultPlan.parse(args.fault))


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)  # StreamHandler flushes after every record
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"refserver: {exc}", file=sys.stderr)
        return EXIT_USAGE
    setup_logging(config.log_level)
    log.info("refserver starting: %s", " ".join(sys.argv if argv is None else ["refserver", *argv]))
    if config.faults.load_fail:
        log.error("fault load-fail: model load failed on purpose; exiting with code %d before binding",
                  EXIT_LOAD_FAIL)
        return EXIT_LOAD_FAIL

    # Heavy imports after argument checks, so usage errors are instant.
    import torch
    import uvicorn

    from runner.refserver.app import create_app
    from runner.refserver.engine import Engine, configure_torch
    from runner.refserver.memory import is_oom

    configure_torch(config)  # sets allocator/cuBLAS environment, so before anything touches CUDA
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        log.error("--device %s requested but CUDA is not available", config.device)
        return EXIT_USAGE
    try:
        engine = Engine(config)
    except Exception as exc:
        if not is_oom(exc):
            raise
        log.error("model load failed: %s", exc)  # as vLLM-Omni: an init OOM ends the process unbound
        return EXIT_OOM
    log.info(engine.summary())
    if config.faults.slow_load_s > 0:
        log.info("fault slow-load: sleeping %.1f s before binding", config.faults.slow_load_s)
        time.sleep(config.faults.slow_load_s)
    app = create_app(engine, config)
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_config=None, access_log=False, workers=1,
        log_level=config.log_level, timeout_graceful_shutdown=1,
    ))
    server.run()
    return 0 if server.started else 1
