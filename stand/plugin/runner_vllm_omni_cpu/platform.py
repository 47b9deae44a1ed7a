"""The CPU platform vLLM-Omni 0.30.0 lacks: vLLM's own CPU platform (gloo, one device) under vLLM-Omni's platform
interface, the SDPA attention backend, and the accounted card's figures behind every memory hook (card.py)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from vllm.platforms import PlatformEnum
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

from runner_vllm_omni_cpu.card import ACCOUNTANT, export_live_gauge

Device = torch.device | int | None


def _cover_worker_threads() -> None:
    """Worker methods run on the engine's busy-loop thread after the first request: count there too."""
    from vllm_omni.diffusion.worker.diffusion_worker import WorkerWrapperBase

    original = WorkerWrapperBase.execute_method
    if getattr(original, "runner_card", False):
        return

    @functools.wraps(original)
    def execute_method(self: Any, method: str | bytes, *args: Any, **kwargs: Any) -> Any:
        ACCOUNTANT.cover_this_thread(f"worker method {method!r}")
        return original(self, method, *args, **kwargs)

    execute_method.runner_card = True  # type: ignore[attr-defined]
    WorkerWrapperBase.execute_method = execute_method  # type: ignore[method-assign]


class CpuStandPlatform(OmniPlatform, CpuPlatform):
    _omni_enum = OmniPlatformEnum.OOT
    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"

    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "cpu (runner's accounted card)"

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        # Called by the diffusion worker's init_device on the thread that then loads and warms up the model.
        ACCOUNTANT.cover_this_thread("set_device")
        _cover_worker_threads()
        export_live_gauge()

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def empty_cache(cls) -> None:
        return None

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def get_diffusion_attn_backend_cls(cls, selected_backend: str | None, head_size: int,
                                       allow_trtllm_default: bool = False) -> str:
        return "runner_vllm_omni_cpu.attention.CpuSDPABackend"

    # The accounted card's figures. vLLM-Omni's `peak_memory_mb` is max_memory_reserved after
    # reset_peak_memory_stats (diffusion_model_runner.py); the ledger has no cache, so reserved = allocated.
    @classmethod
    def memory_allocated(cls, device: Device = None) -> int:
        return ACCOUNTANT.live()

    @classmethod
    def memory_reserved(cls, device: Device = None) -> int:
        return ACCOUNTANT.live()

    @classmethod
    def max_memory_allocated(cls, device: Device = None) -> int:
        return ACCOUNTANT.peak()

    @classmethod
    def max_memory_reserved(cls, device: Device = None) -> int:
        return ACCOUNTANT.peak()

    @classmethod
    def reset_peak_memory_stats(cls, device: Device = None) -> None:
        ACCOUNTANT.reset_peak()

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return ACCOUNTANT.total()

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return max(ACCOUNTANT.total() - ACCOUNTANT.live(), 0)

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        return cls.get_free_memory(device), ACCOUNTANT.total()
