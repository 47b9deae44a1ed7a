"""--init-on-device (vLLM-Omni 8484d85d's init_parameters): every parameter, unquantized, on the device before
quantization or offload. A model larger than the card then fails at load under every flag set — offload and
quantization included — as the seed's 16 GB card did; one that fits loads as before. CPU: the accounted budget
(the same error text a CUDA OOM has)."""

from __future__ import annotations

import pytest

from runner.refserver.config import ServerConfig, resolve_preset
from runner.refserver.engine import Engine
from runner.refserver.memory import is_oom

TINY = resolve_preset("tiny", None, None, None)


def full_weights() -> int:
    return Engine(ServerConfig(preset=TINY)).weight_bytes


@pytest.mark.parametrize("flags", [{"offload": "layerwise"}, {"offload": "module"}, {"quantization": "int8"}])
def test_a_model_larger_than_the_card_fails_at_load_under_every_flag_set(flags: dict) -> None:
    budget = full_weights() * 0.8 / 2**30  # the offloaded / quantized resident part fits, the whole model not
    Engine(ServerConfig(preset=TINY, vram_gib=budget, **flags))  # loads without the flag
    with pytest.raises(Exception) as info:
        Engine(ServerConfig(preset=TINY, vram_gib=budget, init_on_device=True, **flags))
    assert is_oom(info.value) and "CUDA out of memory" in str(info.value)
    assert "skeleton" in str(info.value)


def test_a_model_that_fits_loads_as_before() -> None:
    roomy = full_weights() * 1.5 / 2**30
    plain = Engine(ServerConfig(preset=TINY, vram_gib=roomy, offload="layerwise"))
    skeleton = Engine(ServerConfig(preset=TINY, vram_gib=roomy, offload="layerwise", init_on_device=True))
    assert skeleton.device_weight_bytes == plain.device_weight_bytes  # released after init
    assert skeleton.mem.lifetime_peak() >= skeleton.params * skeleton.elem > plain.mem.lifetime_peak()
