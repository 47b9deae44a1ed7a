"""dcgm-exporter's /metrics, scraped directly: whole-device framebuffer memory per GPU (MiB → bytes).

Facts this relies on: the FB fields are DCGM_FI_DEV_FB_USED/FREE/RESERVED in MiB; a GPU is labelled
`gpu` (index), `UUID`, `device`, `modelName`, `pci_bus_id` and `Hostname` (older images) or `hostname`
(newer); MIG instances add `GPU_I_PROFILE`/`GPU_I_ID`. The exporter's default collection interval is
30 s, so a scrape can be that stale: the meter infers the interval from how often the GPU's values change
and warns in its provenance when it is coarser than 1 s.
"""

from __future__ import annotations

import hashlib
import statistics
import threading
import time
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from runner.backends.base import RunningServer
from runner.core.registry import DcgmOptions
from runner.core.units import MIB
from runner.meters.base import Meter, PolledMeter, SourceUnavailable, fetch_text
from runner.observe import bounded
from runner.observe.reading import BadReading, to_bytes
from runner.plan.matrix import Card

FB_FIELDS = {"DCGM_FI_DEV_FB_USED": "used", "DCGM_FI_DEV_FB_FREE": "free", "DCGM_FI_DEV_FB_RESERVED": "reserved"}
COARSE_S = 1.0


@dataclass(frozen=True)
class DcgmGpu:
    """One GPU (or MIG instance) of one scrape."""

    gpu: str | None  # index label
    uuid: str | None
    device: str | None
    model: str | None
    hostname: str | None
    pci_bus_id: str | None
    mig_profile: str | None
    mig_id: str | None
    used: int | None  # bytes; None when missing or not a memory figure (then `bad` says why)
    free: int | None
    reserved: int | None
    digest: str  # hash of every value of this GPU in the scrape: changes once per collection
    timestamp: float | None  # newest explicit sample timestamp, when the exporter writes them
    bad: str | None = None  # why a sent FB figure is no reading (NaN, +Inf, negative, beyond any memory)

    @property
    def key(self) -> tuple[str | None, str | None, str | None, str | None]:
        return (self.hostname, self.uuid, self.gpu, self.mig_id)


def parse(text: str) -> tuple[DcgmGpu, ...]:
    """Every GPU in a dcgm-exporter scrape, grouped on (hostname, UUID, gpu, GPU_I_ID)."""
    groups: dict[tuple, dict[str, Any]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            lab = s.labels
            host = lab.get("Hostname", lab.get("hostname"))
            key = (host, lab.get("UUID"), lab.get("gpu"), lab.get("GPU_I_ID"))
            g = groups.setdefault(key, {"labels": lab, "host": host, "values": [], "ts": None})
            g["values"].append(f"{s.name}={s.value!r}")
            if s.timestamp is not None:
                ts = float(s.timestamp)
                g["ts"] = ts if g["ts"] is None else max(g["ts"], ts)
            if s.name in FB_FIELDS:
                try:
                    g[FB_FIELDS[s.name]] = to_bytes(s.value, f"{s.name} (MiB)", MIB)
                except BadReading as exc:
                    g[FB_FIELDS[s.name]] = None
                    g.setdefault("bad", str(exc))
    out = []
    for g in groups.values():
        if not any(f in g for f in FB_FIELDS.values()):
            continue  # a GPU-less family (exporter info): not a memory source
        lab = g["labels"]
        out.append(DcgmGpu(gpu=lab.get("gpu"), uuid=lab.get("UUID"), device=lab.get("device"),
                           model=lab.get("modelName"), hostname=g["host"], pci_bus_id=lab.get("pci_bus_id"),
                           mig_profile=lab.get("GPU_I_PROFILE"), mig_id=lab.get("GPU_I_ID"),
                           used=g.get("used"), free=g.get("free"), reserved=g.get("reserved"),
                           digest=hashlib.blake2b("\n".join(sorted(g["values"])).encode(), digest_size=8).hexdigest(),
                           timestamp=g["ts"], bad=g.get("bad")))
    return tuple(out)


def select(gpus: tuple[DcgmGpu, ...], want: str | None) -> DcgmGpu:
    """The card's GPU: `UUID`, index, or either followed by `:GPU_I_ID` for a MIG instance."""
    if not gpus:
        raise SourceUnavailable("scrape has no DCGM_FI_DEV_FB_* samples")
    spec, _, mig = (want or "").partition(":")
    if not spec:
        matches = list(gpus)
    elif spec.startswith("GPU-"):
        matches = [g for g in gpus if g.uuid == spec]
    elif spec.isdigit():
        matches = [g for g in gpus if g.gpu == spec]
    else:
        raise SourceUnavailable(f"card.gpu {want!r}: dcgm-exporter labels GPUs by GPU- UUID or index "
                                f"(a MIG- UUID is not among its labels; use '<UUID>:<GPU_I_ID>')")
    if mig:
        matches = [g for g in matches if g.mig_id == mig]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        seen = ", ".join(f"{g.uuid} (gpu {g.gpu}{f', GI {g.mig_id}' if g.mig_id else ''})" for g in gpus)
        raise SourceUnavailable(f"GPU {want!r} is not in the scrape (it has: {seen})")
    which = ", ".join(f"{g.hostname}/{g.uuid}/gpu {g.gpu}" + (f"/GI {g.mig_id} {g.mig_profile}" if g.mig_id else "")
                      for g in matches)
    raise SourceUnavailable(f"GPU {want!r} is ambiguous in the scrape ({which}); name it by UUID, "
                            f"and a MIG instance as '<UUID>:<GPU_I_ID>'")


def infer_interval(change_times: list[float], observed_s: float) -> tuple[float | None, str | None]:
    """The exporter's collection interval from the times its values changed, and a warning when it is
    coarser than 1 s (or cannot be told apart from a GPU whose values did not move)."""
    gaps = [b - a for a, b in pairwise(change_times)]
    if len(gaps) >= 2:
        interval = statistics.median(gaps)
        if interval > COARSE_S:
            return interval, (f"dcgm-exporter values change every ~{interval:.1f} s: peaks shorter than that are "
                              f"lost; run it with -c 100 … -c 1000 (default collection interval is 30 000 ms)")
        return interval, None
    if observed_s >= 3 * COARSE_S:
        return None, (f"dcgm-exporter values changed {len(change_times)} time(s) in {observed_s:.1f} s: its "
                      f"collection interval looks coarser than 1 s (default 30 000 ms; run it with -c 100 … "
                      f"-c 1000)")
    return None, None


class DcgmMeter(PolledMeter):
    def __init__(self, url: str, gpu: str | None, hz: float, interval_s: float | None = None,
                 timeout_s: float = 2.0) -> None:
        super().__init__("dcgm", "device", hz)
        self.url = url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"
        self.gpu_spec = gpu
        self.declared_interval_s = interval_s  # an explicit -c setting, when the card knows it
        self.client = bounded.client(timeout=timeout_s)
        self._chosen: DcgmGpu | None = None
        self._last_digest: str | None = None
        self._changes: list[float] = []
        self._first_read: float | None = None
        self._last_read: float | None = None
        self._reserved: tuple[int, int] | None = None  # min, max seen (older images do not report it)
        self._lk = threading.Lock()

    def read(self) -> int:
        text = fetch_text(self.client, self.url)
        try:
            g = select(parse(text), self.gpu_spec)
        except ValueError as exc:
            raise SourceUnavailable(f"{self.url}: unparsable exposition ({exc})") from None
        if g.used is None:
            raise SourceUnavailable(f"{self.url}: {g.bad or f'DCGM_FI_DEV_FB_USED missing for GPU {g.uuid}'}")
        used, reserved = g.used, g.reserved
        now = time.time()
        with self._lk:
            self._chosen = g
            self._first_read = self._first_read or now
            self._last_read = now
            stamp = g.timestamp if g.timestamp is not None else now
            if g.digest != self._last_digest:
                if self._last_digest is not None:
                    self._changes.append(stamp)
                self._last_digest = g.digest
            if reserved is not None:
                lo, hi = self._reserved or (reserved, reserved)
                self._reserved = (min(lo, reserved), max(hi, reserved))
        return used

    def stop(self) -> None:
        super().stop()
        self.client.close()

    def provenance(self) -> dict[str, Any]:
        out = super().provenance()
        with self._lk:
            g, changes, reserved = self._chosen, list(self._changes), self._reserved
            observed = (self._last_read - self._first_read) if self._first_read and self._last_read else 0.0
        interval, warning = infer_interval(changes, observed)
        if self.declared_interval_s is not None:
            interval = self.declared_interval_s
            warning = None if interval <= COARSE_S else (
                f"dcgm-exporter collection interval is {interval:g} s (declared): peaks shorter are lost")
        out.update({"url": self.url, "gpu_requested": self.gpu_spec,
                    "gpu": None if g is None else {"index": g.gpu, "uuid": g.uuid, "device": g.device,
                                                   "model": g.model, "hostname": g.hostname,
                                                   "pci_bus_id": g.pci_bus_id, "mig_profile": g.mig_profile,
                                                   "mig_id": g.mig_id},
                    "reserved_bytes": None if reserved is None else {"min": reserved[0], "max": reserved[1]},
                    "collection_interval_s": None if interval is None else round(interval, 3),
                    "collection_interval_from": "declared" if self.declared_interval_s is not None else
                    ("timestamps" if g is not None and g.timestamp is not None else "value changes"),
                    "value_changes": len(changes), "warning": warning})
        return out


def build(card: Card, server: RunningServer | None, hz: float) -> Meter:
    """The registry's factory: the card's dcgm-exporter, at most 10 Hz."""
    options = card.meter_options["dcgm"]
    assert isinstance(options, DcgmOptions), "the registry pairs dcgm with DcgmOptions"
    return DcgmMeter(options.dcgm_url, card.gpu, hz)
