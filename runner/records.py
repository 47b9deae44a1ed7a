# mypy: disable-error-code="misc"
# (mypy reads `= _schema(...)` as a default: a field specifier it does not know; the dataclasses are right)
"""The values that cross module lines: what a step, a session and a run produced, as frozen dataclasses.

Each on-disk record is declared here once: the dataclass is the declaration, `schema_version` says which
one wrote a file, and the published JSON Schema (runner/schema/result.schema.json) is generated from these
declarations by runner.schemagen (a test fails when the committed schema drifts). Extra schema constraints
sit beside the field (`field(metadata={"schema": ...})`) or the class (`SCHEMA_EXTRA`).
"""

from __future__ import annotations

import re
import types
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from enum import StrEnum
from typing import Any, ClassVar

from pydantic import BaseModel

from runner.findings.models import OomReport
from runner.vocab import MemoryMetric, Role

# 2: implied_by, wall_samples_s, schema_version; a start may be open (stopped_at null) after a kill
# 3: server_peak_mb -> server_peak_mib + server_peak_source + server_peak_measures; failure references_dropped
# (3 also: sends, added with a default: readers of 3 without it see no send times)
SCHEMA_VERSION = 3


def _plain(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """asdict's dict factory: the findings' pydantic models (OomReport, ...) become their JSON form."""
    return {k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in pairs}


def as_json(record: Any) -> dict[str, Any]:
    return asdict(record, dict_factory=_plain)


def _schema(*, default: Any = ..., required: bool = False, **constraints: Any) -> Any:
    """A field with JSON Schema constraints; `required` keeps a defaulted field required in the schema."""
    meta = {"schema": constraints, "required": required}
    return field(metadata=meta) if default is ... else field(default=default, metadata=meta)


class RecordTypeError(ValueError):
    """A record file's field holds a value of the wrong type ("references": "two"): the file is not a record
    of this runner. The message names the field and the value."""


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value can stand for a field declared `hint` (the declarations below use only these)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is Any:
        return True
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if isinstance(hint, type) and issubclass(hint, StrEnum):
        return isinstance(value, str)  # which names are known is from_json's to say (Status, FailureClass)
    if isinstance(hint, type) and is_dataclass(hint):
        return isinstance(value, dict)  # checked field by field by its own from_json
    if origin is tuple:
        args = typing.get_args(hint)
        return isinstance(value, (list, tuple)) and all(_fits(v, args[0]) for v in value)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    return True


def check_types(cls: type, d: Any) -> None:
    """RecordTypeError unless `d` is a JSON object whose fields have the types `cls` declares (fields it does
    not know are left to the caller: older and newer records differ in which fields they hold)."""
    if not isinstance(d, dict):
        raise RecordTypeError(f"{cls.__name__}: a {type(d).__name__}, not a JSON object")
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if f.name in d and not _fits(d[f.name], hints[f.name]):
            shown = repr(d[f.name])
            raise RecordTypeError(f"{cls.__name__}.{f.name}: {shown[:60]}{'…' if len(shown) > 60 else ''} is not "
                                  f"{_type_name(hints[f.name])}")


def _type_name(hint: Any) -> str:
    text = str(hint).replace("typing.", "").replace("runner.records.", "").replace("runner.vocab.", "")
    return re.sub(r"<(?:class|enum) '([\w.]+)'>", r"\1", text).replace(", ...]", "…]")


class Status(StrEnum):
    OK = "ok"  # an image came back (its scores say whether it is usable)
    FAILED = "failed"  # attempted and failed: a failure class with evidence
    SKIPPED = "skipped"  # not attempted: the reason says why


class FailureClass(StrEnum):
    OOM_AT_LOAD = "oom_at_load"  # server died or stalled at load with an out-of-memory text
    LOAD_EXIT = "load_exit"  # server exited before it was ready, no OOM text
    READY_TIMEOUT = "ready_timeout"  # never became ready within the deadline
    OOM = "oom"  # a request failed and the OOM text appeared in its body or in the log of its window
    CRASH = "crash"  # the server died during the request
    TIMEOUT = "timeout"  # no response within the request deadline
    HTTP_ERROR = "http_error"  # an error status without OOM evidence
    BAD_RESPONSE = "bad_response"  # 200 but no decodable image (malformed JSON, no image, bad PNG)
    CONNECTION = "connection"  # could not talk to a live server
    # The server was stopped from outside during the request (SIGTERM/SIGHUP/SIGINT exit code, its Docker
    # engine went away): says nothing about the server or its memory; not done, a resume sends it again
    STOPPED = "stopped"
    # 200 with an image, but the server served fewer references than were sent (vLLM-Omni 0.30 logs "Failed
    # to decode reference image" and drops it): the step did not test n references, so it never counts at n
    REFERENCES_DROPPED = "references_dropped"
    # The scheduler ended the server (Slurm's slurmstepd says so in the step's log): nothing about memory
    CANCELLED = "cancelled"  # its job or step was cancelled (scancel) by someone else
    PREEMPTED = "preempted"  # a higher-priority job took the allocation
    TIME_LIMIT = "time_limit"  # the allocation's time limit was reached
    NODE_FAILURE = "node_failure"  # the node failed or was lost


@dataclass(frozen=True)
class Failure:
    kind: FailureClass
    message: str
    # log lines or body excerpts that decided the class
    evidence: tuple[str, ...] = _schema(required=True, default=())
    http_status: int | None = None
    exit_code: int | None = None
    oom: OomReport | None = None  # an out-of-memory failure: PyTorch's message taken apart, and its site

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Failure:
        check_types(cls, d)
        return cls(FailureClass(d["kind"]), d["message"], tuple(d.get("evidence", ())), d.get("http_status"),
                   d.get("exit_code"), OomReport.model_validate(d["oom"]) if d.get("oom") else None)


@dataclass(frozen=True)
class Peak:
    """One peak figure with its provenance; `available` false means unknown, never zero."""

    source: str  # a meter name, or "server-response" (a peak the server reported in its response)
    metric: MemoryMetric  # "device" (VRAM) or "host" (host RAM of the server)
    bytes: int | None = _schema(minimum=0)
    samples: int = _schema(minimum=0)
    rate_hz: float | None
    available: bool
    reason: str | None = None

    SCHEMA_EXTRA: ClassVar[dict[str, Any]] = {
        "if": {"properties": {"available": {"const": False}}},
        "then": {"properties": {"bytes": {"type": "null"}, "reason": {"type": "string"}}}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Peak:
        check_types(cls, d)
        return cls(**d)


@dataclass(frozen=True)
class Sanity:
    width: int
    height: int
    mode: str
    transparent_share: float = _schema(minimum=0, maximum=1)  # share of pixels with alpha == 0
    pixel_std: float  # std of RGB values over the image (flat/grey images are near 0)
    nan_or_black: bool
    broken: bool
    reasons: tuple[str, ...] = _schema(required=True, default=())

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Sanity:
        check_types(cls, d)
        return cls(**{**d, "reasons": tuple(d.get("reasons", ()))})


@dataclass(frozen=True)
class Scores:
    baseline: str | None  # the baseline image scored against (path or step key)
    psnr_db: float | None
    ssim: float | None
    size_match: bool | None
    reason: str | None  # why psnr/ssim are missing, when they are
    sanity: Sanity

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Scores:
        check_types(cls, d)
        return cls(**{**d, "sanity": Sanity.from_json(d["sanity"])})


@dataclass(frozen=True)
class SendTime:
    """One HTTP send of a step's request: when, how long, and whether it is one of the timed samples (the
    determinism re-send is not; a send that failed is not)."""

    started_at: float  # epoch seconds
    wall_s: float = _schema(minimum=0)
    timed: bool

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SendTime:
        return cls(**d)


@dataclass(frozen=True)
class StepRecord:
    """<card>/<flags>/refs-<n>/<fixture>-seed-<s>.json"""

    key: str = _schema(pattern="^[^/]+/[^/]+/refs-[0-9]+/[^/]+-seed-[0-9-]+$")
    card: str
    flags: str
    role: Role
    fixture: str
    references: int = _schema(minimum=0)
    seed: int
    status: Status
    attempt: int = _schema(minimum=0, default=0)  # which server start of the session served it (0 = first)
    started_at: float | None = None  # epoch seconds at send
    wall_s: float | None = None  # the first send's wall time
    wall_samples_s: tuple[float, ...] = ()  # every timed send of this request ([run] repeats), first included
    failure: Failure | None = None
    skip_reason: str | None = None
    implied_by: str | None = None  # skipped because this step's OOM decides it (key of the deciding step)
    lost: bool = False  # in flight when the server died
    image: str | None = None  # PNG file name beside the record
    image_sha256: str | None = None
    # The server's own peak from its response (`peak_memory_mb`; the value is MiB: bytes / 1024²), where in
    # the response it was found, and what it measures ("reserved": vLLM-Omni 0.30's torch
    # max_memory_reserved for the request; "unspecified": an older top-level field of unknown meaning).
    server_peak_mib: float | None = None
    server_peak_source: str | None = None
    server_peak_measures: str | None = _schema(default=None, enum=["reserved", "unspecified", None])
    peaks: tuple[Peak, ...] = _schema(required=True, default=())
    scores: Scores | None = None
    deterministic: bool | None = None  # the request sent again (repeats / first-step check): same bytes?
    repeat_psnr_db: float | None = None  # when not identical: PSNR of the differing repeat against the first image
    request: dict[str, Any] = field(default_factory=dict)
    # Every send of this request in order, top-ups of `repeats = "auto"` included: its cost, and when each
    # timed sample existed (the report's "verdict known at"). Empty in records written before it existed.
    sends: tuple[SendTime, ...] = ()
    schema_version: int = _schema(required=True, minimum=1, default=SCHEMA_VERSION)

    SCHEMA_EXTRA: ClassVar[dict[str, Any]] = {"allOf": [
        {"if": {"properties": {"status": {"const": "failed"}}},
         "then": {"properties": {"failure": {"$ref": "#/$defs/Failure"}}}},
        {"if": {"properties": {"status": {"const": "skipped"}}},
         "then": {"properties": {"skip_reason": {"type": "string"}}}},
        {"if": {"properties": {"status": {"const": "ok"}}},
         "then": {"properties": {"image": {"type": "string"}, "image_sha256": {"type": "string"},
                                 "scores": {"$ref": "#/$defs/Scores"}}}}]}

    def to_json(self) -> dict[str, Any]:
        return as_json(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StepRecord:
        check_types(cls, d)
        d = dict(d)
        if "server_peak_mb" in d:  # records written before the rename: a top-level figure, meaning unknown
            d["server_peak_mib"] = d.pop("server_peak_mb")
            if d["server_peak_mib"] is not None:
                d.setdefault("server_peak_source", "peak_memory_mb")
                d.setdefault("server_peak_measures", "unspecified")
        return cls(**{
            "schema_version": 1,  # files written before records carried their version
            **d,
            "status": Status(d["status"]),
            "failure": Failure.from_json(d["failure"]) if d.get("failure") else None,
            "peaks": tuple(Peak.from_json(p) for p in d.get("peaks", ())),
            "wall_samples_s": tuple(d.get("wall_samples_s", ())),
            "sends": tuple(SendTime.from_json(x) for x in d.get("sends", ())),
            "scores": Scores.from_json(d["scores"]) if d.get("scores") else None,
        })

    def peak(self, metric: str = "device") -> Peak | None:
        """The best available peak for a metric: the first available one in meter order."""
        return next((p for p in self.peaks if p.metric == metric and p.available), None)


@dataclass(frozen=True)
class ServerStart:
    attempt: int
    started_at: float
    ready_s: float | None  # seconds from start to ready; None if it never was (or still loading)
    failure: Failure | None
    stopped_at: float | None = None  # None while running (a start open when the runner was killed stays so)
    load_peaks: tuple[Peak, ...] = ()
    info: dict[str, Any] = field(default_factory=dict)  # pid or container id, image digest, command

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ServerStart:
        check_types(cls, d)
        return cls(**{**d, "failure": Failure.from_json(d["failure"]) if d.get("failure") else None,
                      "load_peaks": tuple(Peak.from_json(p) for p in d.get("load_peaks", ()))})


@dataclass(frozen=True)
class SessionRecord:
    """<card>/<flags>/session.json"""

    key: str = _schema(pattern="^[^/]+/[^/]+$")
    card: str
    flags: str
    role: Role
    backend: str  # a runner.registry.BACKENDS name
    starts: tuple[ServerStart, ...]
    session_peaks: tuple[Peak, ...] = ()
    meters: tuple[dict[str, Any], ...] = ()  # provenance per meter: source, available, reason, samples, hz
    idle_baseline: dict[str, Any] = field(default_factory=dict)
    log: str | None = None
    notes: tuple[str, ...] = ()
    schema_version: int = _schema(required=True, minimum=1, default=SCHEMA_VERSION)

    def to_json(self) -> dict[str, Any]:
        return as_json(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SessionRecord:
        check_types(cls, d)
        return cls(**{"schema_version": 1, **d, "starts": tuple(ServerStart.from_json(s) for s in d["starts"]),
                      "session_peaks": tuple(Peak.from_json(p) for p in d.get("session_peaks", ())),
                      "meters": tuple(d.get("meters", ())), "notes": tuple(d.get("notes", ()))})

    @property
    def start_failure(self) -> Failure | None:
        """The failure of a session that never served: its last start failed before ready."""
        last = self.starts[-1] if self.starts else None
        return last.failure if last and last.ready_s is None else None


@dataclass(frozen=True)
class RunRecord:
    """run.json: what was asked (the matrix, its hash, the plan) and what was found (versions, host, the
    facts per card), when it ran, and each resume."""

    run_id: str
    started_at: float
    started_at_iso: str
    matrix: dict[str, Any]  # path, sha256, text
    runner: dict[str, Any]  # version, python, packages
    host: dict[str, Any]  # hostname, platform, cpus
    cards: dict[str, Any]  # per card: what was asked, and the facts found (image digests, engine, GPU)
    plan: dict[str, Any]  # lanes, steps, sessions (keys, in plan order)
    finished_at: float | None = None
    finished_at_iso: str | None = None
    interrupted: bool = False
    resumes: tuple[dict[str, Any], ...] = ()  # when, and how many steps each resume had to send
    # digest per input the records depend on (runner.inputs): a resume whose inputs differ is refused
    inputs: dict[str, str] = field(default_factory=dict)
    schema_version: int = _schema(required=True, minimum=1, default=SCHEMA_VERSION)

    def to_json(self) -> dict[str, Any]:
        return as_json(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RunRecord:
        return cls(**{"schema_version": 1, **d, "resumes": tuple(d.get("resumes", ()))})
