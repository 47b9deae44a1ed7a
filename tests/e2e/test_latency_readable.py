"""The embedded default's console and report.md, read as a GPU engineer reads them (issue 31): no latency
interval wider than decision.WIDEST (20×), no latency bound or ratio outside [0.001×, 1000×] (decision.SHOWN),
and verdict.json without NaN / Infinity tokens. Reuses the shared run of examples/local.toml (tests/conftest.py)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ExampleRun
from tests.core.test_latency_words import unreadable

pytestmark = pytest.mark.slow

def test_the_checker_catches_what_main_printed() -> None:
    # Issue 31's console line on main (213f931), and a readable one.
    assert unreadable("cpu-roomy: fits-resident (default) — … cond-host latency 0.00–360797587865506.31× "
                      "straddles 3; cpu-offload latency 0.00–8472542092595952.00× straddles 3")
    assert unreadable("latency ratio 1.20 [0.00–360797587865506.31] vs default")
    assert not unreadable("cond-host serves 4 refs, latency 1.20× (geometric means, paired by seed) [0.95–1.52]; "
                          "wall 2.86 s/request [2.23–3.10]")


def test_console_and_report_print_no_interval_that_says_nothing(local_example: ExampleRun) -> None:
    console = local_example.proc.stdout
    report = (local_example.run_dir / "report.md").read_text()
    assert "latency" in console and "latency" in report
    assert unreadable(console) == [] and unreadable(report) == []
    assert "rerun with more repeats" not in console + report  # auto: more sends are the runner's to make


def test_verdict_json_holds_no_nan_or_infinity(local_example: ExampleRun) -> None:
    def refuse(token: str) -> None:
        raise AssertionError(f"verdict.json holds {token}")

    for name in ("verdict.json", "profiles.json"):
        json.loads((local_example.run_dir / name).read_text(), parse_constant=refuse)
