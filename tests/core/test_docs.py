"""The docs say what the code does: the record version docs/results.md names is the one records carry, the
file-mode policy it states is the one the store applies, and docs/architecture.md's tables name every module of
the stages."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

from runner.core.records import SCHEMA_VERSION
from runner.run.store import atomic_write

ROOT = Path(__file__).resolve().parents[2]


def test_results_md_names_the_schema_version_records_carry() -> None:
    text = (ROOT / "docs" / "results.md").read_text()
    found = re.findall(r"carries `schema_version`\s+\((\d+) now", text)
    assert found == [str(SCHEMA_VERSION)], found


def test_architecture_md_names_every_stage_module() -> None:
    """Each module of the stage folders (and of judge/findings/) has its `name.py` in docs/architecture.md: a new
    stage module is described where its neighbours are."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    stages = ("core", "observe", "plan", "judge", "judge/findings", "run", "present")
    modules = [p for d in stages for p in sorted((ROOT / "runner" / d).glob("*.py")) if p.name != "__init__.py"]
    assert len(modules) > 60
    missing = [str(p.relative_to(ROOT)) for p in modules if f"`{p.name}`" not in text]
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_pyproject_names_the_schema_where_it_is() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    for path in re.findall(r"[\w/]+\.schema\.json", text):
        assert (ROOT / path).is_file(), path


def test_records_get_the_mode_of_an_ordinary_file(tmp_path: Path) -> None:
    """One policy for the results folder: a record (atomic write) has the mode report.md and the plots get."""
    atomic_write(tmp_path / "step.json", b"{}\n")
    (tmp_path / "report.md").write_text("x\n")
    record, report = (stat.S_IMODE((tmp_path / n).stat().st_mode) for n in ("step.json", "report.md"))
    assert record == report
    # and under a strict umask both are private: the umask decides, for every file alike
    code = ("import os, stat, pathlib, sys; os.umask(0o077); from runner.run.store import atomic_write; "
            "d = pathlib.Path(sys.argv[1]); atomic_write(d / 'a.json', b'{}'); (d / 'b.md').write_text('x'); "
            "print(oct(stat.S_IMODE((d / 'a.json').stat().st_mode)), oct(stat.S_IMODE((d / 'b.md').stat().st_mode)))")
    strict = tmp_path / "strict"
    strict.mkdir()
    out = subprocess.run([sys.executable, "-c", code, str(strict)], capture_output=True, text=True, timeout=60,
                         check=True, env={**os.environ}).stdout.split()
    assert out == ["0o600", "0o600"]
