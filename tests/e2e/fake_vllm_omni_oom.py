"""A vLLM-Omni-shaped test double that runs out of memory at load: it prints what vLLM-Omni's engine
process prints for an init OOM — worker-prefixed log lines and a traceback under `vllm_omni/…`, interleaved
with another process's lines (tests/core/fixtures/oom/vllm-omni-wheel.log: real torch/diffusers frames and
OOM text) — and exits 1 before it listens, as vLLM-Omni does."""

import sys
from pathlib import Path

LOG = Path(__file__).resolve().parents[1] / "core" / "fixtures" / "oom" / "vllm-omni-wheel.log"
sys.stdout.write("(APIServer pid=4240) INFO 12-01 10:00:00 [api_server.py:1100] vLLM-Omni API server starting\n")
sys.stdout.write(LOG.read_text())
sys.stdout.flush()
sys.exit(1)
