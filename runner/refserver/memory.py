"""Device-memory bookkeeping for the engine.

Two implementations behind one interface:
- `AccountedMemory` (CPU): a ledger of the engine's large device-side allocations (weights, conditioning
  cache, big activations, latents). With a budget it refuses an allocation that would not fit, raising the
  same text PyTorch's CUDA allocator raises, so clients match one string on CPU and on CUDA.
- `CudaMemory` (CUDA): the real allocator is the source of truth (torch.cuda memory stats); the engine's
  ledger calls are no-ops and the cap is torch.cuda.set_per_process_memory_fraction.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

OOM_PREFIX = "CUDA out of memory. Tried to allocate"
# Kept free under a whole-device cap for what a request may add outside PyTorch's allocator before the next
# refit (kernels the CUDA runtime loads lazily the first time a shape needs them).
LAZY_MARGIN = 256 * 2**20


def format_size(n: float) -> str:
    """PyTorch's own size formatting in its OOM message."""
    if n <= 1024:
        return f"{int(n)} bytes"
    if n <= 1024**2:
        return f"{n / 1024:.2f} KiB"
    if n <= 1024**3:
        return f"{n / 1024**2:.2f} MiB"
    return f"{n / 1024**3:.2f} GiB"


class AccountedOutOfMemory(torch.OutOfMemoryError):
    """Raised by the CPU ledger when an allocation would exceed the budget: PyTorch's own exception type, so code
    that catches a CUDA OOM (`except torch.OutOfMemoryError`) catches this one too."""


# The ledger plays the part of PyTorch's native allocator, whose frames a CUDA OOM's traceback never shows
# (the raise happens inside the C++ op the model line called). `as_raised_by_allocator` cuts the ledger's
# own frames (this file, and contextlib's around `hold`) from the end of an OOM's traceback, so it ends at
# the model line that asked for the memory, as a CUDA OOM's does. Every frame left is a real one.
_LEDGER_FILES = (__file__, contextlib.__file__, __file__.replace("memory.py", "ledger.py"))
_LEDGER_SKIP = (*_LEDGER_FILES, __file__.replace("memory.py", "profiler.py"))  # a snapshot's frames, as above


def as_raised_by_allocator(exc: BaseException) -> BaseException:
    entries = []
    tb = exc.__traceback__
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    while len(entries) > 1 and entries[-1].tb_frame.f_code.co_filename in _LEDGER_FILES:
        entries.pop()
    rebuilt: types.TracebackType | None = None
    for entry in reversed(entries):
        rebuilt = types.TracebackType(rebuilt, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return exc.with_traceback(rebuilt)


# What follows the figures in PyTorch's own message (c10/cuda/CUDACachingAllocator.cpp), word for word.
PYTORCH_OOM_ADVICE = (
    "If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to "
    "avoid fragmentation.  See documentation for Memory Management  "
    "(https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)")


def oom_message(request: int, capacity: int, in_use: int, what: str, tail: str | None = None) -> str:
    """PyTorch's OOM text with the ledger's figures; `tail` ends it (default: the reference server's note)."""
    free = max(capacity - in_use, 0)
    return (
        f"{OOM_PREFIX} {format_size(request)}. GPU 0 has a total capacity of {format_size(capacity)} "
        f"of which {format_size(free)} is free. Including non-PyTorch memory, this process has "
        f"{format_size(in_use)} memory in use. Of the allocated memory {format_size(in_use)} is allocated "
        f"by PyTorch, and 0 bytes is reserved by PyTorch but unallocated. "
        + (tail if tail is not None else f"(refserver accounted budget on cpu; allocating {what})")
    )


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, AccountedOutOfMemory | torch.OutOfMemoryError) or OOM_PREFIX in str(exc)


class DeviceMemory:
    """Interface; the base class is also a no-op ledger."""

    capacity: int | None = None

    def alloc(self, nbytes: int, what: str) -> int:
        return 0

    def free(self, handle: int) -> None:
        return None

    @contextmanager
    def hold(self, nbytes: int, what: str) -> Iterator[None]:
        handle = self.alloc(nbytes, what)
        try:
            yield
        finally:
            self.free(handle)

    @contextmanager
    def scope(self) -> Iterator[None]:
        """Frees, on exit, whatever was allocated inside and not freed (the OOM path)."""
        yield

    def keep(self, handle: int) -> None:
        """An allocation made inside a scope that outlives it (a cache kept across requests, a leak)."""

    def current(self) -> int:
        raise NotImplementedError

    def peak(self) -> int:
        """Peak since the last reset_peak()."""
        raise NotImplementedError

    def lifetime_peak(self) -> int:
        raise NotImplementedError

    def reset_peak(self) -> None:
        raise NotImplementedError

    def peak_reserved(self) -> int:
        """Peak of what the allocator held from the device since reset_peak() (the ledger: = peak)."""
        return self.peak()

    def fit_to_device(self) -> None:
        """Make the cap cover the whole device usage (CUDA only)."""

    # The name the allocations inside `labelled()` carry in an allocator snapshot (PyTorch's per-allocation
    # metadata): the engine sets it while it builds a cache it keeps ("conditioning cache"), "" otherwise.
    kv_label = ""

    @contextmanager
    def labelled(self, name: str | None = None) -> Iterator[None]:
        """Allocations inside carry `name` (default: the cache being built, `kv_label`); "" names nothing."""
        label = self.kv_label if name is None else name
        if not label:
            yield
            return
        self._set_label(label)
        try:
            yield
        finally:
            self._set_label("")

    def _set_label(self, name: str) -> None:
        return None


class AccountedMemory(DeviceMemory):
    # The end of the OOM message: None for the reference server's note, PYTORCH_OOM_ADVICE for PyTorch's own.
    oom_tail: str | None = None

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self._lock = threading.RLock()  # a storage's finalizer may free while an alloc holds it
        self._live: dict[int, int] = {}
        self._ids = itertools.count(1)
        self._current = 0
        self._peak = 0
        self._lifetime = 0
        self._scopes: list[set[int]] = []
        self.history: Any = None  # profiler.LedgerHistory while --profiler-config asks for memory
        self.on_oom: Callable[[], None] | None = None  # the profiler's OOM observer

    def alloc(self, nbytes: int, what: str) -> int:
        nbytes = int(nbytes)
        with self._lock:
            if self.capacity is not None and self._current + nbytes > self.capacity:
                failed = AccountedOutOfMemory(oom_message(nbytes, self.capacity, self._current, what, self.oom_tail))
                if self.history is not None:
                    self.history.oom(nbytes, _LEDGER_SKIP)
                    if self.on_oom is not None:
                        self.on_oom()
                raise failed
            handle = next(self._ids)
            if self.history is not None:
                self.history.alloc(handle, nbytes, _LEDGER_SKIP)
            self._live[handle] = nbytes
            self._current += nbytes
            self._peak = max(self._peak, self._current)
            self._lifetime = max(self._lifetime, self._current)
            if self._scopes:
                self._scopes[-1].add(handle)
            return handle

    def free(self, handle: int) -> None:
        with self._lock:
            self._current -= self._live.pop(handle, 0)
            if self.history is not None:
                self.history.free(handle)
            for s in self._scopes:
                s.discard(handle)

    @contextmanager
    def scope(self) -> Iterator[None]:
        with self._lock:
            self._scopes.append(set())
        try:
            yield
        finally:
            with self._lock:
                leftover = self._scopes.pop()
            for handle in leftover:
                self.free(handle)

    def keep(self, handle: int) -> None:
        with self._lock:
            for s in self._scopes:
                s.discard(handle)

    def _set_label(self, name: str) -> None:
        if self.history is not None:
            self.history.metadata = name

    def current(self) -> int:
        return self._current

    def peak(self) -> int:
        return self._peak

    def lifetime_peak(self) -> int:
        return self._lifetime

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = self._current


class CudaMemory(DeviceMemory):
    def __init__(self, device: torch.device, capacity: int | None, whole_device: bool = True) -> None:
        self.device = device
        self.total = torch.cuda.get_device_properties(device).total_memory
        self.whole_device = whole_device and capacity is not None
        self.non_pytorch = 0  # device memory in use outside PyTorch's allocator (CUDA context, cuBLAS, ...)
        self.capacity: int = capacity if capacity is not None else self.total  # always a figure on a card
        self._lifetime = 0
        if capacity is not None:
            # A real cap on PyTorch's caching allocator; fit_to_device() shrinks it by what the CUDA
            # context and other non-PyTorch memory take, as they would on a real card of this size.
            torch.cuda.set_per_process_memory_fraction(min(capacity / self.total, 1.0), device)
            self.fit_to_device()

    def device_used(self) -> int:
        """Whole-device usage (cudaMemGetInfo: total - free). It counts the driver's reserved memory too, which
        NVML's v2 `used` leaves out, so the cap errs small. The runner runs one server per GPU at a time (a
        lane), so everything in use is this process's."""
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def fit_to_device(self) -> None:
        if not self.whole_device:
            return
        cap = self.capacity
        self.non_pytorch = max(0, self.device_used() - torch.cuda.memory_reserved(self.device))
        allowed = max(cap - self.non_pytorch - LAZY_MARGIN, 0)
        torch.cuda.set_per_process_memory_fraction(allowed / self.total, self.device)

    def peak_reserved(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    def _set_label(self, name: str) -> None:
        if hasattr(torch.cuda.memory, "_set_memory_metadata"):  # torch >= 2.9
            torch.cuda.memory._set_memory_metadata(name)

    def current(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        p = torch.cuda.max_memory_allocated(self.device)
        self._lifetime = max(self._lifetime, p)
        return p

    def lifetime_peak(self) -> int:
        return max(self._lifetime, torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        self.peak()  # fold the old window into the lifetime peak first
        torch.cuda.reset_peak_memory_stats(self.device)


def make_device_memory(device: torch.device, capacity: int | None, whole_device: bool = True
                       ) -> DeviceMemory:
    if device.type == "cuda":
        return CudaMemory(device, capacity, whole_device)
    return AccountedMemory(capacity)
