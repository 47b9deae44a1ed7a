"""Accounted device memory on the CPU, counted from the model's own tensors.

A TorchDispatchMode sees every op's outputs. A storage first seen as the output of an op that did not take it
as an input is a new allocation of its size; it is freed when PyTorch frees the storage (a weak reference on
the storage object, which PyTorch keeps one-to-one with its storage). Each event goes to AccountedMemory
(budget, peaks, the snapshot history), so past the budget the op that asked raises the allocator's text and its
traceback ends in the library line that called the op, as a CUDA OOM's does. No model code announces anything.

Host memory is what is made while the ledger is paused (`host()`): the host conditioning cache, offloaded
weights.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from runner.refserver.memory import AccountedMemory


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors in an op's arguments or results (tensors, and lists, tuples and dicts of them). PyTorch's
    general tree walk took a quarter of a CPU request's time, run at every op."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


class TensorLedger(TorchDispatchMode):
    def __init__(self, mem: AccountedMemory, handles: dict[int, int] | None = None) -> None:
        super().__init__()
        self.mem = mem
        # id(storage) -> the ledger's handle, while the storage lives. A dispatch mode is per thread: ledgers of
        # several threads that charge one card share this, so a storage one thread made is never charged twice.
        self.handles: dict[int, int] = {} if handles is None else handles

    def _freed(self, key: int) -> None:
        handle = self.handles.pop(key, None)
        if handle is not None:
            self.mem.free(handle)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # Every output is looked at, views too: ops such as reshape and to(dtype) may alias or copy (func.is_view
        # is true for both), and only the storage tells.
        inputs: set[int] | None = None  # the inputs' storages, gathered once and only for a storage not yet seen
        for t in _tensors(out):
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in self.handles:
                continue
            if inputs is None:
                inputs = {id(a.untyped_storage()) for a in _tensors((args, kwargs))}
            if key in inputs:
                continue  # an in-place result (or a view) of something made before the ledger looked
            self.handles[key] = self.mem.alloc(storage.nbytes(), func.__name__)  # past the budget: raises
            weakref.finalize(storage, self._freed, key)
        return out

    @contextmanager
    def host(self) -> Iterator[None]:
        """What is made inside lives in host memory: not counted."""
        with _disable_current_modes():
            yield
