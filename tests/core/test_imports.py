"""Dependencies point one way. Between folders: present → run → (judge, meters → backends → slurm) → plan →
observe → core, the application (cli, app, provision) on top and the reference server on its own; within a
folder, the module rules below. Checked statically (every import, also the lazy ones inside functions) and
at import time. docs/architecture.md says why each folder holds what it holds."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[2] / "runner"

# folder → the folders it imports directly; it may import everything those may import, transitively.
# "" is the application: runner/cli.py, app.py, provision.py, __main__.py.
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "core": (),
    "observe": ("core",),
    "plan": ("observe",),
    "judge": ("plan",),  # pure: records in, a verdict out; never a kind, never the run
    "slurm": ("plan",),
    "backends": ("slurm",),
    "meters": ("backends",),
    "run": ("judge", "meters"),
    "present": ("run",),
    "refserver": (),  # the reference server is a program of its own: it imports nothing of the runner
    "": ("present", "refserver"),
}


def allowed(folder: str) -> set[str]:
    seen, todo = {folder}, list(MAY_IMPORT[folder])
    while todo:
        f = todo.pop()
        if f not in seen:
            seen.add(f)
            todo.extend(MAY_IMPORT[f])
    return seen


def folder_of(module: str) -> str:
    """runner.run.execute → run; runner.cli → "" (the application). The package root holds only the version."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in MAY_IMPORT else ""


# module → what it must never import beyond its folder's rule (prefix match on the dotted name)
FORBIDDEN = {
    "runner.core.vocab": ("runner.", "httpx"),
    "runner.core.registry": ("httpx", "docker"),
    "runner.core.records": ("httpx",),
    "runner.backends.supervisor": ("runner.", "httpx", "psutil"),
    "runner.run.events": ("runner.run.execute", "runner.meters", "httpx"),
    "runner.run.policy": ("runner.run.execute", "runner.backends", "runner.meters", "runner.run.store", "httpx"),
    "runner.run.pending": ("runner.run.execute", "runner.backends", "runner.meters", "runner.run.store", "httpx"),
    "runner.plan.lanes": ("httpx",),
    "runner.run.store": ("runner.meters", "runner.run.execute", "httpx"),
    "runner.run.rescore": ("runner.run.execute",),
    "runner.present.progress": ("runner.run.execute",),
    "runner.present.exporter": ("runner.run.execute",),
    "runner.present.report": ("runner.run.execute", "runner.meters", "runner.backends"),
    "runner.app": ("runner.cli",),
    # the findings' declarations are records: they lean on the core alone
    "runner.judge.findings.models": ("runner.observe", "runner.plan", "runner.judge.verdict",
                                     "runner.judge.findings.build", "runner.judge.findings.memory"),
    # the verdict's declarations: read by the rules and the words, never reading either back
    "runner.judge.decision": ("runner.judge.verdict", "runner.judge.verdict_text"),
    # a step's record from its sends is pure; sending is the one place that talks to the server
    "runner.run.step_records": ("runner.run.execute", "runner.run.sending", "runner.run.store", "runner.meters",
                                "runner.backends", "httpx"),
    "runner.run.sending": ("runner.run.execute", "runner.run.store", "runner.meters"),
    "runner.run.reach": ("runner.run.execute", "runner.run.store", "runner.meters"),
}
# every module of the judge is pure
PURE = ("httpx", "docker", "matplotlib")


def imports_of(source: str, module: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every import anywhere in the source (the runner uses absolute imports only)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module}: relative import"
            base = node.module or ""
            names.append((node.lineno, base))
            names += [(node.lineno, f"{base}.{a.name}") for a in node.names if base.startswith("runner")]
    return names


def module_of(path: Path) -> str:
    return ".".join(("runner", *path.relative_to(RUNNER).with_suffix("").parts)).removesuffix(".__init__")


def folder_violations(files: Iterable[tuple[str, str]]) -> list[str]:
    """Every import of a folder that the importing module's folder may not import, as 'file:line: …'."""
    bad = []
    for module, source in files:
        mine = folder_of(module)
        for line, name in imports_of(source, module):
            if not name.startswith("runner.") or name.split(".")[1] == "__version__":
                continue
            theirs = folder_of(name)
            if theirs not in allowed(mine):
                where = module.replace(".", "/") + ".py"
                bad.append(f"{where}:{line}: imports {name} — {mine or 'the application'} may import "
                           f"{', '.join(sorted(allowed(mine) - {mine})) or 'nothing of the runner'}, "
                           f"never {theirs or 'the application'}")
    return bad


def the_tree() -> list[tuple[str, str]]:
    return [(module_of(p), p.read_text()) for p in sorted(RUNNER.rglob("*.py"))]


def test_every_folder_is_declared() -> None:
    folders = {p.name for p in RUNNER.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(MAY_IMPORT) - {""}


def test_no_folder_imports_one_above_it() -> None:
    assert folder_violations(the_tree()) == []


def test_an_upward_import_is_named() -> None:
    planted = [("runner.core.units", "from runner.present.report import write_report\n"),
               ("runner.judge.verdict", "def f():\n    from runner.run import store\n"),
               ("runner.meters.nvml", "import runner.judge.verdict\n"),
               ("runner.plan.matrix", "from runner.core.errors import UserError\n")]
    assert folder_violations(planted) == [
        "runner/core/units.py:1: imports runner.present.report — core may import nothing of the runner, "
        "never present",
        "runner/core/units.py:1: imports runner.present.report.write_report — core may import nothing of the "
        "runner, never present",
        "runner/judge/verdict.py:2: imports runner.run — judge may import core, observe, plan, never run",
        "runner/judge/verdict.py:2: imports runner.run.store — judge may import core, observe, plan, never run",
        "runner/meters/nvml.py:1: imports runner.judge.verdict — meters may import backends, core, observe, plan, "
        "slurm, never judge",
    ]


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_import_direction_within_folders(module: str) -> None:
    path = RUNNER / (module.split(".", 1)[1].replace(".", "/") + ".py")
    found = {n for _, n in imports_of(path.read_text(), module)}
    bad = sorted(n for n in found for f in FORBIDDEN[module] if n == f.rstrip(".") or n.startswith(f))
    assert not bad, f"{module} imports {bad}"


def test_the_judge_is_pure() -> None:
    for path in (RUNNER / "judge").rglob("*.py"):
        found = {n.split(".")[0] for _, n in imports_of(path.read_text(), module_of(path))}
        assert not found & set(PURE), f"{module_of(path)} imports {sorted(found & set(PURE))}"


def test_nothing_but_the_cli_imports_the_cli_or_the_app() -> None:
    for path in RUNNER.rglob("*.py"):
        module = module_of(path)
        if module in ("runner.cli", "runner.__main__"):
            continue
        found = {n for _, n in imports_of(path.read_text(), module)}
        assert "runner.cli" not in found, module
        assert "runner.app" not in found, module


def test_store_and_pure_modules_load_without_meters_httpx_or_the_executor() -> None:
    code = ("import sys, runner.run.store, runner.plan.lanes, runner.run.policy, runner.run.pending, "
            "runner.judge.verdict, runner.run.events, runner.judge.reconcile, runner.core.registry, "
            "runner.plan.matrix, runner.run.dialects\n"
            "bad = sorted(k for k in sys.modules if k in ('httpx', 'matplotlib', 'torch', 'docker') or "
            "k.startswith(('runner.meters', 'runner.backends', 'runner.run.execute')))\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == ""
