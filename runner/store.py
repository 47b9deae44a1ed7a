"""The run directory: every record is written atomically the moment it exists, so a kill loses nothing
already measured. A step's path is its resume key.

results/<run-id>/run.json, verdict.json, report.md, plots/
results/<run-id>/<card>/<flags>/session.json, server.log, memory.csv
results/<run-id>/<card>/<flags>/refs-<n>/<fixture>-seed-<s>.json (+ .png)
"""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from runner.errors import UserError
from runner.records import SessionRecord, StepRecord


class Series(Protocol):
    """A memory series as the store writes it (runner.meters.base.Series is one); the store does not pull
    the meters package, and with it httpx, in."""

    source: str
    metric: str
    t: tuple[float, ...]
    value: tuple[int, ...]


class StoreError(UserError):
    """The results folder cannot take a record (disk full, read-only, removed): the run stops; every record
    written before stays as it is (each was written atomically)."""


def inside(root: Path, relative: str) -> Path:
    """root/relative, refused unless it stays inside root: names become paths, and a path built from them
    must never leave the run folder (names are validated at load; this is the last line of defence)."""
    path = root / relative
    base = os.path.abspath(root)
    if os.path.commonpath([base, os.path.abspath(path)]) != base or ".." in Path(relative).parts:
        raise ValueError(f"refusing a record path outside the run folder {root}: {relative!r}")
    return path


def _current_umask() -> int:
    mask = os.umask(0o022)  # read once, at import (before any lane thread exists): umask is process-wide
    os.umask(mask)
    return mask


# One policy for the whole run folder (docs/results.md): the mode an ordinary new file gets under the umask, as
# report.md, the plots and the server logs get it. mkstemp alone would leave the records at 0600.
FILE_MODE = 0o666 & ~_current_umask()


def atomic_write(path: Path, data: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except OSError as exc:
        raise _store_error(path, exc) from None
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise _store_error(path, exc) from None
        raise


def _store_error(path: Path, exc: OSError) -> StoreError:
    return StoreError(f"cannot write {path}: {exc.strerror or exc}; the run stopped there, and every record "
                      f"finished before it is kept")


def write_json(path: Path, doc: Any) -> None:
    atomic_write(path, (json.dumps(doc, indent=2, sort_keys=False) + "\n").encode())


class RunStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def step_path(self, key: str) -> Path:
        return inside(self.root, f"{key}.json")

    def session_dir(self, session_key: str) -> Path:
        return inside(self.root, session_key)

    def write_run(self, doc: dict[str, Any]) -> None:
        write_json(self.root / "run.json", doc)

    def write_step(self, record: StepRecord, png: bytes | None = None) -> None:
        if png is not None:
            atomic_write(inside(self.root, f"{record.key}.png"), png)
        write_json(self.step_path(record.key), record.to_json())

    def write_verdicts(self, verdicts: list[dict[str, Any]]) -> None:
        write_json(self.root / "verdict.json", {"run_id": self.load_run()["run_id"], "verdicts": verdicts})

    def write_profiles(self, doc: dict[str, Any]) -> None:
        """profiles.json beside verdict.json (runner.findings.profiles)."""
        write_json(self.root / "profiles.json", doc)

    def write_session(self, record: SessionRecord) -> None:
        write_json(self.session_dir(record.key) / "session.json", record.to_json())

    def write_memory(self, session_key: str, series: Iterable[Series], attempt: int) -> None:
        """memory.csv: one row per sample (t, attempt, source, metric, bytes) of every server start. The rows
        of `attempt` are replaced by `series`, so a running start can be written again as it grows (a kill
        keeps what was written last) while earlier starts' rows are kept."""
        path = self.session_dir(session_key) / "memory.csv"
        header = "t,attempt,source,metric,bytes\n"
        old = path.read_text().splitlines(keepends=True)[1:] if path.exists() else []
        out = io.StringIO()
        out.write(header)
        out.writelines(line for line in old if line.split(",", 2)[1:2] != [str(attempt)])
        writer = csv.writer(out)
        for s in series:
            for t, v in zip(s.t, s.value, strict=True):
                writer.writerow((f"{t:.4f}", attempt, s.source, s.metric, v))
        atomic_write(path, out.getvalue().encode())

    def load_steps(self) -> list[StepRecord]:
        records = []
        for path in sorted(self.root.glob("*/*/refs-*/*.json")):
            records.append(StepRecord.from_json(json.loads(path.read_text())))
        return records

    def load_sessions(self) -> list[SessionRecord]:
        return [SessionRecord.from_json(json.loads(p.read_text()))
                for p in sorted(self.root.glob("*/*/session.json"))]

    def load_session(self, session_key: str) -> SessionRecord | None:
        path = self.session_dir(session_key) / "session.json"
        return SessionRecord.from_json(json.loads(path.read_text())) if path.exists() else None

    def load_run(self) -> dict[str, Any]:
        return json.loads((self.root / "run.json").read_text())

    def read_png(self, key: str) -> bytes | None:
        path = self.root / f"{key}.png"
        return path.read_bytes() if path.exists() else None


def load_memory(path: Path) -> list[tuple[float, int, str, str, int]]:
    if not path.exists():
        return []
    with path.open() as f:
        return [(float(r["t"]), int(r["attempt"]), r["source"], r["metric"], int(r["bytes"]))
                for r in csv.DictReader(f)]
