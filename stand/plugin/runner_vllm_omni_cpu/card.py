"""The accounted card: the diffusion worker's live tensor bytes against a capacity, counted as the reference server
counts its own (runner.refserver.ledger: a storage an op makes is charged until PyTorch frees it).

    RUNNER_CARD_VRAM_GIB=X      the card's capacity (unset: no capacity; the host's RAM is reported as its size)
    RUNNER_CARD_ACCOUNTING=0    no counting: every memory hook answers 0, as a platform without figures would

Where it counts. With one device vLLM-Omni runs its diffusion worker inside the API server's process (the uniproc
executor) on two threads: `orchestrator` sets the device, loads the weights, warms up and pre-processes each
request; the busy loop, started by the first request, runs every forward. A TorchDispatchMode is per thread, so a
ledger is pushed for good on the thread that sets the device and on each other thread the first time it runs a
worker method; all of them charge one AccountedMemory. The orchestrator's ledger also charges what a request's
pre-processing makes (its decoded references): host memory on a GPU, counted here, and left live until the next
request replaces it (the server's own code holds them).

What it cannot tell apart. Offload moves tensors between the device and the host; on this platform both are the
CPU, the offloader's move check (`p.data.device != target_device`) never moves a tensor, so `--enable-cpu-offload`
and layerwise offload leave the figure unchanged.

What it exports. `runner_card_allocated_bytes`, a gauge on the server's own /metrics (vLLM's default Prometheus
registry, which its /metrics serves in one process): the live bytes now, read at each scrape. A GPU has no such
figure outside the process (NVML counts the allocator's cache too); here it is what the runner's server meter reads
as an exact level between requests, as it reads the reference server's `refserver_device_memory_bytes`.

Past the capacity the op that asked raises torch.OutOfMemoryError with PyTorch's own text, inside vLLM-Omni's code,
so the server fails the request (or its start) through its own paths. Each raise is also logged with the op, the
thread and the innermost vLLM-Omni frame: some callers swallow the exception (safetensors while it loads weights).
"""

from __future__ import annotations

import logging
import os
import threading
import traceback

import psutil
import torch

from runner.refserver.ledger import TensorLedger
from runner.refserver.memory import PYTORCH_OOM_ADVICE, AccountedMemory, AccountedOutOfMemory

# vLLM's log configuration shows the loggers under `vllm_omni.` and `vllm.` only.
log = logging.getLogger("vllm_omni.platforms.runner_cpu")

CAPACITY_ENV = "RUNNER_CARD_VRAM_GIB"
ACCOUNTING_ENV = "RUNNER_CARD_ACCOUNTING"


def capacity_from_env() -> int | None:
    text = os.environ.get(CAPACITY_ENV, "").strip()
    if not text:
        return None
    try:
        gib = float(text)
    except ValueError:
        raise SystemExit(f"{CAPACITY_ENV}={text!r}: not a number of GiB") from None
    if not 0 < gib < 2**20:
        raise SystemExit(f"{CAPACITY_ENV}={text!r}: not a capacity (0 < GiB < 1 Pi)")
    return int(gib * 2**30)


def innermost_server_frame() -> str:
    for frame in reversed(traceback.extract_stack()):
        if "/vllm_omni/" in frame.filename:
            return f"vllm_omni/{frame.filename.rpartition('/vllm_omni/')[2]}:{frame.lineno} in {frame.name}"
    return "none"


class Card(AccountedMemory):
    oom_tail = PYTORCH_OOM_ADVICE

    def alloc(self, nbytes: int, what: str) -> int:
        try:
            return super().alloc(nbytes, what)
        except AccountedOutOfMemory as oom:
            log.warning("accounted card: torch.OutOfMemoryError at op %s on thread %r (innermost vllm_omni frame: "
                        "%s): %s", what, threading.current_thread().name, innermost_server_frame(), oom)
            # PyTorch's own class, as a CUDA allocator raises it: the server's log names `torch.OutOfMemoryError`
            raise torch.OutOfMemoryError(str(oom)) from None


class Accountant:
    """The card and the ledgers that charge it, one per thread."""

    def __init__(self) -> None:
        self.enabled = os.environ.get(ACCOUNTING_ENV, "1") != "0"
        self.card = Card(capacity_from_env())
        self._handles: dict[int, int] = {}
        self._local = threading.local()

    def cover_this_thread(self, why: str) -> None:
        """Push a ledger on the calling thread for the rest of its life (once per thread)."""
        if not self.enabled or getattr(self._local, "ledger", None) is not None:
            return
        ledger = TensorLedger(self.card, self._handles)
        ledger.__enter__()
        self._local.ledger = ledger
        log.info("accounted card: counting on thread %r (%s); live %.2f MiB, capacity %s",
                 threading.current_thread().name, why, self.card.current() / 2**20, self.capacity_text())

    def capacity_text(self) -> str:
        cap = self.card.capacity
        return "none" if cap is None else f"{cap / 2**20:.2f} MiB"

    def total(self) -> int:
        return self.card.capacity if self.card.capacity is not None else psutil.virtual_memory().total

    def live(self) -> int:
        return self.card.current() if self.enabled else 0

    def peak(self) -> int:
        return self.card.peak() if self.enabled else 0

    def reset_peak(self) -> None:
        self.card.reset_peak()


ACCOUNTANT = Accountant()
LIVE_GAUGE = "runner_card_allocated_bytes"


def export_live_gauge() -> None:
    """The card's live bytes on the server's /metrics, read at each scrape (once per process)."""
    from prometheus_client import REGISTRY, Gauge

    if not ACCOUNTANT.enabled or LIVE_GAUGE in getattr(REGISTRY, "_names_to_collectors", {}):
        return
    Gauge(LIVE_GAUGE, "the accounted card's live tensor bytes now (runner's test stand)").set_function(
        ACCOUNTANT.live)
