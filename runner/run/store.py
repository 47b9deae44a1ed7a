"""The run directory: every record is written atomically the moment it exists, so a kill loses nothing
already measured. A step's path is its resume key.

results/<run-id>/run.json, verdict.json, report.md, plots/
results/<run-id>/<card>/<flags>/session.json, server.log, memory.csv
results/<run-id>/<card>/<flags>/refs-<n>/<fixture>-seed-<s>.json (+ .png)
results/<run-id>/<card>/<flags>/soak/soak.json, requests.jsonl (one line per request), server.<n>.log, memory.csv
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from runner.core.errors import UserError
from runner.core.records import (
    SCHEMA_VERSION,
    DiagnosisRecord,
    Record,
    RecordError,
    SessionRecord,
    SoakRecord,
    SoakRequest,
    StepRecord,
    load,
)
from runner.observe.server_file import NotRead, open_regular, read_regular

R = TypeVar("R", bound=Record)


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


NEW_FOLDER_TRIES = 100  # <id>, <id>-2 … <id>-100: runs of one name started in one second, on one results folder


def new_run_folder(parent: Path, name: str) -> Path:
    """A new run's folder, made exclusively: `parent/name`, or `name-2`, `name-3`… when that exists. Two runs of
    one name started in the same second each get their own, and a new run never writes into a folder that is
    there already (another matrix's run.json and records). A folder that cannot be made is one line."""
    try:
        parent.mkdir(parents=True, exist_ok=True)
        for n in range(1, NEW_FOLDER_TRIES + 1):
            folder = parent / (name if n == 1 else f"{name}-{n}")
            try:
                folder.mkdir()
                return folder
            except FileExistsError:
                continue
    except OSError as exc:
        raise UserError(f"cannot make the run folder {parent / name}: {exc.strerror or exc}") from None
    raise UserError(f"cannot make the run folder {parent / name}: it and {NEW_FOLDER_TRIES - 1} suffixed ones "
                    "exist already")


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


def write_output(path: Path, text: str) -> None:
    """A file a side command was asked to write (`compare --out`, `schema --out`): written beside its name and
    renamed over it (a symlink planted there is replaced, never written through); its folder must exist; a
    failure is one line."""
    if not path.parent.is_dir():
        raise UserError(f"cannot write {path}: no folder {path.parent}")
    if path.is_dir():
        raise UserError(f"cannot write {path}: it is a folder")
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None


def _store_error(path: Path, exc: OSError) -> StoreError:
    return StoreError(f"cannot write {path}: {exc.strerror or exc}; the run stopped there, and every record "
                      f"finished before it is kept")


def write_json(path: Path, doc: Any) -> None:
    atomic_write(path, (json.dumps(doc, indent=2, sort_keys=False) + "\n").encode())


class BadRecord(ValueError):
    """A file where a record should be that is not one (empty, truncated, not JSON, wrong shape)."""


class _NotARecordValue(ValueError):
    pass


RECORD_INT_DIGITS = 20  # every count, byte figure and epoch of a record fits; 10**400 is an edit, not a figure


def _record_int(text: str) -> int:
    if len(text.lstrip("-")) > RECORD_INT_DIGITS:
        raise _NotARecordValue(f"a number of {len(text.lstrip('-'))} digits: no record holds one")
    return int(text)


def _no_constant(text: str) -> float:
    raise _NotARecordValue(f"{text}: not a JSON number (no record holds one)")


RECORD_MAX_BYTES = 64 * 2**20  # the largest record file read (a long session's session.json is well under 1 MiB)
PNG_MAX_BYTES = 1024 * 2**20  # the largest step image read back (what a server sent, under the response cap)


def read_record(path: Path) -> dict[str, Any]:
    """A record file's JSON object, or BadRecord saying in words what is wrong with it (a FIFO or a folder where
    the record should be is not waited on: runner.observe.server_file)."""
    try:
        data = read_regular(path, RECORD_MAX_BYTES)
    except NotRead as exc:
        raise BadRecord(f"cannot read it: {exc}") from None
    if not data.strip():
        raise BadRecord(f"empty ({len(data)} bytes)")
    try:
        doc = json.loads(data, parse_int=_record_int, parse_constant=_no_constant)
    except _NotARecordValue as exc:
        raise BadRecord(str(exc)) from None
    except RecursionError:  # an edited file nested thousands deep: json's parser recurses
        raise BadRecord(f"nested too deep to be a record ({len(data)} bytes)") from None
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise BadRecord(f"not valid JSON ({getattr(exc, 'msg', exc)}; {len(data)} bytes, truncated?)") from None
    if not isinstance(doc, dict):
        raise BadRecord(f"not a JSON object (a {type(doc).__name__})")
    return doc


SOAK_FOLDER = "soak"
SOAK_REQUESTS = "requests.jsonl"


class RunStore:
    """Reads skip a file that is not a readable record, with one warning line naming it (once per file): one
    bad file must not make a run unresumable or unreportable. A step that was skipped is simply pending again
    (a resume writes it anew, the unreadable file kept beside as `<name>.json.skipped`); a step record counts
    only where its key matches its path, so a copied file (`… (copy).json`) is never counted twice."""

    def __init__(self, root: Path, warn: Any = None) -> None:
        self.root = root
        self._warn = warn or (lambda line: print(line, file=sys.stderr))
        self._warned: set[str] = set()
        self._unreadable: set[Path] = set()  # skipped files: a step written anew keeps them beside, never over
        self._memory_t: dict[tuple[str, int], dict[tuple[str, str], float]] = {}  # last t written per series
        self._appending: set[Path] = set()  # request files this store appended to (their last line is whole)

    def skipped(self, path: Path, why: str) -> None:
        self._unreadable.add(path)
        line = f"runner: warning: skipping {path}: {why}"
        if line not in self._warned:
            self._warned.add(line)
            self._warn(line)

    def _load(self, path: Path, model: type[R]) -> R | None:
        """The record in `path`, migrated to the current form (runner.core.records.load), or None after one line
        naming the file and what is wrong (`field: value: problem`)."""
        try:
            return load(model, read_record(path))
        except BadRecord as exc:
            self.skipped(path, str(exc))
        except RecordError as exc:
            self.skipped(path, f"not a record of this runner: {str(exc)[:300]}")
        return None

    def step_path(self, key: str) -> Path:
        return inside(self.root, f"{key}.json")

    def session_dir(self, session_key: str) -> Path:
        return inside(self.root, session_key)

    def write_run(self, doc: dict[str, Any]) -> None:
        write_json(self.root / "run.json", doc)

    def write_step(self, record: StepRecord, png: bytes | None = None) -> None:
        path = self.step_path(record.key)
        if path in self._unreadable and path.exists():  # a hand-edited file: the user's bytes are not ours to drop
            kept = path.with_name(path.name + ".skipped")
            path.replace(kept)
            self._unreadable.discard(path)
            self._warn(f"runner: warning: {path} was not a readable record: kept as {kept.name}, the step sent again")
        if png is not None:
            atomic_write(inside(self.root, f"{record.key}.png"), png)
        write_json(path, record.model_dump(mode="json"))

    def write_verdicts(self, verdicts: list[dict[str, Any]]) -> None:
        write_json(self.root / "verdict.json", {"run_id": self.load_run()["run_id"], "verdicts": verdicts})

    def write_profiles(self, doc: dict[str, Any]) -> None:
        """profiles.json beside verdict.json (runner.judge.findings.profiles)."""
        write_json(self.root / "profiles.json", doc)

    def write_session(self, record: SessionRecord) -> None:
        write_json(self.session_dir(record.key) / "session.json", record.model_dump(mode="json"))

    def write_memory(self, session_key: str, series: Iterable[Series], attempt: int) -> None:
        """memory.csv: one row per sample (t, attempt, source, metric, bytes) of every server start. The first
        write of an attempt replaces that attempt's rows (earlier starts' rows are kept); later writes of a
        running start append only the samples newer than the last written one of each series, so a 4-hour
        session is never rewritten whole every flush. A kill mid-append leaves at most one partial last line,
        which readers skip."""
        path = self.session_dir(session_key) / "memory.csv"
        done = self._memory_t.get((session_key, attempt))
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        last: dict[tuple[str, str], float] = dict(done or {})
        for s in series:
            newer = last.get((s.source, s.metric), float("-inf"))
            for t, v in zip(s.t, s.value, strict=True):
                if t > newer:
                    writer.writerow((f"{t:.4f}", attempt, s.source, s.metric, v))
            if s.t:
                last[(s.source, s.metric)] = max(newer, s.t[-1])
        if done is None:
            header = "t,attempt,source,metric,bytes\n"
            old = self._memory_lines(path)[1:]
            kept = [line for line in old if line.endswith("\n") and line.split(",", 2)[1:2] != [str(attempt)]]
            atomic_write(path, (header + "".join(kept) + out.getvalue()).encode())
        elif out.tell():
            try:
                with path.open("a") as f:
                    f.write(out.getvalue())
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as exc:
                raise _store_error(path, exc) from None
        self._memory_t[(session_key, attempt)] = last

    def _memory_lines(self, path: Path) -> list[str]:
        """memory.csv's lines as they are (none when there is no file, or after one line when what stands there
        is not a regular file: the new one replaces it)."""
        if not path.exists():
            return []
        try:
            with open_regular(path) as f:
                return f.read().decode(errors="replace").splitlines(keepends=True)
        except NotRead as exc:
            self.skipped(path, f"cannot read it: {exc}; its samples are written anew")
            return []

    def load_steps(self) -> list[StepRecord]:
        records = []
        for path in sorted(self.root.glob("*/*/refs-*/*.json")):
            record = self._load(path, StepRecord)
            if record is None:
                continue
            relative = path.relative_to(self.root).with_suffix("").as_posix()
            if record.key != relative:
                self.skipped(path, f"its key {record.key!r} is not its path (a copy?); not counted")
                continue
            records.append(record)
        return records

    def newer_records(self) -> list[Path]:
        """Step and session records a newer runner wrote (schema_version above this one's): a resume must not
        send their steps again and overwrite them."""
        newer = []
        for path in sorted([*self.root.glob("*/*/refs-*/*.json"), *self.root.glob("*/*/session.json")]):
            try:
                version = read_record(path).get("schema_version", 1)
            except BadRecord:
                continue
            if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
                newer.append(path)
        return newer

    def load_sessions(self) -> list[SessionRecord]:
        out = []
        for path in sorted(self.root.glob("*/*/session.json")):
            record = self._load(path, SessionRecord)
            if record is not None and record.key == path.parent.relative_to(self.root).as_posix():
                out.append(record)
            elif record is not None:
                self.skipped(path, f"its key {record.key!r} is not its folder (a copy?); not counted")
        return out

    def diagnosis_path(self, session_key: str, at: str, references: int | None = None) -> Path:
        name = "diagnosis.json" if at == "oom" else f"diagnosis-{at}-{references}.json"
        return self.session_dir(session_key) / name

    def write_diagnosis(self, record: DiagnosisRecord) -> None:
        """<card>/<flags>/diagnosis.json (the deciding OOM's pass), diagnosis-peak-<N>.json (diagnosis = always:
        the peaks of the highest and the lowest served reference counts)."""
        write_json(self.diagnosis_path(record.key, record.at, record.references), record.model_dump(mode="json"))

    def load_diagnoses(self) -> list[DiagnosisRecord]:
        out = []
        for path in sorted(self.root.glob("*/*/diagnosis*.json")):
            record = self._load(path, DiagnosisRecord)
            if record is not None and record.key == path.parent.relative_to(self.root).as_posix():
                out.append(record)
        return out

    # -- the soak: <card>/<flags>/soak/ (runner.run.soak) ------------------------------------------------------
    def soak_key(self, session_key: str) -> str:
        """The soak's folder, relative to the run folder: its server logs and memory.csv go there too."""
        return f"{session_key}/{SOAK_FOLDER}"

    def write_soak(self, record: SoakRecord) -> None:
        write_json(self.session_dir(self.soak_key(record.key)) / "soak.json", record.model_dump(mode="json"))

    def load_soak(self, session_key: str) -> SoakRecord | None:
        path = self.session_dir(self.soak_key(session_key)) / "soak.json"
        if not path.exists():
            return None
        record = self._load(path, SoakRecord)
        if record is not None and record.key != session_key:
            self.skipped(path, f"its key {record.key!r} is not its folder (a copy?); not counted")
            return None
        return record

    def load_soaks(self) -> list[SoakRecord]:
        paths = sorted(self.root.glob(f"*/*/{SOAK_FOLDER}/soak.json"))
        keys = (p.parent.parent.relative_to(self.root).as_posix() for p in paths)
        return [r for k in keys if (r := self.load_soak(k)) is not None]

    def append_soak_request(self, record: SoakRequest) -> None:
        """One line of requests.jsonl, appended and synced the moment the request is done (a kill loses at most
        the line being written; the next append first drops such a partial line, readers skip it)."""
        path = self.session_dir(self.soak_key(record.key)) / SOAK_REQUESTS
        line = (json.dumps(record.model_dump(mode="json"), separators=(",", ":")) + "\n").encode()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path not in self._appending and path.exists() and not _ends_a_line(path):
                data = path.read_bytes()  # a kill mid-append left half a line: it never counted, it goes
                atomic_write(path, data[: data.rfind(b"\n") + 1])
            self._appending.add(path)
            with path.open("ab") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise _store_error(path, exc) from None

    def load_soak_requests(self, session_key: str) -> list[SoakRequest]:
        """A soak's request records in request order: each line read as a record (migrated, validated); a line
        that is not one (a kill mid-append, an edit, another flag set's copy) is left out with one warning line,
        and a number recorded twice counts once (its first line)."""
        path = self.session_dir(self.soak_key(session_key)) / SOAK_REQUESTS
        if not path.exists():
            return []
        out: dict[int, SoakRequest] = {}
        bad = 0
        try:
            lines = path.read_bytes().splitlines()
        except OSError as exc:
            self.skipped(path, f"cannot read it: {exc.strerror}")
            return []
        for raw in lines:
            try:
                doc = json.loads(raw, parse_int=_record_int, parse_constant=_no_constant)
                record = load(SoakRequest, doc)
            except (ValueError, RecursionError):  # not JSON, a bad number, not a record (RecordError)
                bad += 1
                continue
            if record.key != session_key:
                bad += 1
                continue
            out.setdefault(record.number, record)
        if bad:
            self.skipped(path, f"{bad} line(s) are not request records of {session_key}; left out")
            self._unreadable.discard(path)  # the file itself is read: appends go on
        return [out[n] for n in sorted(out)]

    def load_session(self, session_key: str) -> SessionRecord | None:
        path = self.session_dir(session_key) / "session.json"
        return self._load(path, SessionRecord) if path.exists() else None

    def load_run(self) -> dict[str, Any]:
        """run.json is the run's identity (its matrix, inputs, id): unreadable, it ends the command with one
        line naming it (UserError), never a traceback."""
        path = self.root / "run.json"
        try:
            doc = read_record(path)
        except BadRecord as exc:
            raise UserError(f"{path}: {exc}; the run cannot be checked against its matrix (restore the file "
                            f"or start a new run)") from None
        missing = [k for k in ("run_id", "matrix") if k not in doc]
        if missing or not isinstance(doc["matrix"], dict) or "text" not in doc["matrix"]:
            raise UserError(f"{path}: not a run.json of this runner (missing {', '.join(missing) or 'matrix.text'})")
        return doc

    def read_png(self, key: str) -> bytes | None:
        """A step's image, or None: none kept, or (after one line) what stands there is not a file to read."""
        path = self.root / f"{key}.png"
        if not path.exists():
            return None
        try:
            return read_regular(path, PNG_MAX_BYTES)
        except NotRead as exc:
            self.skipped(path, f"cannot read it: {exc}")
            return None


def _ends_a_line(path: Path) -> bool:
    """The file is empty or its last byte ends a line (read from the end: a soak's file grows long)."""
    with path.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        if not size:
            return True
        f.seek(size - 1)
        return f.read(1) == b"\n"


def read_memory(path: Path) -> tuple[list[tuple[float, int, str, str, int]], int]:
    """memory.csv's rows, and how many lines were not one (a kill mid-append, an edit): those are left out.
    NotRead when what stands there is not a regular file (a FIFO is refused, never waited on)."""
    if not path.exists():
        return [], 0
    rows, unreadable = [], 0
    with open_regular(path) as raw, io.TextIOWrapper(raw, errors="replace", newline="") as f:
        for r in csv.DictReader(f):
            try:
                rows.append((float(r["t"]), int(r["attempt"]), str(r["source"]), str(r["metric"]), int(r["bytes"])))
            except (KeyError, TypeError, ValueError):
                unreadable += 1
    return rows, unreadable


def load_memory(path: Path) -> list[tuple[float, int, str, str, int]]:
    return read_memory(path)[0]
