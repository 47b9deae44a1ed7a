"""The real-server tier: the runner against the released vLLM-Omni 0.30.0 on the test stand (stand/README.md).

The stand is set up by scripts/omni-stand.sh, which the README's test command runs before pytest. Where it is not
there (the package index was unreachable), these tests are skipped with that reason — unless
RUNNER_REQUIRE_STAND=1 (scripts/test.sh under CI), where a missing stand fails them: CI always runs this tier.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import example_copy
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
STAND = ROOT / ".stand"
VLLM_OMNI = STAND / "venv" / "bin" / "vllm-omni"
EDIT_PLUS = STAND / "models" / "tiny-qwen-image-edit-plus"
TEXT_TO_IMAGE = STAND / "models" / "tiny-qwen-image"
REQUIRED = os.environ.get("RUNNER_REQUIRE_STAND") == "1"
# Where the accounted card's 192 MiB runs out at 3 references (examples/real-omni.toml's cpu-small): the VAE encode
# of a reference in vLLM-Omni 0.30.0's own pipeline, on either backend
OOM_SITE = "vllm_omni/diffusion/models/qwen_image/pipeline_qwen_image_edit_plus.py:511"
BASE_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_COLOR": "0", "HF_HUB_OFFLINE": "1"}
# How long a start of the real server may take here: 16 s on a quiet machine, but at the suite's busiest minutes
# (the examples, both stand fixtures and the Slurm runs at once, on a machine at two thirds of its speed) a local
# start took 104 s and one in a container passed 180 s (2026-12-07). The claims are not about start time.
READY_TIMEOUT_S = 600


def stand_example(folder: Path, verdict: dict[str, str] | None = None, matrix: dict[str, str] | None = None,
                  **run: str) -> Path:
    """examples/real-omni.toml written into FOLDER (tests.conftest.example_copy) with one seed, one send a step
    and the suite's ready timeout, and the given keys."""
    return example_copy("real-omni.toml", folder, verdict, matrix, seeds="[2301]", repeats="1",
                        ready_timeout_s=str(READY_TIMEOUT_S), **run)


def require_stand() -> None:
    if VLLM_OMNI.exists() and (EDIT_PLUS / "model_index.json").exists():
        return
    why = f"the vLLM-Omni test stand is not set up ({STAND} is missing): run scripts/omni-stand.sh (needs PyPI)"
    if REQUIRED:
        pytest.fail(why + "; RUNNER_REQUIRE_STAND=1 requires it")
    pytest.skip(why)


@dataclass
class RealServer:
    """One start of the real server, by the test itself (its own process group, stopped at the end)."""

    port: int
    log: Path
    proc: subprocess.Popen[bytes]

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def start(log: Path, *args: str, env: dict[str, str] | None = None, wait: bool = True,
          timeout_s: float = READY_TIMEOUT_S, model: Path = EDIT_PLUS) -> RealServer:
    require_stand()
    port = free_port()
    argv = [str(VLLM_OMNI), "serve", str(model), "--omni", "--host", "127.0.0.1", "--port", str(port),
            "--enforce-eager", *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **BASE_ENV, **(env or {})}, cwd=ROOT)
    server = RealServer(port, log, proc)
    if wait:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"the real server exited {proc.returncode}:\n{server.text()[-3000:]}")
            try:
                if httpx.get(server.base + "/health", timeout=2).status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        stop(server)
        raise AssertionError(f"the real server was not ready in {timeout_s} s:\n{server.text()[-3000:]}")
    return server


def stop(server: RealServer) -> None:
    if server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGTERM)
        try:
            server.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait(5)
