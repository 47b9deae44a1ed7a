"""A test double of vLLM-Omni 0.30.0 running out of memory at load: it prints what the real server printed
(tests/fixtures/vllm-omni-0.30/oom-at-load.log, recorded: the API server's and the in-process diffusion
worker's lines under one pid, the OOM traceback logged under vLLM's record prefix, printed again plain and
under torch's `[rank0]: `, then `RuntimeError: Orchestrator initialization failed: CUDA out of memory…`) and
exits 1 before it listens, as that server did. The recorder's placeholders become install paths: `<venv>` a
virtual environment, the probe's accounting plugin (`<work>/plugin-acct`, which raised the OOM where a GPU's
allocator would) a package installed beside vllm_omni."""

import sys
from pathlib import Path

LOG = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-omni-0.30" / "oom-at-load.log"
text = LOG.read_text()
text = (text.replace("<work>/plugin-acct/", "/venv/lib/python3.11/site-packages/")
        .replace("<venv>", "/venv").replace("<python>", "/usr"))
sys.stdout.write(text)
sys.stdout.flush()
sys.exit(1)
