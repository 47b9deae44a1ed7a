"""vLLM-Omni's memory profiler interface: `--profiler-config '{"profiler": "torch", "torch_profiler_dir": DIR,
"torch_profiler_with_memory": true}'`, POST /start_profile, POST /stop_profile; the snapshot is written to
DIR/<timestamp>_<name>/memory_snapshot_rank0.pickle in PyTorch's own allocator-snapshot format.

As vLLM-Omni's `omni_torch_profiler.py`: recording starts at /start_profile with the history cleared
(`enabled="all", context="all", stacks="python", max_entries=100000, clear_history=True`), so blocks allocated
before it (the weights) carry no frames; /stop_profile dumps the snapshot. Beyond vLLM-Omni, an OOM observer
takes the snapshot at the OOM itself (the state *at* the failure, not after the request freed its
activations), and with the config given at startup the load is recorded too, so a load OOM has a snapshot
(vLLM-Omni's port never opens at a load OOM: its endpoints cannot).

On CUDA these are the real torch calls. On CPU, where there is no CUDA allocator, the accounted ledger
(memory.AccountedMemory) keeps the same history — each accounted allocation's size, state, Python frames,
time and metadata — and writes a snapshot of the same format (one segment per live block, nothing inactive).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: the CLI parses the config before the heavy imports
    import torch

log = logging.getLogger("refserver")

MAX_ENTRIES = 100_000
CACHE_NAME = "conditioning cache"  # the metadata the engine puts on its conditioning cache's allocations
LEAK_NAME = "fault leak"  # … on what `--fault leak` leaves behind
RETAINED_NAME = "retained conditioning cache"  # … on the K/V `--cond-cache retain` keeps across requests
ONLOAD_NAME = "onloaded weights"  # … and on the device copies of offloaded weights (--cpu-offload)


@dataclass(frozen=True)
class ProfilerConfig:
    directory: Path
    with_memory: bool

    @classmethod
    def parse(cls, text: str) -> ProfilerConfig:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--profiler-config is not JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("profiler") != "torch" or not doc.get("torch_profiler_dir"):
            raise ValueError('--profiler-config needs {"profiler": "torch", "torch_profiler_dir": DIR, ...}')
        return cls(Path(str(doc["torch_profiler_dir"])), bool(doc.get("torch_profiler_with_memory", False)))


class LedgerHistory:
    """The CPU ledger's allocation history in PyTorch's snapshot shape (what `_record_memory_history` keeps)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[dict[str, Any]] = []
        self.recording = False
        self.metadata = ""
        self.blocks: dict[int, dict[str, Any]] = {}  # handle → block, for every live allocation
        self._addr = 1 << 32

    @staticmethod
    def frames(skip: tuple[str, ...]) -> list[dict[str, Any]]:
        stack = traceback.extract_stack()[::-1]  # innermost first, as PyTorch's
        return [{"filename": f.filename, "line": f.lineno or 0, "name": f.name}
                for f in stack if f.filename not in skip][:64]

    def alloc(self, handle: int, nbytes: int, skip: tuple[str, ...]) -> None:
        with self.lock:
            addr, self._addr = self._addr, self._addr + max(nbytes, 1)
            frames = self.frames(skip) if self.recording else []
            block = {"address": addr, "size": nbytes, "requested_size": nbytes, "state": "active_allocated",
                     "frames": frames}
            self.blocks[handle] = block
            if self.recording and len(self.events) < MAX_ENTRIES:
                self.events.append({"action": "alloc", "addr": addr, "size": nbytes, "stream": 0,
                                    "time_us": int(time.time() * 1e6), "frames": frames,
                                    "user_metadata": self.metadata, "compile_context": "N/A"})

    def free(self, handle: int) -> None:
        with self.lock:
            block = self.blocks.pop(handle, None)
            if block is not None and self.recording and len(self.events) < MAX_ENTRIES:
                for action in ("free_requested", "free_completed"):
                    self.events.append({"action": action, "addr": block["address"], "size": block["size"],
                                        "stream": 0, "time_us": int(time.time() * 1e6), "frames": [],
                                        "user_metadata": "", "compile_context": "N/A"})

    def oom(self, nbytes: int, skip: tuple[str, ...]) -> None:
        with self.lock:
            if self.recording:
                self.events.append({"action": "oom", "size": nbytes, "stream": 0, "device_free": 0,
                                    "time_us": int(time.time() * 1e6), "frames": self.frames(skip),
                                    "user_metadata": "", "compile_context": "N/A"})

    def start(self) -> None:
        with self.lock:
            self.events = []  # clear_history=True
            self.recording = True

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            segments = [{"device": 0, "address": b["address"], "total_size": b["size"], "allocated_size": b["size"],
                         "active_size": b["size"], "requested_size": b["size"], "stream": 0,
                         "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
                         "frames": b["frames"], "blocks": [dict(b)]} for b in self.blocks.values()]
            return {"segments": segments, "device_traces": [list(self.events)],
                    "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": False,
                                           "refserver": "accounted ledger on cpu"},
                    "external_annotations": []}


class Profiler:
    """/start_profile, /stop_profile and the OOM observer, on CUDA (torch) or on the CPU ledger."""

    def __init__(self, config: ProfilerConfig, device: torch.device, ledger: LedgerHistory | None) -> None:
        self.config, self.device, self.ledger = config, device, ledger
        self.active = False
        self.armed = True  # observe OOMs: during the load, and between /start_profile and /stop_profile
        self.oom_written: Path | None = None
        self.lock = threading.Lock()

    # -- recording ---------------------------------------------------------------------------------------
    def record(self, clear: bool) -> None:
        import torch

        if not self.config.with_memory:
            return
        if self.device.type == "cuda":
            torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                                     max_entries=MAX_ENTRIES, clear_history=clear)
        elif self.ledger is not None:
            if clear:
                self.ledger.start()
            else:
                self.ledger.recording = True

    def record_load(self) -> None:
        """With the config given at startup the load is recorded too (a load OOM then has a snapshot)."""
        self.record(clear=False)
        self.attach_oom_observer()

    def attach_oom_observer(self) -> None:
        import torch

        if self.device.type == "cuda" and self.config.with_memory:
            # private (what torch.cuda.memory._record_memory_history's OOM snapshot uses): torch's stubs omit it
            torch._C._cuda_attach_out_of_memory_observer(self._on_cuda_oom)  # type: ignore[attr-defined]

    def _on_cuda_oom(self, device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        import torch

        if (self.armed or self.active) and self.oom_written is None:
            self.oom_written = self.write(torch.cuda.memory._snapshot(), "oom")

    def on_ledger_oom(self) -> None:
        if (self.armed or self.active) and self.ledger is not None and self.ledger.recording \
                and self.oom_written is None:
            self.oom_written = self.write(self.ledger.snapshot(), "oom")

    def snapshot(self) -> dict[str, Any]:
        import torch

        if self.device.type == "cuda":
            return torch.cuda.memory._snapshot()
        assert self.ledger is not None
        return self.ledger.snapshot()

    def write(self, snap: dict[str, Any], name: str) -> Path:
        folder = self.config.directory / f"{time.strftime('%Y%m%d-%H%M%S')}_{name}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "memory_snapshot_rank0.pickle"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            pickle.dump(snap, f)
        os.replace(tmp, path)
        log.info("memory snapshot written: %s (%d bytes)", path, path.stat().st_size)
        return path

    # -- the endpoints -------------------------------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        with self.lock:
            self.oom_written = None
            self.record(clear=True)
            self.active = True
            log.info("profiler started (memory history %s)", "on" if self.config.with_memory else "off")
            return {"status": "started"}

    def stop(self) -> dict[str, Any]:
        import torch

        with self.lock:
            if not self.active:
                return {"status": "not started"}
            self.active = False
            written = self.oom_written or (self.write(self.snapshot(), "request") if self.config.with_memory else None)
            if self.device.type == "cuda" and self.config.with_memory:
                torch.cuda.memory._record_memory_history(enabled=None)
            elif self.ledger is not None:
                self.ledger.recording = False
            return {"status": "stopped", "memory_snapshot": str(written) if written else None}

