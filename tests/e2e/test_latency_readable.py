"""The embedded default's console and report.md, read as a GPU engineer reads them (issue 31): no latency
interval wider than decision.WIDEST (20×), no latency bound or ratio outside [0.001×, 1000×] (decision.SHOWN),
and verdict.json without NaN / Infinity tokens. Reuses the shared run of examples/local.toml (tests/conftest.py)."""

from __future__ import annotations

import json
import re

import pytest

from runner.judge.decision import SHOWN, WIDEST
from tests.conftest import ExampleRun

pytestmark = pytest.mark.slow

NUMBER = r"(\d+(?:\.\d+)?(?:e[+-]?\d+)?)"
RANGE = re.compile(NUMBER + r"\s*[–-]\s*" + NUMBER)
TIMES = re.compile(NUMBER + "×")


def latency_phrases(text: str) -> list[str]:
    """Each stretch of text from "latency" to the end of its clause (";", a table cell's "|", a line's end)."""
    return [m.group(0) for m in re.finditer(r"latency[^;|\n]*", text)]


def unreadable(text: str) -> list[str]:
    """Every latency phrase with an interval wider than WIDEST or a figure outside SHOWN."""
    bad = []
    for phrase in latency_phrases(text):
        for low, high in RANGE.findall(phrase):
            lo, hi = float(low), float(high)
            if lo < SHOWN[0] or hi > SHOWN[1] or hi / lo > WIDEST:
                bad.append(phrase)
        bad += [phrase for x in TIMES.findall(phrase) if not SHOWN[0] <= float(x) <= SHOWN[1]]
    return bad


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
