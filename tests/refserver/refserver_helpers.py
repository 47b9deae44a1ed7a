"""Helpers shared by the reference-server tests: servers as subprocesses, request bodies, PSNR."""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image, ImageDraw

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6  # few steps keep the suite fast; the maths is the same at 50


class Server:
    """One `python -m runner.refserver` subprocess; stderr goes to a log file."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.name, self.args = name, args
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runner.refserver", "--port", str(self.port), *args],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self._log, env=env,
        )
        self._ready = False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ready(self, timeout: float = 300.0) -> Server:
        # Polled, so a ready server costs no wait: the bound is for ten torch imports at once on a loaded machine.
        if self._ready:
            return self
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.name} exited {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    self._ready = True
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"server {self.name} not ready after {timeout}s:\n{self.log()[-3000:]}")

    def wait_exit(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout=timeout)

    def chat(self, body: dict[str, Any], timeout: float = 60.0) -> httpx.Response:
        return httpx.post(self.url + "/v1/chat/completions", json=body, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


# --- request helpers ------------------------------------------------------------------------------
def png_uri(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def make_ref(i: int, size: tuple[int, int] = (160, 120)) -> Image.Image:
    """Distinct, picture-like references: a background and two shapes placed by i."""
    w, h = size
    img = Image.new("RGB", size, (40 * i % 256, 120, (200 - 50 * i) % 256))
    d = ImageDraw.Draw(img)
    d.ellipse((w * (0.1 + 0.1 * i), h * 0.15, w * (0.55 + 0.1 * i), h * 0.85), fill=(250, (200 - 60 * i) % 256, 30))
    d.rectangle((w * 0.6, h * (0.05 + 0.15 * i), w * 0.95, h * (0.45 + 0.15 * i)), fill=(20, 200, (90 + 50 * i) % 256))
    return img


def chat_body(prompt: str = "put the cat from picture 1 on the sofa from picture 2",
              refs: list[Image.Image] | tuple[Image.Image, ...] = (), **extra: Any) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": prompt}]
    content += [{"type": "image_url", "image_url": {"url": png_uri(r)}} for r in refs]
    # a negative prompt, so true CFG runs (vLLM-Omni 0.30 skips it without one)
    # and the stage metrics asked for, as today's vLLM-Omni (the refserver's default --api 0.32) wants
    params = {"num_inference_steps": STEPS, "seed": 2301, "height": 128, "width": 128, "negative_prompt": " ",
              "return_stage_metrics": True, **extra}
    params = {k: v for k, v in params.items() if v is not None}
    return {"model": "refserver", "messages": [{"role": "user", "content": content}], "extra_body": params}


def chat_pngs(resp: httpx.Response) -> list[bytes]:
    assert resp.status_code == 200, resp.text[:500]
    content = resp.json()["choices"][0]["message"]["content"]
    assert isinstance(content, list), content
    out = []
    for part in content:
        assert part["type"] == "image_url"
        url = part["image_url"]["url"]
        assert url.startswith("data:image/png;base64,")
        out.append(base64.b64decode(url.split(",", 1)[1]))
    return out


def peak_mb(resp: httpx.Response) -> float:
    """The response's peak_memory_mb: in the asked-for metrics (0.32), in the image part (0.30 shape) or at the
    top level (2025-12 shape)."""
    body = resp.json()
    if isinstance(body.get("metrics"), dict) and "peak_memory_mb" in body["metrics"]:
        return body["metrics"]["peak_memory_mb"]
    content = body["choices"][0]["message"]["content"]
    if isinstance(content, list) and "peak_memory_mb" in content[0]:
        return content[0]["peak_memory_mb"]
    return body["peak_memory_mb"]


def decode(png: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(png))
    img.load()
    return img


def psnr(a: bytes | Image.Image, b: bytes | Image.Image) -> float:
    x = np.asarray(decode(a) if isinstance(a, bytes) else a, dtype=np.float64)
    y = np.asarray(decode(b) if isinstance(b, bytes) else b, dtype=np.float64)
    assert x.shape == y.shape
    mse = float(np.mean((x - y) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)
