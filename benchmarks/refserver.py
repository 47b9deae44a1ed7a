"""Benchmark of the reference server: wall time and peak device memory per request, for 0-4 references
under each conditioning-cache mode (device / host / off). It starts one server per mode itself.

    .venv/bin/python benchmarks/refserver.py --device cpu --preset tiny --steps 20

Peak memory is the server-reported `peak_memory_mb` (CPU: the engine's accounted device memory; CUDA:
torch.cuda.max_memory_allocated during the request). Wall time is the client's, send to response.
`--in-process` drives the engine directly instead (no HTTP; for GPU hosts without fastapi/uvicorn);
its wall time is the engine's.

`--variants 'before=--no-pinned-pool;after='` runs every mode once per variant (extra server flags), side by
side in one run: per cell the wall-time spread (min / median / max of `--repeats`), the server process's
host RSS peak (psutil, 20 Hz: pinned host memory is resident, so it counts) and, when pynvml is importable,
the whole-device NVML `used` peak — e.g. the host conditioning cache with per-request pinning vs the reusable
pinned pool, or `--cap-scope allocator` vs `whole-device` under `--vram-gib 24`.
"""

from __future__ import annotations

import argparse
import base64
import io
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parents[1]
MODES = ("device", "host", "off")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference(i: int) -> str:
    img = Image.new("RGB", (512, 384), (60 * i % 256, 120, 200))
    d = ImageDraw.Draw(img)
    d.ellipse((40 + 30 * i, 60, 300 + 30 * i, 330), fill=(240, 180, 40))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@dataclass
class Sampler:
    """Host RSS of one process (psutil) and whole-device NVML `used`, sampled in a thread; peaks per cell."""

    pid: int
    host: list[int] = field(default_factory=list)
    device: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        import psutil

        self.proc = psutil.Process(self.pid)
        self.nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._pynvml = pynvml
        except Exception:  # no NVML here: device column stays empty
            self.nvml = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self) -> None:
        while not self.stop.wait(0.05):
            try:
                self.host.append(self.proc.memory_info().rss)
                if self.nvml is not None:
                    self.device.append(int(self._pynvml.nvmlDeviceGetMemoryInfo(self.nvml).used))
            except Exception:
                return

    def cut(self) -> tuple[int | None, int | None]:
        """Peaks since the last cut."""
        h, d = self.host, self.device
        self.host, self.device = [], []
        return (max(h) if h else None), (max(d) if d else None)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=2)


def start(args: argparse.Namespace, mode: str, log: Path, extra: str = "") -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "runner.refserver", "--port", str(port), "--device", args.device,
           "--preset", args.preset, "--cond-cache", mode, *shlex.split(args.server_args), *shlex.split(extra)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server ({mode}) exited {proc.returncode}; log: {log}\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"server ({mode}) not ready after {args.ready_timeout}s; log: {log}")


def request(url: str, refs: list[str], args: argparse.Namespace) -> tuple[int, float, float | None]:
    content = [{"type": "text", "text": "put the cat from picture 1 on the sofa from picture 2"}]
    content += [{"type": "image_url", "image_url": {"url": u}} for u in refs]
    extra = {"num_inference_steps": args.steps, "seed": 2301, "true_cfg_scale": args.true_cfg_scale,
             "negative_prompt": " "}  # true CFG runs only with a negative prompt (vLLM-Omni 0.30)
    if args.size:
        extra["size"] = args.size
    body = {"model": "refserver", "messages": [{"role": "user", "content": content}], "extra_body": extra}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=args.request_timeout)
    wall = time.perf_counter() - t0
    peak = None
    if r.status_code == 200:
        body = r.json()
        parts = body["choices"][0]["message"]["content"]
        peak = parts[0].get("peak_memory_mb") if isinstance(parts, list) else None
        peak = body.get("peak_memory_mb") if peak is None else peak  # --api 2025-12 shape
    return r.status_code, wall, peak


def in_process(args: argparse.Namespace, mode: str, counts: list[int], images: list[Image.Image]
               ) -> tuple[dict[int, tuple[int, float, float | None]], str]:
    """The same matrix against runner.refserver.engine in this process (OOM -> status 500)."""
    import gc

    import torch

    sys.path.insert(0, str(ROOT))
    from runner.refserver.cli import build_parser, config_from_args
    from runner.refserver.engine import Engine, GenerationRequest, configure_torch
    from runner.refserver.memory import is_oom
    from runner.refserver.protocol import default_size

    cfg = config_from_args(build_parser().parse_args(
        ["--device", args.device, "--preset", args.preset, "--cond-cache", mode, *shlex.split(args.server_args)]))
    configure_torch(cfg)
    engine = Engine(cfg)
    out: dict[int, tuple[int, float, float | None]] = {}

    def one(n: int) -> tuple[int, float, float | None]:
        size = [int(v) for v in args.size.lower().split("x")] if args.size else default_size(
            cfg.preset, tuple(images[:n]))
        req = GenerationRequest(prompt="put the cat from picture 1 on the sofa from picture 2",
                                references=tuple(images[:n]), width=size[0], height=size[1], steps=args.steps,
                                seed=2301, true_cfg_scale=args.true_cfg_scale, negative_prompt=" ")
        try:
            r = engine.generate(req)
        except Exception as exc:
            if not is_oom(exc):
                raise
            del exc
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return 500, float("nan"), None
        return 200, r.seconds, r.peak_bytes / 2**20

    one(min(1, max(counts)))  # warm-up
    for n in counts:
        runs = [one(n) for _ in range(args.repeats)]
        walls = [r[1] for r in runs if r[0] == 200]
        out[n] = (max(r[0] for r in runs), statistics.median(walls) if walls else float("nan"), runs[0][2])
    summary = engine.summary()
    engine = None  # release its memory before the next mode loads
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out, summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--refs", default="0,1,2,3,4", help="reference counts, comma separated")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per cell (median reported)")
    ap.add_argument("--size", help="output size WxH (default: the first reference's aspect)")
    ap.add_argument("--true-cfg-scale", type=float, default=4.0)
    ap.add_argument("--server-args", default="", help="extra server flags, e.g. '--vram-gib 24'")
    ap.add_argument("--ready-timeout", type=float, default=600)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--in-process", action="store_true", help="drive the engine directly, no HTTP")
    ap.add_argument("--modes", default=",".join(MODES), help="cond-cache modes, comma separated")
    ap.add_argument("--variants", help="'label=server flags;label=server flags': each mode once per variant, "
                                       "with spread, host RSS peak and NVML peak per cell")
    args = ap.parse_args(argv)
    if args.variants:
        return compare_variants(args)
    print("$ " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]), flush=True)
    counts = [int(c) for c in args.refs.split(",")]
    refs = [reference(i) for i in range(max(counts))]
    results: dict[tuple[str, int], tuple[int, float, float | None]] = {}
    logs = Path(tempfile.mkdtemp(prefix="refserver-bench-"))
    for mode in MODES:
        if args.in_process:
            images = [Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))) for u in refs]
            cells, summary = in_process(args, mode, counts, images)
            results.update({(mode, n): v for n, v in cells.items()})
            print(f"# {mode}: {summary}", flush=True)
            continue
        proc, url = start(args, mode, logs / f"{mode}.log")
        try:
            request(url, refs[:1], args)  # warm-up
            for n in counts:
                runs = [request(url, refs[:n], args) for _ in range(args.repeats)]
                status = max(r[0] for r in runs)
                walls = [r[1] for r in runs if r[0] == 200]
                results[(mode, n)] = (status, statistics.median(walls) if walls else float("nan"), runs[0][2])
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        summary = next((ln for ln in (logs / f"{mode}.log").read_text().splitlines() if "loaded:" in ln), "")
        print(f"# {mode}: {summary.split('refserver: ', 1)[-1]}", flush=True)
    print(f"\nper-request wall time (s, median of {args.repeats}) / peak device memory (MiB), "
          f"{args.steps} steps, true_cfg_scale {args.true_cfg_scale}")
    head = "| refs | " + " | ".join(f"{m} s | {m} MiB" for m in MODES) + " |"
    print(head)
    print("|" + "---|" * (1 + 2 * len(MODES)))
    for n in counts:
        cells = []
        for m in MODES:
            status, wall, peak = results[(m, n)]
            cells += [f"{wall:.3f}", f"{peak:.3f}"] if status == 200 else [f"OOM/HTTP {status}", "-"]
        print(f"| {n} | " + " | ".join(cells) + " |")
    if not args.in_process:
        print(f"\nserver logs: {logs}")
    return 0


def compare_variants(args: argparse.Namespace) -> int:
    """Each variant × mode as its own server; figures side by side."""
    print("$ " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]), flush=True)
    variants = [v.partition("=")[::2] for v in args.variants.split(";") if v.strip()]
    modes = args.modes.split(",")
    counts = [int(c) for c in args.refs.split(",")]
    refs = [reference(i) for i in range(max(counts))]
    logs = Path(tempfile.mkdtemp(prefix="refserver-bench-"))
    rows = []
    for label, extra in variants:
        for mode in modes:
            log = logs / f"{label}-{mode}.log"
            proc, url = start(args, mode, log, extra)
            sampler = Sampler(proc.pid)
            try:
                request(url, refs[:1], args)  # warm-up
                sampler.cut()
                for n in counts:
                    runs = [request(url, refs[:n], args) for _ in range(args.repeats)]
                    host, device = sampler.cut()
                    walls = sorted(r[1] for r in runs if r[0] == 200)
                    rows.append((label, mode, n, max(r[0] for r in runs), walls, runs[0][2], host, device))
            finally:
                sampler.close()
                proc.terminate()
                proc.wait(timeout=60)
            loaded = next((ln for ln in log.read_text().splitlines() if "loaded:" in ln), "")
            print(f"# {label} {mode} [{extra}]: {loaded.split('refserver: ', 1)[-1]}", flush=True)
    gib = 2**30
    print(f"\n{args.preset} on {args.device}, {args.steps} steps, {args.repeats} repeats per cell, "
          f"server flags '{args.server_args}'")
    print("| variant | mode | refs | wall min / median / max s | spread (max/min) | server peak MiB | "
          "host RSS peak GiB | NVML used peak GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for label, mode, n, status, walls, peak, host, device in rows:
        if status != 200 or not walls:
            cells = [f"HTTP {status}", "-", "-"]
        else:
            cells = [f"{walls[0]:.2f} / {statistics.median(walls):.2f} / {walls[-1]:.2f}",
                     f"{walls[-1] / walls[0]:.2f}x", f"{peak:.0f}" if peak is not None else "-"]
        cells += [f"{host / gib:.2f}" if host else "-", f"{device / gib:.2f}" if device else "-"]
        print(f"| {label} | {mode} | {n} | " + " | ".join(cells) + " |", flush=True)
    print(f"\nserver logs: {logs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
