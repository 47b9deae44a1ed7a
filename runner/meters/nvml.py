"""NVML: whole-device memory from the runner's own host, 100 Hz–1 kHz, without ever creating a CUDA context.

Only nvidia-ml-py (module `pynvml`) is used here — no torch, no CUDA runtime — because a stray CUDA context
in the meter's process would itself cost ~0.3–0.7 GB on the measured card. Memory is read with the v2
call (`used` excludes driver-reserved memory; `reserved` is kept as a second series). The per-process list
costs milliseconds, so it is polled at most once a second in its own thread and never delays the memory
samples.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from runner.backends.base import RunningServer
from runner.meters.base import Meter, PolledMeter, SourceUnavailable, UnavailableMeter
from runner.meters.gpu import GpuInfo, GpuProcess, MemorySample
from runner.meters.idle import IdleBaseline, measure_idle
from runner.observe.reading import BadReading
from runner.plan.matrix import Card

_init_lock = threading.Lock()
_init_error: str | None = None
_initialised = False


def _nvml() -> Any:
    """The pynvml module, initialised once per process; SourceUnavailable(reason) when it cannot be."""
    global _init_error, _initialised
    with _init_lock:
        if _initialised:
            import pynvml

            return pynvml
        if _init_error is not None:
            raise SourceUnavailable(_init_error)
        try:
            import pynvml
        except ImportError as exc:
            _init_error = f"NVML unavailable: nvidia-ml-py is not installed ({exc})"
            raise SourceUnavailable(_init_error) from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            # Kept for the process: a machine without a driver does not grow one mid-run.
            _init_error = f"NVML unavailable: {exc} (no NVIDIA driver on this host?)"
            raise SourceUnavailable(_init_error) from None
        _initialised = True
        return pynvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _proc_name(pid: int) -> str | None:
    try:
        import psutil

        return psutil.Process(pid).name()
    except Exception:  # gone, another namespace, or no permission: the PID alone is still evidence
        return None


class NvmlSource:
    """One GPU, chosen by UUID (joined on UUID, since indices are renumbered inside containers) or index."""

    def __init__(self, requested: str | None) -> None:
        nv = _nvml()
        self._nv = nv
        self.requested = requested
        try:
            self.handle = self._resolve(nv, requested)
            self._info = self._read_info(nv)
        except nv.NVMLError as exc:
            raise SourceUnavailable(f"NVML: GPU {requested!r}: {exc}") from None
        self.memory_api = "v2"
        try:
            nv.nvmlDeviceGetMemoryInfo(self.handle, version=nv.nvmlMemory_v2)
        except nv.NVMLError:  # older driver: v1 only, whose `used` includes driver-reserved memory
            self.memory_api = "v1"

    @staticmethod
    def _resolve(nv: Any, requested: str | None) -> Any:
        if requested is None or requested == "":
            count = nv.nvmlDeviceGetCount()
            if count != 1:
                raise SourceUnavailable(f"NVML: card.gpu is not set and this host has {count} GPUs; "
                                        f"name one by UUID or index")
            return nv.nvmlDeviceGetHandleByIndex(0)
        text = requested.strip()
        if text.startswith(("GPU-", "MIG-")):
            return nv.nvmlDeviceGetHandleByUUID(text)
        if text.isdigit():
            return nv.nvmlDeviceGetHandleByIndex(int(text))
        raise SourceUnavailable(f"NVML: card.gpu {requested!r} is neither an index nor a GPU-/MIG- UUID")

    def _read_info(self, nv: Any) -> GpuInfo:
        try:
            index: int | None = nv.nvmlDeviceGetIndex(self.handle)
        except nv.NVMLError:  # MIG device handles have no index of their own
            index = None
        total = nv.nvmlDeviceGetMemoryInfo(self.handle).total
        return GpuInfo(index=index, uuid=_text(nv.nvmlDeviceGetUUID(self.handle)),
                       name=_text(nv.nvmlDeviceGetName(self.handle)),
                       driver=_text(nv.nvmlSystemGetDriverVersion()), total_bytes=int(total),
                       requested=self.requested)

    def info(self) -> GpuInfo:
        return self._info

    def sample(self) -> MemorySample:
        nv = self._nv
        try:
            if self.memory_api == "v2":
                m = nv.nvmlDeviceGetMemoryInfo(self.handle, version=nv.nvmlMemory_v2)
                return MemorySample(time.time(), int(m.used), int(m.reserved), int(m.total))
            m = nv.nvmlDeviceGetMemoryInfo(self.handle)
            return MemorySample(time.time(), int(m.used), None, int(m.total))
        except nv.NVMLError as exc:  # GPU lost, driver reset: the meter records an outage, not a zero
            raise SourceUnavailable(f"NVML memory info: {exc}") from None

    def processes(self) -> tuple[GpuProcess, ...]:
        nv = self._nv
        out: list[GpuProcess] = []
        for kind, call in (("compute", nv.nvmlDeviceGetComputeRunningProcesses),
                           ("graphics", nv.nvmlDeviceGetGraphicsRunningProcesses)):
            try:
                procs = call(self.handle)
            except nv.NVMLError:
                continue
            for p in procs:
                used = p.usedGpuMemory
                out.append(GpuProcess(int(p.pid), None if used is None else int(used), kind, _proc_name(p.pid)))
        return tuple(out)


def _tree(pid: int | None) -> set[int]:
    """The server's process and its descendants (host PIDs), for telling its GPU memory from others'."""
    if not pid:
        return set()
    try:
        import psutil

        root = psutil.Process(pid)
        return {pid, *(c.pid for c in root.children(recursive=True))}
    except Exception:
        return {pid}


class NvmlMeter(PolledMeter):
    compact_series = True  # 1 kHz of mostly flat memory: memory.csv keeps only the steps

    def __init__(self, source: NvmlSource, hz: float, server: Any = None, proc_hz: float = 1.0) -> None:
        self.nvml = source
        self.extra_metrics = ("device_reserved",) if source.memory_api == "v2" else ()
        super().__init__("nvml", "device", hz)
        self.server = server
        self.proc_period = 1.0 / min(proc_hz, 1.0)
        self._procs: dict[int, dict[str, Any]] = {}
        self._proc_thread: threading.Thread | None = None
        self._proc_error: str | None = None

    def read_many(self) -> tuple[int, ...]:
        s = self.nvml.sample()
        if not self.extra_metrics:
            return (s.used,)
        if s.reserved is None:  # a v2 reading always has it; without it the reading is bad, as a None figure was
            raise BadReading("nvml reading: no reserved figure from NVML v2")
        return (s.used, s.reserved)

    def read(self) -> int:
        return self.nvml.sample().used

    def start(self) -> None:
        super().start()
        self._proc_thread = threading.Thread(target=self._proc_loop, name="meter-nvml-procs", daemon=True)
        self._proc_thread.start()

    def _server_pid(self) -> int | None:
        try:
            return (self.server.info() or {}).get("pid") if self.server is not None else None
        except Exception:
            return None

    def _proc_loop(self) -> None:
        while True:
            self.poll_processes()
            if self._stop.wait(self.proc_period):
                return

    def poll_processes(self) -> None:
        try:
            procs = self.nvml.processes()
        except Exception as exc:
            self._proc_error = f"{type(exc).__name__}: {exc}"
            return
        server_pids = _tree(self._server_pid())
        now = time.time()
        with self._lock:
            for p in procs:
                role = "self" if p.pid == os.getpid() else "server" if p.pid in server_pids else "other"
                entry = self._procs.setdefault(p.pid, {"pid": p.pid, "name": p.name, "kind": p.kind,
                                                       "role": role, "first_seen": round(now, 3),
                                                       "max_used_bytes": p.used_bytes})
                entry["last_seen"] = round(now, 3)
                if role != "other":
                    entry["role"] = role
                if p.used_bytes is not None:
                    entry["max_used_bytes"] = max(entry["max_used_bytes"] or 0, p.used_bytes)

    def stop(self) -> None:
        super().stop()
        if self._proc_thread:
            self._proc_thread.join(timeout=5)

    def provenance(self) -> dict[str, Any]:
        out = super().provenance()
        reserved = self._x[0] if self.extra_metrics else None
        with self._lock:
            procs = sorted(self._procs.values(), key=lambda e: e["pid"])
            reserved_range = (min(reserved), max(reserved)) if reserved else None
        out.update({
            "gpu": self.nvml.info().to_json(), "memory_api": self.nvml.memory_api,
            "used_is": "v2 used (excludes driver-reserved)" if self.nvml.memory_api == "v2"
            else "v1 used (includes driver-reserved)",
            "reserved_bytes": None if reserved_range is None else
            {"min": reserved_range[0], "max": reserved_range[1]},
            "processes": procs, "foreign_processes": [p for p in procs if p["role"] == "other"],
            "meter_holds_cuda_context": any(p["role"] == "self" for p in procs),
            "process_poll_s": self.proc_period, "process_error": self._proc_error,
        })
        return out


def open_source(gpu: str | None) -> NvmlSource:
    """NvmlSource for card.gpu; SourceUnavailable(reason) on a host without NVML or without that GPU."""
    return NvmlSource(gpu)


def build(card: Card, server: RunningServer | None, hz: float) -> Meter:
    """The registry's factory (hz clamped to 500 Hz–2 kHz there, so a millisecond spike is caught)."""
    try:
        return NvmlMeter(open_source(card.gpu), hz, server)
    except SourceUnavailable as exc:
        return UnavailableMeter("nvml", "device", str(exc))


def idle(card: Card) -> IdleBaseline:
    """The idle baseline on this host: memory in use and every process holding the GPU."""
    try:
        return measure_idle(open_source(card.gpu), "nvml")
    except SourceUnavailable as exc:
        return IdleBaseline("nvml", False, str(exc))
