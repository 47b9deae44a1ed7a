"""`python -m runner.refserver` / `runner refserver`: load the model, then (only then) bind the port."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import sys
import time
from typing import NoReturn

from runner.refserver.config import (
    API_GENERATIONS,
    ARCHS,
    CACHE_MODES,
    DEFAULT_API,
    DTYPES,
    PRESETS,
    QUANTIZATIONS,
    QWEN_PRESETS,
    RELEASES,
    Preset,
    QwenPreset,
    ServerConfig,
    resolve_preset,
    resolve_qwen_preset,
)
from runner.refserver.faults import FaultPlan, hold_host_memory

log = logging.getLogger("refserver")

EXIT_OOM = 1
EXIT_USAGE = 2
EXIT_LOAD_FAIL = 3


class OneLineParser(argparse.ArgumentParser):
    """argparse, whose usage errors are one line (its own prints the whole usage first: some 40 lines here)."""

    def error(self, message: str) -> NoReturn:
        shown = message if len(message) <= 300 else message[:297] + "..."  # a value 5000 digits long is quoted
        self.exit(EXIT_USAGE, f"{self.prog}: error: {shown} (--help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(
        prog="runner refserver",
        description="Reference diffusion server: a small real diffusion transformer behind vLLM-Omni's API.",
    )
    ap.add_argument("model_path", nargs="?", metavar="MODEL",
                    help="vLLM-Omni's positional model: a preset name selects that preset; anything else is "
                         "only the default served model name (no weights are read)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="port to bind after the model loads (default 8000)")
    ap.add_argument("--model", "--served-model-name", dest="model",
                    help="served model name echoed in responses (default: MODEL, else refserver)")
    ap.add_argument("--arch", choices=ARCHS, default="dit",
                    help="the denoiser: dit (our two-stream DiT, default) or qwen-image (diffusers' "
                         "QwenImageTransformer2DModel, random weights)")
    ap.add_argument("--preset", choices=sorted(set(PRESETS) | set(QWEN_PRESETS)),
                    help="model size preset (default tiny)")
    ap.add_argument("--dim", type=int, help="override the preset's hidden size")
    ap.add_argument("--layers", type=int, help="override the preset's number of blocks")
    ap.add_argument("--heads", type=int, help="override the preset's attention heads")
    ap.add_argument("--ref-tokens", type=int, help="override tokens per reference image (a perfect square)")
    ap.add_argument("--max-refs", type=int, help="references served per request (default 4, as vLLM-Omni 0.30 "
                    "for Qwen-Image-Edit-Plus; at most 16)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    ap.add_argument("--dtype", choices=DTYPES, help="compute dtype (default float32 on cpu, bfloat16 on cuda)")
    ap.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                    help="int8: W8A8 linear layers in the blocks (int8 weight storage); fp8: the blocks' "
                         "linear weights stored as float8 e4m3 with a per-output-channel scale")
    ap.add_argument("--cpu-offload", "--enable-layerwise-offload", dest="layerwise", action="store_true",
                    help="blocks' weights live on the host and visit the device one block at a time")
    ap.add_argument("--enable-cpu-offload", dest="module_offload", action="store_true",
                    help="module-level offload: blocks' weights live on the host and move to the device "
                         "together for each request (as vLLM-Omni swaps whole components); layerwise wins "
                         "when both are given")
    ap.add_argument("--init-on-device", action="store_true",
                    help="materialize every parameter, unquantized, on the device before quantization or offload "
                         "(vLLM-Omni 8484d85d's init_parameters): a model larger than the card fails at load "
                         "under every flag set, as the seed's 16 GB card did")
    ap.add_argument("--enforce-eager", action="store_true", help="accepted: this server never compiles")
    ap.add_argument("--omni", action="store_true", help="accepted: this server is always an omni server")
    ap.add_argument("--log-stats", action="store_true",
                    help="export the vllm_omni:* metric families (vllm_omni:peak_memory_mb), as vLLM-Omni")
    ap.add_argument("--api", default=DEFAULT_API, choices=API_GENERATIONS,
                    help=f"which vLLM-Omni generation's HTTP behaviour to imitate (default {DEFAULT_API}: today's, "
                         "stage metrics only when a request asks with return_stage_metrics)")
    ap.add_argument("--oom-reply", choices=("detailed", "mangled"),
                    help="a request OOM's 500: detailed carries the OOM text (0.30), mangled hides it in the "
                         "log (2025-12); default follows --api")
    ap.add_argument("--cond-cache", choices=CACHE_MODES,
                    help="where the per-request conditioning K/V lives (default: device for --arch dit; off for "
                         "qwen-image, whose forward is diffusers' joint attention unchanged)")
    ap.add_argument("--pinned-pool", action=argparse.BooleanOptionalAction, default=True,
                    help="host cond cache: reuse one pinned buffer across requests (default on)")
    ap.add_argument("--vram-gib", type=float,
                    help="device memory cap in GiB (CUDA: real cap; CPU: accounted budget)")
    ap.add_argument("--cap-scope", choices=("whole-device", "allocator"), default="whole-device",
                    help="CUDA: the cap covers the CUDA context and other non-PyTorch memory too "
                         "(whole-device, as a real card) or only PyTorch's allocations (allocator)")
    ap.add_argument("--threads", type=int, help="torch threads (default 1 on cpu)")
    ap.add_argument("--seed-weights", type=int, default=0, help="seed of the random weights (default 0)")
    ap.add_argument("--fault", action="append", default=[], metavar="KIND[@N]",
                    help="inject a fault (repeatable): load-fail, slow-load=SECONDS, jitter=MIN:MAX[:SEED], "
                         "exit@N, hang@N, malformed-json[@N], no-image[@N], wrong-size[@N], transparent[@N], grey[@N]")
    ap.add_argument("--profiler-config", metavar="JSON",
                    help='vLLM-Omni\'s profiler: {"profiler": "torch", "torch_profiler_dir": DIR, '
                         '"torch_profiler_with_memory": true} enables POST /start_profile and /stop_profile, '
                         'which write DIR/<timestamp>_<name>/memory_snapshot_rank0.pickle (PyTorch\'s allocator '
                         'snapshot; on cpu from the accounted ledger); the load and an OOM are snapshotted too')
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_current_spellings(ap)
    return ap


OFFLOAD_MODES = {"module": "module", "layer": "layerwise"}  # --diffusion-offload-config's mode -> ours
COMPONENTS = ("dit", "text_encoder", "vae")  # what vLLM-Omni can offload; the refserver has the DiT only
CACHE_BACKENDS = ("none", "tea_cache", "cache_dit")


def add_current_spellings(ap: argparse.ArgumentParser) -> None:
    """Today's vLLM-Omni memory flags (its entrypoints/cli/serve.py), so a flag set written for the real
    server runs here unchanged; each maps onto this server's mechanisms or is accepted and logged."""
    ap.add_argument("--diffusion-offload-config", type=_json_object, metavar="JSON",
                    help='{"mode": "module"|"layer", "components": [...], "layer_options": {...}}: module = '
                         "--enable-cpu-offload, layer = --enable-layerwise-offload; the refserver's one "
                         "offloadable component is the DiT (its blocks)")
    ap.add_argument("--diffusion-quantization-config", type=_json_object, metavar="JSON",
                    help='{"method": "fp8"|"int8", ...}: as --quantization METHOD (other keys are accepted)')
    ap.add_argument("--diffusion-kv-cache-dtype", help="accepted: the refserver keeps its K/V in --dtype")
    ap.add_argument("--cache-backend", choices=CACHE_BACKENDS,
                    help="accepted: the refserver has no step cache (every step is computed)")
    ap.add_argument("--cache-config", type=_json_object, metavar="JSON", help="accepted with --cache-backend")
    ap.add_argument("--vae-use-slicing", action="store_true", help="accepted: the refserver's VAE is one layer")
    ap.add_argument("--vae-use-tiling", action="store_true", help="accepted: the refserver's VAE is one layer")
    ap.add_argument("--max-num-seqs", type=int, help="accepted: the refserver serves one request at a time "
                                                     "(vLLM-Omni's diffusion stages: 1)")


def not_imitated(args: argparse.Namespace) -> list[str]:
    """The accepted flags of today's vLLM-Omni that change nothing here, as given."""
    given = {"--diffusion-kv-cache-dtype": args.diffusion_kv_cache_dtype,
             "--cache-backend": None if args.cache_backend in (None, "none") else args.cache_backend,
             "--cache-config": args.cache_config, "--vae-use-slicing": args.vae_use_slicing or None,
             "--vae-use-tiling": args.vae_use_tiling or None, "--max-num-seqs": args.max_num_seqs}
    return [flag if value is True else f"{flag} {value}" for flag, value in given.items() if value is not None]


def _json_object(text: str) -> dict[str, object]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, not {type(value).__name__}")
    return value


def offload_of(args: argparse.Namespace) -> str:
    """none | module | layerwise from the flags, the JSON form included (layerwise wins, as upstream)."""
    legacy = "layerwise" if args.layerwise else "module" if args.module_offload else "none"
    cfg = args.diffusion_offload_config
    if cfg is None:
        return legacy
    mode = cfg.get("mode", "module")
    if mode not in OFFLOAD_MODES:
        raise ValueError(f"--diffusion-offload-config: mode {mode!r} is not one of {', '.join(OFFLOAD_MODES)}")
    components = cfg.get("components", list(COMPONENTS))
    if not isinstance(components, list) or not set(components) <= set(COMPONENTS):
        raise ValueError(f"--diffusion-offload-config: components {components!r} must be a list drawn from "
                         f"{', '.join(COMPONENTS)}")
    if "layer_options" in cfg and not isinstance(cfg["layer_options"], dict):
        raise ValueError("--diffusion-offload-config: layer_options must be an object")
    mapped = OFFLOAD_MODES[mode] if "dit" in components else "none"
    return "layerwise" if "layerwise" in (legacy, mapped) else "module" if "module" in (legacy, mapped) else "none"


def quantization_of(args: argparse.Namespace) -> str:
    cfg = args.diffusion_quantization_config
    if cfg is None:
        return str(args.quantization)
    method = cfg.get("method")
    if method not in QUANTIZATIONS or method == "none":
        raise ValueError(f"--diffusion-quantization-config: method {method!r} is not one of "
                         f"{', '.join(q for q in QUANTIZATIONS if q != 'none')}")
    if args.quantization not in ("none", method):
        raise ValueError(f"--quantization {args.quantization} and --diffusion-quantization-config method "
                         f"{method} disagree")
    return str(method)


# Each numeric flag's domain: (attribute, lowest, highest, whether the lowest itself is refused). float() reads
# "nan", "inf" and "1e400" (= inf): a value outside its domain is a usage error here, never a traceback at load
# or a server whose every request fails.
RANGES: dict[str, tuple[str, float, float, bool]] = {
    "--vram-gib": ("vram_gib", 0, 2**20, True),  # at most 1 PiB, the bound of every memory figure the runner keeps
    "--port": ("port", 0, 65535, False),
    "--threads": ("threads", 1, 1024, False),
    "--dim": ("dim", 1, 65536, False),
    "--layers": ("layers", 1, 1024, False),
    "--heads": ("heads", 1, 1024, False),
    "--ref-tokens": ("ref_tokens", 1, 65536, False),
    "--max-num-seqs": ("max_num_seqs", 1, 65536, False),
}


def check_ranges(args: argparse.Namespace) -> None:
    """ValueError naming the first numeric flag whose value is not finite and in its domain (RANGES)."""
    for flag, (attr, lo, hi, lo_refused) in RANGES.items():
        value = getattr(args, attr)
        if value is None:
            continue
        if not (math.isfinite(value) and (value > lo if lo_refused else value >= lo) and value <= hi):
            lowest = f"above {lo:.0f}" if lo_refused else f"from {lo:.0f}"
            raise ValueError(f"{flag} {value!r}: must be a finite number {lowest} to {hi:.0f}")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    check_ranges(args)
    known = QWEN_PRESETS if args.arch == "qwen-image" else PRESETS
    preset_name = args.preset or (args.model_path if args.model_path in known else "tiny")
    preset: Preset | QwenPreset
    if args.arch == "qwen-image":
        if given := [f for f, v in (("--dim", args.dim), ("--heads", args.heads), ("--ref-tokens", args.ref_tokens))
                     if v is not None]:
            raise ValueError(f"{', '.join(given)}: not with --arch qwen-image (its width is the real model's)")
        preset = resolve_qwen_preset(preset_name, args.layers, args.max_refs)
    else:
        preset = resolve_preset(preset_name, args.dim, args.layers, args.ref_tokens, args.heads, args.max_refs)
    offload = offload_of(args)
    device = args.device
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"--device must be cpu or cuda[:N] (got {device!r})")
    dtype = args.dtype or ("float32" if device == "cpu" else "bfloat16")
    if args.profiler_config is not None:
        from runner.refserver.profiler import ProfilerConfig

        ProfilerConfig.parse(args.profiler_config)  # a bad config is a usage error, before the load
    cond_cache = args.cond_cache or ("off" if args.arch == "qwen-image" else "device")  # qwen: diffusers' forward
    oom_reply = args.oom_reply or ("detailed" if args.api in RELEASES else "mangled")
    return ServerConfig(preset=preset, arch=args.arch, device=device, dtype=dtype, quantization=quantization_of(args),
                        offload=offload, cond_cache=cond_cache, vram_gib=args.vram_gib,
                        threads=args.threads, host=args.host, port=args.port,
                        model_name=args.model or args.model_path or "refserver",
                        seed_weights=args.seed_weights, log_level=args.log_level,
                        faults=FaultPlan.parse(args.fault), api=args.api, log_stats=args.log_stats,
                        oom_reply=oom_reply, whole_device=args.cap_scope == "whole-device",
                        pinned_pool=args.pinned_pool, init_on_device=args.init_on_device,
                        profiler=args.profiler_config)


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
    if ignored := not_imitated(args):
        log.info("accepted, not imitated (vLLM-Omni flags this server has no mechanism for): %s", ", ".join(ignored))
    if config.faults.load_fail:
        log.error("fault load-fail: model load failed on purpose; exiting with code %d before binding",
                  EXIT_LOAD_FAIL)
        return EXIT_LOAD_FAIL

    # Heavy imports after argument checks, so usage errors are instant.
    import torch
    import uvicorn

    from runner.refserver.app import create_app
    from runner.refserver.engine import AnyEngine, Engine, configure_torch
    from runner.refserver.memory import as_raised_by_allocator, is_oom

    configure_torch(config)  # sets allocator/cuBLAS environment, so before anything touches CUDA
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        log.error("--device %s requested but CUDA is not available", config.device)
        return EXIT_USAGE
    try:
        if config.arch == "qwen-image":  # diffusers is imported only for this arch
            # scipy is left out by diffusers' own flag (qwen_image/__init__.py), never by hiding the module:
            # where peft is installed, diffusers' loaders import it and peft needs scipy.sparse (an H100 start
            # failed so).
            from runner.refserver.qwen_image.engine import QwenEngine

            engine: AnyEngine = QwenEngine(config)
        else:
            engine = Engine(config)
        engine.warm_up()  # CUDA only: lazily loaded kernels join the context before the cap is fitted
    except Exception as exc:
        if not is_oom(exc):
            raise
        # as vLLM-Omni: an init OOM ends the process unbound, its traceback in the log
        log.error("model load failed: %s", exc, exc_info=as_raised_by_allocator(exc))
        return EXIT_OOM
    log.info(engine.summary())
    if (mib := config.faults.load_host_mib) > 0:
        log.warning("fault load-host-memory: allocating %d MiB of host memory before binding", mib)
        sys.stderr.flush()
        hold_host_memory(mib)
    if config.faults.slow_load_s > 0:
        log.info("fault slow-load: sleeping %.1f s before binding", config.faults.slow_load_s)
        time.sleep(config.faults.slow_load_s)
    app = create_app(engine, config)
    # The model, torch and diffusers live as long as the server: the full collection after every request
    # (app.py) skips them. It walked them all: a quarter (Qwen-Image) to a half (DiT) of a CPU request's
    # time (benchmarks/request_cpu.py).
    gc.freeze()
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_config=None, access_log=False, workers=1,
        log_level=config.log_level, timeout_graceful_shutdown=1,
    ))
    server.run()
    return 0 if server.started else 1
