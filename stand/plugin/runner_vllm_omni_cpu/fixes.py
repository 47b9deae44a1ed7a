"""Import fixes for PyPI's CUDA-only torchvision beside a CPU torch, installed at interpreter start by the stand's
`.pth` file (scripts/omni-stand.sh): a finder that waits for `import torchvision` and, just before it, defines the
two operators torchvision's meta registrations expect its compiled library to have registered (`nms`, `qnms`).
transformers' Qwen2-VL image processor imports torchvision unconditionally; nothing the stand runs calls them.
(torchaudio needs no hook: the setup removes its CUDA libraries, and its Python side then imports.)"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
from typing import Any

_LIBS: list[Any] = []  # the operator definitions live as long as their Library object


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if name == "torchvision":
            sys.meta_path.remove(self)
            import torch

            lib = torch.library.Library("torchvision", "FRAGMENT")
            for op in ("nms", "qnms"):
                with contextlib.suppress(RuntimeError):  # already there: a torchvision whose library did load
                    lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _LIBS.append(lib)
        return None


def install() -> None:
    if not any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())
