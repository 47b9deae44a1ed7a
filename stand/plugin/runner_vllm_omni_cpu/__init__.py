"""runner's vLLM-Omni test stand: a CPU platform for the released vLLM-Omni 0.30.0, which has none.

A test stand, not a way to serve: it lets the real server start, load a tiny Qwen-Image pipeline and answer on a
machine without a GPU, so the runner is tested against the server's real API, logs, metrics and failure paths.
Its "device" is an accounted card (card.py): the live tensor bytes of the diffusion worker against a capacity from
the environment, with PyTorch's own OutOfMemoryError past it.

`register` is the entry point vLLM-Omni calls while it resolves its platform (vllm_omni.platforms); it names the
platform class, which is imported only then.
"""

from __future__ import annotations


def register() -> str:
    return "runner_vllm_omni_cpu.platform.CpuStandPlatform"
