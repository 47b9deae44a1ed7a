"""monitoring/: every dashboard query names a metric that dcgm-exporter or the runner really exports, the
dashboard is in Grafana's current schema, and prometheus.yml scrapes both (checked by promtool when it is
installed). That each query draws the run's values is test_dashboard_live.py's (a real Prometheus, a real run)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from meters_support import FIXTURES
from prometheus_client.parser import text_string_to_metric_families

from runner.meters.gpu import ManualSource
from runner.meters.sidecar import Sidecar

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
            "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords, labels,
    strings, durations or dashboard variables."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\$\w+", "", expr)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        rest = expr[m.end():].lstrip()
        if rest.startswith("(") or m.group(0).lower() in KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def exported_names() -> set[str]:
    names: set[str] = set()
    for f in FIXTURES.glob("*.prom"):
        names |= {s.name for fam in text_string_to_metric_families(f.read_text()) for s in fam.samples}
    sidecar = Sidecar(ManualSource(used=1), hz=200).start()
    try:
        text = httpx.get(sidecar.url + "/metrics", timeout=5).text
    finally:
        sidecar.stop()
    names |= {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    names |= runner_exporter_names()
    return names


def runner_exporter_names() -> set[str]:
    """What `runner MATRIX --metrics-port` serves, from a real exporter fed one finished step."""
    from runner.core.records import Peak, Status, StepRecord
    from runner.present.exporter import RunExporter
    from tests.ports import free_port

    port = free_port()
    exporter = RunExporter("r", port)
    try:
        exporter.memory("c", 1)
        exporter.step_done(StepRecord(key="c/f/refs-1/x-seed-1", card="c", flags="f", role="default", fixture="x",
                                      references=1, seed=1, status=Status.OK, wall_s=1.0,
                                      peaks=(Peak(source="nvml", metric="device", bytes=1, samples=1, rate_hz=1.0,
                                                  available=True),)))
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    finally:
        exporter.close()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def queries(dashboard: dict) -> list[str]:
    out = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard.get("templating", {}).get("list", []):
        q = var.get("query")
        out.append(q["query"] if isinstance(q, dict) else q)
    return out


def test_metric_names_parser() -> None:
    assert metric_names('100 * max_over_time(A_B{UUID=~"$gpu"}[5m]) / (C + sum by (gpu) (D))') == {"A_B", "C", "D"}
    assert metric_names("label_values(DCGM_FI_DEV_FB_USED, UUID)") == {"DCGM_FI_DEV_FB_USED", "UUID"}


def test_every_panel_query_names_an_exported_metric() -> None:
    dashboard = json.loads((MONITORING / "grafana-vram-dashboard.json").read_text())
    known = exported_names()
    assert dashboard["panels"], "dashboard has no panels"
    for p in dashboard["panels"]:
        assert p.get("targets"), f"panel {p['title']!r} has no query"
    for expr in queries(dashboard):
        names = metric_names(expr)
        if expr.startswith("label_values("):  # label_values(metric, label): the label is no metric
            names = {expr.split("(", 1)[1].split(",", 1)[0].strip()}
        assert names, f"query names no metric: {expr}"
        assert names <= known, f"{expr}: {sorted(names - known)} exported by neither dcgm-exporter nor the runner"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_prometheus_config_scrapes_dcgm_and_runner() -> None:
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert {"dcgm-exporter", "runner-sidecar", "runner"} <= set(jobs)
    assert jobs["dcgm-exporter"]["scrape_interval"] == "1s"
    for job in jobs.values():  # examples point at this host only
        for sc in job["static_configs"]:
            assert all(t.startswith("127.0.0.1:") for t in sc["targets"])


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is missing (Debian package prometheus)")
def test_promtool_accepts_config() -> None:
    result = subprocess.run(["promtool", "check", "config", str(MONITORING / "prometheus.yml")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


GRAFANA_LATEST_SCHEMA = 42  # LATEST_VERSION of Grafana's apps/dashboard/pkg/migration/schemaversion (2025)


def test_dashboard_is_in_grafanas_current_schema() -> None:
    """schemaVersion is Grafana's latest, and honestly so: nothing in the file is what the migrations since
    the file's former 39 rewrite (v40: a non-string refresh; v41: timepicker.time_options; v42: a hideFrom.viz
    override without tooltip; v43, on Grafana's main: formatTime transformations) — Grafana loads it as is."""
    dashboard = json.loads((MONITORING / "grafana-vram-dashboard.json").read_text())
    assert dashboard["schemaVersion"] == GRAFANA_LATEST_SCHEMA
    assert isinstance(dashboard["refresh"], str)
    assert "time_options" not in dashboard.get("timepicker", {})
    for p in dashboard["panels"]:
        for o in p.get("fieldConfig", {}).get("overrides", []):
            for prop in o.get("properties", []):
                if prop.get("id") == "custom.hideFrom" and prop.get("value", {}).get("viz"):
                    assert prop["value"].get("tooltip"), p["title"]
        assert all(t.get("id") != "formatTime" for t in p.get("transformations", [])), p["title"]
        assert p["type"] in {"stat", "timeseries"}, f"{p['title']}: {p['type']} (no Angular panel types)"


def test_variables_resolve_as_grafana_does() -> None:
    from grafana_vars import TimeRange, resolve, variable_query

    dashboard = json.loads((MONITORING / "grafana-vram-dashboard.json").read_text())
    tr = TimeRange(1000.0, 1600.0)  # 10 min: $__interval 1 s (the data source's min), rate 4 × scrape
    q = 'max_over_time(X{UUID=~"$gpu"}[$__range]) + rate(Y[$__rate_interval]) + Z[${__interval}]'
    assert resolve(q, dashboard, tr, {"gpu": None}) == 'max_over_time(X{UUID=~".*"}[600s]) + rate(Y[4s]) + Z[1s]'
    assert resolve('X{UUID=~"$gpu"}', dashboard, tr, {"gpu": ["GPU-a.b"]}) == r'X{UUID=~"GPU-a\.b"}'
    assert resolve('X{UUID=~"[[gpu]]"}', dashboard, tr, {"gpu": ["a", "b"]}) == 'X{UUID=~"(a|b)"}'
    assert resolve("rate(Y[$__rate_interval])", dashboard, TimeRange(0, 86400.0), {}) == "rate(Y[61s])"
    with pytest.raises(ValueError, match=r"\$gpus is no variable"):
        resolve('X{UUID=~"$gpus"}', dashboard, tr, {})
    for _, target in ((p, t) for p in dashboard["panels"] for t in p["targets"]):  # every query resolves
        assert "$" not in resolve(target["expr"], dashboard, tr, {"gpu": None})
    assert [variable_query(v) for v in dashboard["templating"]["list"]] == [("DCGM_FI_DEV_FB_USED", "UUID")]
