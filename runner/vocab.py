"""The closed vocabularies, each declared once: matrix validation, the records' JSON Schema and the code
that dispatches on them all derive from these. Adding a dialect, backend or meter is one entry here plus its
implementation (dialects.build/parse, backends.create, meters.build_meter)."""

from __future__ import annotations

from enum import StrEnum


class Dialect(StrEnum):
    VLLM_OMNI_CHAT = "vllm-omni-chat"  # chat completions, ordered image_url references, literal extra_body
    OPENAI_IMAGES = "openai-images"  # images/generations (no references)
    OPENAI_IMAGES_EDITS = "openai-images-edits"  # multipart images/edits, one image[] part per reference


class Backend(StrEnum):
    LOCAL = "local"  # a subprocess on this machine
    DOCKER = "docker"  # a container on a local or remote Docker Engine


class MeterName(StrEnum):
    """Memory sources a card can list (`meters`), in the card's order of trust."""

    NVML = "nvml"
    DCGM = "dcgm"
    PROMETHEUS = "prometheus"
    SERVER = "server"
    HOST = "host"
    SIDECAR = "sidecar"


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
