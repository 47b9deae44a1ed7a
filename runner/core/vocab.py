"""The closed vocabularies, each declared once: matrix validation and the records' JSON Schema derive from
these. Kinds that carry an implementation (meters, backends, dialects) are registry entries instead
(runner.core.registry, runner.run.dialects.DIALECTS)."""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    DEFAULT = "default"
    OFFLOAD = "offload"
    QUANTIZATION = "quantization"
    OTHER = "other"


class MemoryMetric(StrEnum):
    DEVICE = "device"  # accelerator memory (VRAM)
    HOST = "host"  # host RAM of the server's processes


def names(vocab: type[StrEnum]) -> tuple[str, ...]:
    return tuple(v.value for v in vocab)
