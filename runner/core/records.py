"""The values that cross module lines: what a step, a session and a run produced, as pydantic models.

Each on-disk record is declared here once (frozen, unknown keys refused: the `Record` base, which the
findings' records share): the model validates a file, writes it (`model_dump(mode="json")`) and is the
published JSON Schema (runner/schema/result.schema.json, written by `runner schema`; a test fails when the
committed file drifts).
Constraints the schema states beyond the types sit beside the class (`_schema_extra`).

A file is read with `load(StepRecord, doc)`: `migrate` brings a record of any earlier `schema_version` to the
current form (the one place that knows old formats), then the model validates it strictly, as JSON types
("references": "two" or "2" is refused, never coerced), and a refusal is a RecordError of one line:
`field: value: problem`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from enum import StrEnum
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runner.core.vocab import MemoryMetric, Role


class Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Frame(Record):
    """One traceback frame, its path in the package-relative form (`vllm_omni/diffusion/models/utils.py`)."""

    path: str
    line: int
    function: str
    code: str | None = None  # the source line the traceback printed under the frame
    own: bool = Field(description="the server's own code (the site rule in docs/results.md)")

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line} in {self.function}"


class OomReport(Record):
    """PyTorch's CUDA OOM message taken apart, and where in the server's code it happened. A field the
    message did not carry (an older torch, vLLM-Omni's shortened HTTP 500 text) is absent, never zero."""

    message: str = Field(description="the OOM text as found (at most 1,000 characters)")
    source: str = Field(description="where it was found: 'response body', 'server log', or 'engine' (the "
                                    "container engine's OOMKilled: the kernel's OOM killer, no message)")
    memory: Literal["device", "host"] = Field(
        default="device", description="which memory ran out: device (the allocator's message) or host (the "
                                      "kernel's OOM killer ended the server: a container's memory limit or the "
                                      "machine's RAM)")
    tried_bytes: int | None = Field(default=None, ge=0, description="'Tried to allocate …'")
    capacity_bytes: int | None = Field(default=None, ge=0, description="the GPU's total capacity")
    free_bytes: int | None = Field(default=None, ge=0, description="free on the GPU at the failure")
    in_use_bytes: int | None = Field(default=None, ge=0,
                                     description="this process's use, non-PyTorch memory included")
    allowed_bytes: int | None = Field(default=None, ge=0,
                                      description="the per-process cap (set_per_process_memory_fraction)")
    allocated_bytes: int | None = Field(default=None, ge=0, description="allocated by PyTorch")
    reserved_unallocated_bytes: int | None = Field(
        default=None, ge=0, description="reserved by PyTorch but unallocated (fragmentation, cached blocks); "
                                        "torch < 2.1: reserved in total minus allocated")
    site: str | None = Field(default=None, description="package-relative path:line of the innermost frame of "
                                                       "the server's own code")
    function: str | None = None
    frames: tuple[Frame, ...] = Field(default=(), description="the site and up to three of its callers, "
                                                              "innermost first; with no server frame, the "
                                                              "innermost frames")
    no_site: str | None = Field(default=None, description="why there is no site (no traceback in the window, "
                                                          "no server frame)")

    @property
    def binding_bytes(self) -> int | None:
        """The capacity that bound: the per-process cap where the message names one, else the GPU's total."""
        return self.allowed_bytes if self.allowed_bytes is not None else self.capacity_bytes


# 1: files without the field
# 2: implied_by, wall_samples_s, schema_version; a start may be open (stopped_at null) after a kill
# 3: server_peak_mb -> server_peak_mib + server_peak_source + server_peak_measures; failure references_dropped
# (3 also: sends, added with a default: records of 3 without it have no send times)
# 4: server_stage_durations_s (a default: a record of 3 reads with none)
# 5: session served_model (a default: a record of 4 reads with none); server_stage_durations_s in seconds for
#    every key (4 kept vLLM-Omni 0.30's `*_ms` keys as their milliseconds: they become seconds, suffix dropped);
#    diagnosis trace, trace_peak_bytes, trace_device (defaults: a record of 4 reads with none)
# 6: step floor_before, floor_after; session retention_probe (defaults: a record of 5 reads with none)
SCHEMA_VERSION = 6


def _schema_extra(*, required: tuple[str, ...] = (), rules: dict[str, Any] | None = None
                  ) -> Callable[[dict[str, Any]], None]:
    """A model's JSON Schema beyond its types: `required` keeps defaulted fields required in the schema (a
    record this runner writes always holds them), `rules` adds keywords (if/then rules)."""

    def extra(schema: dict[str, Any]) -> None:
        schema["required"] = [*schema.get("required", ()), *required]
        schema.update(rules or {})

    return extra


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
    # The scheduler refused the allocation (sbatch's error: a limit, an account, a request no node can meet):
    # no server started; a start failure of the cluster's, not of the server
    REFUSED = "refused"


# Failures imposed from outside the server (a stop signal, its engine gone, the scheduler ending it): the
# request measured nothing about the server or its memory, so the step is to do again. The one rule of
# "to do again": resume and the banner (runner.run.pending) and the verdict's words all read it.
SEND_AGAIN = frozenset({FailureClass.STOPPED, FailureClass.CANCELLED, FailureClass.PREEMPTED,
                        FailureClass.TIME_LIMIT, FailureClass.NODE_FAILURE})


class Failure(Record):
    model_config = ConfigDict(json_schema_extra=_schema_extra(required=("evidence",)))

    kind: FailureClass
    message: str
    evidence: tuple[str, ...] = Field(default=(), description="log lines or body excerpts that decided the class")
    http_status: int | None = None
    exit_code: int | None = None
    oom: OomReport | None = Field(default=None, description="an out-of-memory failure: PyTorch's message taken "
                                                            "apart, and its site")


class Peak(Record):
    """One peak figure with its provenance; `available` false means unknown, never zero."""

    model_config = ConfigDict(json_schema_extra=_schema_extra(rules={
        "if": {"properties": {"available": {"const": False}}},
        "then": {"properties": {"bytes": {"type": "null"}, "reason": {"type": "string"}}}}))

    source: str = Field(description="a meter name, or 'server-response' (a peak the server reported in its "
                                    "response)")
    metric: MemoryMetric = Field(description="'device' (VRAM) or 'host' (host RAM of the server)")
    bytes: int | None = Field(ge=0)
    samples: int = Field(ge=0)
    rate_hz: float | None
    available: bool
    reason: str | None = None


class Level(Record):
    """The device level settled in a quiet window between requests, from one source: the least sample in the
    window (memory a request frees is gone by then; what stays is the floor). `bound` says what it is: "exact"
    for the server's own figure of live tensor bytes, "upper-bound" for a whole-device source (NVML, dcgm,
    Prometheus, the sidecar), which also counts the allocator's cache of freed blocks and other processes."""

    source: str
    bytes: int | None = Field(ge=0)
    samples: int = Field(ge=0)
    window_s: float = Field(ge=0, allow_inf_nan=False, description="the quiet window's length")
    bound: Literal["exact", "upper-bound"]
    available: bool
    reason: str | None = None


class Sanity(Record):
    model_config = ConfigDict(json_schema_extra=_schema_extra(required=("reasons",)))

    width: int
    height: int
    mode: str
    transparent_share: float = Field(ge=0, le=1, description="share of pixels with alpha == 0")
    pixel_std: float = Field(description="std of RGB values over the image (flat/grey images are near 0)")
    nan_or_black: bool
    broken: bool
    reasons: tuple[str, ...] = ()


class Scores(Record):
    baseline: str | None = Field(description="the baseline image scored against (path or step key)")
    psnr_db: float | None
    ssim: float | None
    size_match: bool | None
    reason: str | None = Field(description="why psnr/ssim are missing, when they are")
    sanity: Sanity


# A timed send that came back with an image took time: finite and above zero (a ratio divides by it)
TimedWall = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class SendTime(Record):
    """One HTTP send of a step's request: when, how long, and whether it is one of the timed samples (the
    determinism re-send is not; a send that failed is not)."""

    started_at: float = Field(description="epoch seconds", allow_inf_nan=False)
    wall_s: float = Field(ge=0, allow_inf_nan=False)
    timed: bool


# what each status needs (`failure` and `scores` are declared `X | null`: "object" says not null)
_STEP_RULES = [
    {"if": {"properties": {"status": {"const": "failed"}}},
     "then": {"properties": {"failure": {"type": "object"}}}},
    {"if": {"properties": {"status": {"const": "skipped"}}},
     "then": {"properties": {"skip_reason": {"type": "string"}}}},
    {"if": {"properties": {"status": {"const": "ok"}}},
     "then": {"properties": {"image": {"type": "string"}, "image_sha256": {"type": "string"},
                             "scores": {"type": "object"}}}}]


class StepRecord(Record):
    """<card>/<flags>/refs-<n>/<fixture>-seed-<s>.json"""

    model_config = ConfigDict(json_schema_extra=_schema_extra(required=("peaks", "schema_version"),
                                                              rules={"allOf": _STEP_RULES}))

    key: str = Field(pattern="^[^/]+/[^/]+/refs-[0-9]+/[^/]+-seed-[0-9-]+$")
    card: str
    flags: str
    role: Role
    fixture: str
    references: int = Field(ge=0)
    seed: int
    status: Status
    attempt: int = Field(default=0, ge=0, description="which server start of the session served it (0 = first)")
    started_at: float | None = Field(default=None, description="epoch seconds at send")
    wall_s: float | None = Field(default=None, ge=0, allow_inf_nan=False, description="the first send's wall time")
    wall_samples_s: tuple[TimedWall, ...] = Field(default=(), description="every timed send of this request "
                                                                      "([run] repeats), first included")
    failure: Failure | None = None
    skip_reason: str | None = None
    implied_by: str | None = Field(default=None, description="skipped because this step's OOM decides it (key of "
                                                             "the deciding step)")
    lost: bool = Field(default=False, description="in flight when the server died")
    image: str | None = Field(default=None, description="PNG file name beside the record")
    image_sha256: str | None = None
    # The server's own peak from its response (`peak_memory_mb`; the value is MiB: bytes / 1024²), where in
    # the response it was found, and what it measures ("reserved": vLLM-Omni 0.30's torch
    # max_memory_reserved for the request; "unspecified": an older top-level field of unknown meaning).
    server_peak_mib: float | None = None
    server_peak_source: str | None = None
    server_peak_measures: Literal["reserved", "unspecified"] | None = None
    server_stage_durations_s: dict[str, float] = Field(
        default_factory=dict, description="the server's own seconds per stage of the first answered send "
                                          "(vLLM-Omni's metrics.stage_durations, asked for with "
                                          "return_stage_metrics): the denoise time apart from the HTTP wall time")
    peaks: tuple[Peak, ...] = ()
    scores: Scores | None = None
    deterministic: bool | None = Field(default=None, description="the request sent again (repeats / first-step "
                                                                 "check): same bytes?")
    repeat_psnr_db: float | None = Field(default=None, description="when not identical: PSNR of the differing "
                                                                   "repeat against the first image")
    request: dict[str, Any] = Field(default_factory=dict)
    sends: tuple[SendTime, ...] = Field(default=(), description="every send of this request in order, top-ups of "
                                        "`repeats = \"auto\"` included: its cost, and when each timed sample "
                                        "existed (the report's \"verdict known at\")")
    floor_before: tuple[Level, ...] = Field(default=(), description="the device level settled before the request "
                                            "(after the load, or after the previous request of the same start), "
                                            "per device source")
    floor_after: tuple[Level, ...] = Field(default=(), description="the device level settled in the quiet window "
                                           "after the request, per device source: what the request left behind")
    schema_version: int = Field(default=SCHEMA_VERSION, ge=1)

    def peak(self, metric: str = "device") -> Peak | None:
        """The best available peak for a metric: the first available one in meter order."""
        return next((p for p in self.peaks if p.metric == metric and p.available), None)


def send_again(record: StepRecord) -> bool:
    """A step a resume sends again: stopped from outside (SEND_AGAIN), or skipped for a passing reason
    (not implied by a recorded OOM: the run was interrupted, the restart budget used, a start failed)."""
    if record.failure is not None and record.failure.kind in SEND_AGAIN:
        return True
    return record.status == Status.SKIPPED and record.implied_by is None


class ServerStart(Record):
    attempt: int
    started_at: float
    ready_s: float | None = Field(description="seconds from start to ready; None if it never was (or still "
                                              "loading)")
    failure: Failure | None
    stopped_at: float | None = Field(default=None, description="None while running (a start open when the "
                                                               "runner was killed stays so)")
    load_peaks: tuple[Peak, ...] = ()
    info: dict[str, Any] = Field(default={}, description="pid or container id, image digest, command")


class ServedModel(Record):
    """What the server said it serves (`GET /v1/models`, asked once it is ready, before any request) against the
    `model` the requests carry. vLLM-Omni's images routes refuse a model they do not serve (400 "Model
    mismatch"); its chat route does not check it."""

    sent: str = Field(description="the `model` every request carries ([servers.X] model; default: the table's "
                                  "name)")
    served: tuple[str, ...] = Field(default=(), description="the ids /v1/models listed (bounded, made inert); "
                                                             "empty when it gave no list")
    matches: bool | None = Field(description="`sent` is one of `served`; null: the server gave no list")
    route_checks: bool = Field(description="the dialect's route refuses a model it does not serve (the requests "
                                           "are sent anyway and recorded with the server's answer)")
    note: str | None = Field(default=None, description="the one console line said before the first request "
                                                       "(what to set), or why /v1/models gave no list")


class RetentionProbe(Record):
    """After a session's last step, its first request sent once more (untimed, never a sample or a peak), where
    the levels grew with every new reference and every request carried all the references before it: does the
    level stay (a cache of every distinct reference) or fall back (the last request's references, kept until the
    next)? runner/judge/findings/retention.py reads it."""

    key: str = Field(description="the step whose request was sent again")
    references: int = Field(ge=0)
    attempt: int = Field(ge=0, description="the server start it was sent to")
    started_at: float = Field(allow_inf_nan=False)
    wall_s: float = Field(ge=0, allow_inf_nan=False)
    served: bool = Field(description="it came back with an image")
    floor_after: tuple[Level, ...] = ()


class SessionRecord(Record):
    """<card>/<flags>/session.json"""

    model_config = ConfigDict(json_schema_extra=_schema_extra(required=("schema_version",)))

    key: str = Field(pattern="^[^/]+/[^/]+$")
    card: str
    flags: str
    role: Role
    backend: str = Field(description="a runner.core.registry.BACKENDS name")
    starts: tuple[ServerStart, ...]
    session_peaks: tuple[Peak, ...] = ()
    meters: tuple[dict[str, Any], ...] = Field(default=(), description="provenance per meter: source, available, "
                                                                       "reason, samples, hz")
    idle_baseline: dict[str, Any] = Field(default_factory=dict)
    log: str | None = None
    notes: tuple[str, ...] = ()
    served_model: ServedModel | None = Field(default=None, description="the server's /v1/models against the model "
                                                                       "sent, at its last start that got ready; "
                                                                       "null: no start got ready")
    retention_probe: RetentionProbe | None = Field(default=None, description="the first request sent again after "
                                                   "the last step, where what stays could not be told apart "
                                                   "(schema version 6; older records have none)")
    schema_version: int = Field(default=SCHEMA_VERSION, ge=1)

    @property
    def start_failure(self) -> Failure | None:
        """The failure of a session that never served: its last start failed before ready."""
        last = self.starts[-1] if self.starts else None
        return last.failure if last and last.ready_s is None else None


NOT_RUN = "not run"  # a diagnosis pass that started no server (why_none says why)


class DiagnosisRecord(Record):
    """<card>/<flags>/diagnosis.json: the diagnosis pass of a flag set decided by a device OOM — one more start
    with the allocator history on and the deciding request sent once more, its allocator snapshot collected.
    Recorded apart: never a timed sample, never a peak of the cell."""

    model_config = ConfigDict(json_schema_extra=_schema_extra(required=("schema_version",)))

    key: str = Field(pattern="^[^/]+/[^/]+$", description="the session key (card/flags)")
    card: str
    flags: str
    at: Literal["oom", "peak", "kept"] = Field(description="oom: the deciding OOM's request (or load); peak: the last "
                                                           "served reference count (diagnosis = always); kept: the "
                                                           "highest served count's request of a flag set whose level "
                                                           "grew after its requests (what stays live after it)")
    of: str = Field(description="the record it repeats: a step key, or the session key for a load OOM")
    references: int | None = Field(default=None, description="the reference count sent; None at load")
    started_at: float
    start_s: float | None = Field(default=None, description="start to ready (None: it never became ready)")
    request_s: float | None = Field(default=None, description="/start_profile to /stop_profile's answer")
    total_s: float = Field(ge=0, description="the whole pass: start, request, stop")
    outcome: str = Field(description="what the request did: 'oom', 'served', 'oom at load', or the failure; "
                                     "'profiler failed' (no request was sent under the profiler), 'failed' (the "
                                     "pass itself failed: why_none names how), 'not run' (no server was started: "
                                     "why_none says why)")
    snapshot: str | None = Field(default=None, description="the snapshot, relative to the run folder")
    before: str | None = Field(default=None, description="kept: a snapshot taken just before the request, nothing "
                                                         "sent under the profiler (a copy, relative to the run "
                                                         "folder): a block live in both is not the request's")
    why_none: str | None = Field(default=None, description="why there is no snapshot (one line)")
    log: str | None = None
    trace: str | None = Field(default=None, description="the profiler's Chrome trace, relative to the run folder, "
                                                        "where it wrote one and no snapshot (schema version 5)")
    trace_peak_bytes: int | None = Field(default=None, ge=0, lt=2**50,
                                         description="the highest `Total Allocated` of the trace's [memory] events: "
                                                     "the allocator's running total as the profiler saw it, from "
                                                     "/start_profile on, on the profiling thread only; no sites")
    trace_device: str | None = Field(default=None, description="the device of those events' allocator (CPU, CUDA)")
    schema_version: int = Field(default=SCHEMA_VERSION, ge=1)


class SoakRequest(Record):
    """One request of a soak: a line of <card>/<flags>/soak/requests.jsonl. Light: no image, no scores, one device
    peak and one level; never a timed sample or a peak of a matrix cell."""

    model_config = ConfigDict(json_schema_extra=_schema_extra(required=("schema_version",)))

    key: str = Field(pattern="^[^/]+/[^/]+$", description="the soaked flag set (card/flags)")
    number: int = Field(ge=1, description="its place in the soak, 1-based, counted over the soak's server starts")
    attempt: int = Field(ge=0, description="which server start of the soak sent it (0 = first; a resume starts "
                                           "another)")
    references: int = Field(ge=0)
    fixture: str
    seed: int
    started_at: float = Field(allow_inf_nan=False, description="epoch seconds at send")
    wall_s: float = Field(ge=0, allow_inf_nan=False, description="the request's wall time")
    status: Literal[Status.OK, Status.FAILED] = Field(description="ok: an image came back (not scored)")
    failure: Failure | None = Field(default=None, description="classified as the matrix's sends are")
    peak: Peak | None = Field(default=None, description="the request's device peak: the first available source "
                                                        "in the card's meter order (the response's own included), "
                                                        "else the first device source saying why it has none")
    floor_after: Level | None = Field(default=None, description="the level it left in the quiet window after it: "
                                                                "the server's exact figure where it has one, else "
                                                                "the first device source with one, else the first "
                                                                "saying why it has none")
    schema_version: int = Field(default=SCHEMA_VERSION, ge=1)


SoakStop = Literal["requests", "minutes", "failure", "oom at load", "start failed", "not idle", "interrupted"]


class SoakRecord(Record):
    """<card>/<flags>/soak/soak.json: one soaked flag set — what was asked, its server starts, why it stopped."""

    model_config = ConfigDict(json_schema_extra=_schema_extra(required=("schema_version",)))

    key: str = Field(pattern="^[^/]+/[^/]+$", description="card/flags")
    card: str
    flags: str
    role: Role
    requests: int = Field(ge=1, description="[soak] requests")
    minutes: float | None = Field(default=None, gt=0, description="[soak] minutes")
    references: tuple[int, ...] = Field(description="the counts it mixes, ascending")
    order: Literal["cycle", "shuffle"]
    chosen: str = Field(description="why this flag set is soaked: named in [soak] flags, or listed in profiles.json")
    starts: tuple[ServerStart, ...] = ()
    meters: tuple[dict[str, Any], ...] = Field(default=(), description="provenance per meter and start")
    stopped: SoakStop | None = Field(default=None, description="why it ended: requests or minutes reached, its first "
                                     "failure, its server's load ran out of memory, a start failure that is not "
                                     "memory, a GPU held by someone else, or interrupted (a resume continues these "
                                     "three); null while it runs")
    why: str | None = Field(default=None, description="the stop in one line (a start failure's, the idle gate's)")
    notes: tuple[str, ...] = ()
    schema_version: int = Field(default=SCHEMA_VERSION, ge=1)


class RunRecord(Record):
    """run.json: what was asked (the matrix, its hash, the plan) and what was found (versions, host, the
    facts per card), when it ran, and each resume."""

    model_config = ConfigDict(json_schema_extra=_schema_extra(required=("schema_version",)))

    run_id: str
    started_at: float
    started_at_iso: str
    matrix: dict[str, Any] = Field(description="path, sha256, text")
    runner: dict[str, Any] = Field(description="version, python, packages")
    host: dict[str, Any] = Field(description="hostname, platform, cpus")
    cards: dict[str, Any] = Field(description="per card: what was asked, and the facts found (image digests, "
                                              "engine, GPU)")
    plan: dict[str, Any] = Field(description="lanes, steps, sessions (keys, in plan order)")
    finished_at: float | None = None
    finished_at_iso: str | None = None
    interrupted: bool = False
    resumes: tuple[dict[str, Any], ...] = Field(default=(), description="when, and how many steps each resume "
                                                                        "had to send")
    inputs: dict[str, str] = Field(default={}, description="digest per input the records depend on "
                                                           "(runner.plan.inputs): a resume whose inputs differ is "
                                                           "refused")
    schema_version: int = Field(default=SCHEMA_VERSION, ge=1)


# the record files, as published
ROOTS: tuple[type[Record], ...] = (StepRecord, SessionRecord, DiagnosisRecord, SoakRecord, SoakRequest, RunRecord)


# --- reading a record file: migrate, then validate ---------------------------------------------------------

class RecordError(ValueError):
    """A record file that is not a record of this runner: one line, `field: value: problem`."""


def _v2_step(d: dict[str, Any]) -> dict[str, Any]:
    """Version 2 and earlier: the server's peak was a top-level `server_peak_mb`, meaning unknown."""
    if "server_peak_mb" not in d:
        return d
    d = dict(d)
    d["server_peak_mib"] = d.pop("server_peak_mb")
    if d["server_peak_mib"] is not None:
        d.setdefault("server_peak_source", "peak_memory_mb")
        d.setdefault("server_peak_measures", "unspecified")
    return d


def _v4_step(d: dict[str, Any]) -> dict[str, Any]:
    """Version 4 kept vLLM-Omni 0.30's stage durations as the server named them: `queue_wait_ms`,
    `stage_0_gen_ms` held milliseconds under a field of seconds. Seconds for every key, the unit's suffix
    dropped (a key without one was seconds already: the reference server's `diffusion`)."""
    stages = d.get("server_stage_durations_s")
    if not isinstance(stages, dict):
        return d
    return {**d, "server_stage_durations_s": stage_seconds(stages)}


def stage_seconds(stages: dict[str, Any]) -> dict[str, Any]:
    """A server's stage durations keyed by name in seconds: `x_ms` → `x` / 1000, `x_s` → `x`, other keys as
    they are (a value that is no number is left for validation to refuse)."""
    out: dict[str, Any] = {}
    for key, value in stages.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if isinstance(key, str) and key.endswith("_ms") and len(key) > 3 and number:
            out[key[:-3]] = value / 1000
        elif isinstance(key, str) and key.endswith("_s") and len(key) > 2:
            out[key[:-2]] = value
        else:
            out[key] = value
    return out


# Per record, the step that upgrades a file of version v to v + 1, applied in order from the file's version
# (additions that have a default need no step: a file without them reads with the default).
_UPGRADES: dict[type[Record], dict[int, Callable[[dict[str, Any]], dict[str, Any]]]] = {
    StepRecord: {2: _v2_step, 4: _v4_step},  # version 1 held server_peak_mb too: it passes through 2 -> 3
}


def migrate(model: type[Record], data: dict[str, Any]) -> dict[str, Any]:
    """A record dict of any earlier schema_version in the current form (a new dict; `data` is not changed).
    A version newer than this runner's is a RecordError: its fields may mean something this one does not
    know."""
    version = data.get("schema_version", 1)  # files written before records carried their version
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise RecordError(f"schema_version: {_shown(version)}: not a record version (1 to {SCHEMA_VERSION})")
    if version > SCHEMA_VERSION:
        raise RecordError(f"schema_version: {version}: written by a newer runner (this one reads 1 to "
                          f"{SCHEMA_VERSION})")
    out = dict(data)
    steps = _UPGRADES.get(model, {})
    for v in range(version, SCHEMA_VERSION):
        if v in steps:
            out = steps[v](out)
    out["schema_version"] = SCHEMA_VERSION
    return out


R = TypeVar("R", bound=Record)


def load(model: type[R], data: Any) -> R:
    """A record file's JSON object as `model`, migrated and validated as JSON (strict types), or RecordError."""
    if not isinstance(data, dict):
        raise RecordError(f"a {type(data).__name__}, not a JSON object")
    try:
        return model.model_validate_json(json.dumps(migrate(model, data)), strict=True)
    except ValidationError as exc:
        raise RecordError(problem(exc)) from None


def _shown(value: Any, limit: int = 60) -> str:
    text = repr(value)  # repr: control characters from a file are escaped, never sent to the console
    return text if len(text) <= limit else text[:limit] + "…"


def problem(exc: ValidationError) -> str:
    """pydantic's error as one line: `field.path: value: problem` (the first error, and how many more)."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    where = ".".join(str(p) for p in first["loc"]) or "(record)"
    if first["type"] == "missing":
        line = f"{where}: missing"
    else:
        line = f"{where}: {_shown(first['input'])}: {first['msg'][0].lower()}{first['msg'][1:]}"
    return line + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")
