"""dcgm-exporter text in both label styles (Hostname, hostname) and with MIG instances."""

from __future__ import annotations

import pytest
from meters_support import FIXTURES, GPU0_UUID, MIB

from runner.meters.base import SourceUnavailable
from runner.meters.dcgm import infer_interval, parse, select


def test_older_image_Hostname_label() -> None:
    gpus = parse((FIXTURES / "dcgm_h200_Hostname.prom").read_text())
    assert len(gpus) == 2
    g = select(gpus, GPU0_UUID)
    assert (g.gpu, g.device, g.model, g.hostname) == ("0", "nvidia0", "NVIDIA H200", "gpu-node-1")
    assert g.used == 40959 * MIB and g.free == 102197 * MIB and g.reserved == 615 * MIB
    assert g.used + g.free + g.reserved == 143771 * MIB  # the three fields add up to the card
    assert g.mig_id is None and g.pci_bus_id == "00000000:19:00.0"
    assert select(gpus, "1").uuid == "GPU-a27e0d51-6c3b-9f84-1e2d-58b7c0a9e413"
    assert select(gpus, "1").used == 0  # a real idle zero is a reading, not a missing source


def test_newer_image_hostname_label_and_mig() -> None:
    gpus = parse((FIXTURES / "dcgm_h200_mig_hostname.prom").read_text())
    assert {g.hostname for g in gpus} == {"gpu-node-2"}
    assert len(gpus) == 3  # two MIG instances of GPU 0, GPU 1 whole
    with pytest.raises(SourceUnavailable, match="ambiguous"):
        select(gpus, GPU0_UUID)
    with pytest.raises(SourceUnavailable, match="ambiguous"):
        select(gpus, "0")
    gi = select(gpus, f"{GPU0_UUID}:5")
    assert (gi.mig_profile, gi.mig_id, gi.used) == ("2g.35gb", "5", 20480 * MIB)
    assert select(gpus, "0:1").mig_profile == "3g.71gb"
    assert select(gpus, "1").reserved == 615 * MIB


def test_selection_errors_name_what_is_there() -> None:
    gpus = parse((FIXTURES / "dcgm_h200_Hostname.prom").read_text())
    with pytest.raises(SourceUnavailable, match="not in the scrape"):
        select(gpus, "GPU-00000000-dead-beef-0000-000000000000")
    with pytest.raises(SourceUnavailable, match="MIG- UUID"):
        select(gpus, "MIG-1234")
    with pytest.raises(SourceUnavailable, match="no DCGM_FI_DEV_FB"):
        select(parse("# HELP x y\n# TYPE x gauge\nx 1\n"), "0")


def test_values_digest_changes_with_any_value() -> None:
    text = (FIXTURES / "dcgm_h200_Hostname.prom").read_text()
    a = select(parse(text), "0")
    b = select(parse(text.replace("412.337", "413.001")), "0")
    assert a.digest != b.digest and a.used == b.used


def test_explicit_timestamps_are_read() -> None:
    text = ('DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-x",Hostname="h"} 10 1700000000123\n'
            'DCGM_FI_DEV_FB_FREE{gpu="0",UUID="GPU-x",Hostname="h"} 20 1700000000456\n')
    g = parse(text)[0]
    assert g.timestamp == pytest.approx(1700000000.456) and g.used == 10 * MIB


def test_infer_interval() -> None:
    assert infer_interval([0.0, 0.1, 0.2, 0.3], 0.4) == (pytest.approx(0.1), None)
    interval, warning = infer_interval([0.0, 2.0, 4.0, 6.0], 7.0)
    assert interval == pytest.approx(2.0) and "-c 100" in warning
    interval, warning = infer_interval([], 31.0)
    assert interval is None and "coarser than 1 s" in warning
    assert infer_interval([0.5], 1.0) == (None, None)  # too short to tell
