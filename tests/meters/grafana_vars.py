"""A dashboard's queries with its variables resolved the way Grafana resolves them for a Prometheus data
source, so a real Prometheus can answer exactly what a panel would ask.

Grafana's rules, as its Prometheus data source applies them (public/app/plugins/datasource/prometheus):
- a multi-value / include-All variable: "All" becomes its allValue (".*" here); selected values are
  regex-escaped and joined as (a|b) — the dashboard matches them with =~;
- $__range (to − from, in whole seconds, "Ns"), $__range_s, $__range_ms;
- $__interval: range / max data points, rounded as Grafana rounds it (rangeutil.roundInterval), never below
  the data source's min interval (its `timeInterval`, 1s in the role's provisioned data source);
  $__rate_interval = max($__interval + scrape interval, 4 × scrape interval);
- `$name`, `${name}` and `[[name]]` are the same reference.
A reference to a variable the dashboard does not declare stays in the text in Grafana (and fails there as
bad PromQL); here it is an error naming it, so a typo is caught before Prometheus is asked.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_REF = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")
_REGEX_SPECIAL = re.compile(r"([\\^$*+?.()|{}\[\]])")


@dataclass(frozen=True)
class TimeRange:
    start: float  # epoch seconds: the dashboard's `from`
    end: float  # its `to`
    max_data_points: int = 1100  # Grafana's default for a panel about 1100 px wide
    min_interval_s: float = 1.0  # the data source's timeInterval
    scrape_interval_s: float = 1.0

    @property
    def range_s(self) -> int:
        return max(1, round(self.end - self.start))

    @property
    def interval_s(self) -> float:
        return max(self.min_interval_s, round_interval(self.range_s / self.max_data_points))


# Grafana's rangeutil.roundInterval: (upper bound, interval), seconds; beyond the last bound a year.
_ROUNDING = ((0.010, 0.001), (0.015, 0.010), (0.035, 0.020), (0.075, 0.050), (0.150, 0.100), (0.350, 0.200),
             (0.750, 0.500), (1.5, 1), (3.5, 2), (7.5, 5), (12.5, 10), (17.5, 15), (25, 20), (45, 30),
             (90, 60), (210, 120), (450, 300), (750, 600), (1050, 900), (1500, 1200), (2700, 1800),
             (5400, 3600), (8100, 7200), (16200, 10800), (32400, 21600), (86400, 43200), (604800, 86400),
             (1814400, 604800), (3628800, 2592000))


def round_interval(seconds: float) -> float:
    """The raw interval rounded the way Grafana rounds $__interval (78.5 s → 1m)."""
    return next((to for bound, to in _ROUNDING if seconds <= bound), 31536000)


def duration(seconds: float) -> str:
    """Grafana writes intervals in the largest whole unit it can; Prometheus reads any of them."""
    ms = max(1, round(seconds * 1000))
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def builtins(tr: TimeRange) -> dict[str, str]:
    rate = max(tr.interval_s + tr.scrape_interval_s, 4 * tr.scrape_interval_s)
    return {"__range": f"{tr.range_s}s", "__range_s": str(tr.range_s), "__range_ms": str(tr.range_s * 1000),
            "__interval": duration(tr.interval_s), "__interval_ms": str(math.ceil(tr.interval_s * 1000)),
            "__rate_interval": duration(rate)}


def variable_value(var: dict, selected: list[str] | None) -> str:
    """What `var` becomes in a query: None or ["$__all"] is All (allValue, else every value's alternation is
    Grafana's, which the dashboard does not use: it declares allValue)."""
    if selected is None or selected == ["$__all"]:
        if not var.get("includeAll"):
            raise ValueError(f"variable {var['name']!r} has no All option and nothing is selected")
        if "allValue" not in var:
            raise ValueError(f"variable {var['name']!r}: All without an allValue is not resolved here")
        return str(var["allValue"])
    escaped = [_REGEX_SPECIAL.sub(r"\\\1", v) for v in selected]
    if len(escaped) == 1:
        return escaped[0]
    return "(" + "|".join(escaped) + ")"


def resolve(expr: str, dashboard: dict, tr: TimeRange, selected: dict[str, list[str] | None]) -> str:
    """`expr` as Grafana sends it to Prometheus for `tr` with the `selected` variable values."""
    values = builtins(tr)
    for var in dashboard.get("templating", {}).get("list", []):
        values[var["name"]] = variable_value(var, selected.get(var["name"]))

    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in values:
            raise ValueError(f"{expr!r}: ${name} is no variable of the dashboard nor a Grafana built-in")
        return values[name]

    return _REF.sub(one, expr)


def variable_query(var: dict) -> tuple[str, str]:
    """label_values(METRIC, LABEL) → (METRIC, LABEL): Grafana asks /api/v1/label/LABEL/values?match[]=METRIC."""
    q = var.get("query")
    text = q["query"] if isinstance(q, dict) else str(q)
    m = re.fullmatch(r"\s*label_values\(\s*(.+?)\s*,\s*(\w+)\s*\)\s*", text)
    if not m:
        raise ValueError(f"variable {var['name']!r}: only label_values(metric, label) is resolved here: {text!r}")
    return m.group(1), m.group(2)
