"""Dependencies point one way: cli → app → execute → (policy, pending, plan, store, backends, meters) →
records. Checked statically (every import, also the lazy ones inside functions) and at import time."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[2] / "runner"

# module → what it must never import (prefix match on the dotted name)
FORBIDDEN = {
    "runner.vocab": ("runner.", "httpx"),
    "runner.registry": ("runner.matrix", "runner.plan", "runner.execute", "runner.app", "runner.cli",
                        "runner.meters", "runner.backends", "runner.store", "httpx", "docker"),
    "runner.reconcile": ("runner.meters", "runner.backends", "runner.execute", "runner.store", "httpx"),
    "runner.backends.supervisor": ("runner.", "httpx", "psutil"),
    "runner.records": ("runner.execute", "runner.app", "runner.cli", "runner.plan", "runner.store",
                       "runner.meters", "runner.backends", "runner.matrix", "httpx"),
    "runner.events": ("runner.execute", "runner.app", "runner.cli", "runner.meters", "httpx"),
    "runner.policy": ("runner.execute", "runner.app", "runner.cli", "runner.backends", "runner.meters",
                      "runner.store", "httpx"),
    "runner.pending": ("runner.execute", "runner.app", "runner.cli", "runner.backends", "runner.meters",
                       "runner.store", "httpx"),
    "runner.plan": ("runner.execute", "runner.app", "runner.cli", "runner.backends", "runner.meters",
                    "runner.store", "httpx"),
    "runner.verdict": ("runner.execute", "runner.app", "runner.cli", "runner.store", "runner.report", "httpx"),
    "runner.store": ("runner.meters", "runner.report", "runner.execute", "runner.app", "httpx"),
    "runner.progress": ("runner.execute", "runner.app"),
    "runner.exporter": ("runner.execute", "runner.app"),
    "runner.report": ("runner.execute", "runner.app", "runner.cli", "runner.meters", "runner.backends"),
    "runner.rescore": ("runner.execute", "runner.app", "runner.cli"),
    "runner.execute": ("runner.app", "runner.cli", "runner.report", "runner.progress", "runner.exporter"),
    "runner.app": ("runner.cli",),
    # the findings and the verdict's words are pure: records in, typed findings and text out
    "runner.findings.models": ("runner.",),
    "runner.findings.oom": ("runner.execute", "runner.app", "runner.cli", "runner.store", "runner.meters",
                            "runner.backends", "runner.verdict", "httpx"),
    "runner.findings.traceback": ("runner.execute", "runner.app", "runner.cli", "runner.store", "runner.meters",
                                  "runner.backends", "runner.verdict", "httpx"),
    "runner.findings.memory": ("runner.execute", "runner.app", "runner.cli", "runner.store", "runner.meters",
                               "runner.backends", "runner.verdict", "httpx"),
    "runner.findings.build": ("runner.execute", "runner.app", "runner.cli", "runner.store", "runner.meters",
                              "runner.backends", "runner.verdict", "httpx"),
    "runner.findings.profiles": ("runner.execute", "runner.app", "runner.cli", "runner.store", "runner.meters",
                                 "runner.backends", "runner.report", "httpx"),
    # the verdict's declarations: read by the rules and the words, never reading either back
    "runner.decision": ("runner.verdict", "runner.execute", "runner.app", "runner.cli", "runner.store",
                        "runner.meters", "runner.backends", "runner.report", "runner.progress", "httpx"),
    "runner.verdict_text": ("runner.execute", "runner.app", "runner.cli", "runner.store", "runner.meters",
                            "runner.backends", "runner.report", "runner.progress", "httpx"),
    # a step's record from its sends is pure; sending is the one place that talks to the server
    "runner.step_records": ("runner.execute", "runner.sending", "runner.app", "runner.cli", "runner.store",
                            "runner.meters", "runner.backends", "httpx"),
    "runner.sending": ("runner.execute", "runner.app", "runner.cli", "runner.store", "runner.meters",
                       "runner.report"),
    "runner.reach": ("runner.execute", "runner.app", "runner.cli", "runner.store", "runner.meters"),
}


def imports_of(path: Path, module: str) -> set[str]:
    """Every module named by an import anywhere in the file (the runner uses absolute imports only)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module}: relative import"
            base = node.module or ""
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names if base == "runner")
    return names


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_import_direction_static(module: str) -> None:
    path = RUNNER / (module.split(".", 1)[1].replace(".", "/") + ".py")
    found = imports_of(path, module)
    bad = sorted(n for n in found for f in FORBIDDEN[module] if n == f.rstrip(".") or n.startswith(f))
    assert not bad, f"{module} imports {bad}"


def test_nothing_but_the_cli_imports_the_cli_or_the_app() -> None:
    for path in RUNNER.rglob("*.py"):
        module = "runner." + ".".join(path.relative_to(RUNNER).with_suffix("").parts)
        if module in ("runner.cli", "runner.__main__"):
            continue
        found = imports_of(path, module)
        assert "runner.cli" not in found or module.startswith("runner.refserver"), module
        assert "runner.app" not in found, module


def test_store_and_pure_modules_load_without_meters_httpx_or_the_executor() -> None:
    code = ("import sys, runner.store, runner.plan, runner.policy, runner.pending, runner.verdict, runner.events, "
            "runner.reconcile, runner.registry, runner.matrix, runner.dialects\n"
            "bad = sorted(k for k in sys.modules if k in ('httpx', 'matplotlib', 'torch', 'docker') or "
            "k.startswith(('runner.meters', 'runner.backends', 'runner.execute')))\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == ""
