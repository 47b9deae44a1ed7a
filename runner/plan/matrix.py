"""matrix.toml → a validated, frozen Matrix.

Each table of the file is one declared pydantic model (`[run]` RunSettings, `[servers.X]` ServerProfile,
`[cards.X]` Card, `[flags.X]` FlagSet, `[fixtures.X]` Fixture, `[matrix]` Axes, `[baseline]` Baseline,
`[verdict]` VerdictRules; MatrixFile is the whole file): validation, defaults, the field descriptions and
the published JSON Schema (runner/schema/matrix.schema.json) all come from that one declaration, and the
validated models are what the rest of the runner reads. What needs two tables (a card's server, the axes'
names, the baseline cell) is checked by the small functions after them.

Every problem becomes one UserError line naming the file, the key and the value; unknown keys are errors
(a typo must not silently fall back to a default). Paths are relative to the matrix file's folder.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import stat
import sys
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from runner.core.errors import UserError
from runner.core.registry import BACKENDS, DIALECTS, METERS, BackendOptions, OptionError, Options, listed_meters
from runner.core.units import slug
from runner.core.vocab import Role, names
from runner.observe.traceback import SERVER_PACKAGES
from runner.plan.sequential import looks

# Allowed values come from runner.core.vocab and the registries (read at load: an entry added later counts).
ROLES = names(Role)
MAX_SIDE = 16384  # pixels per side of a requested image
MAX_TIMEOUT_S = 7 * 86400  # a timeout longer than a week is a typo, and must not mean "forever"
PLACEHOLDERS = ("port", "host", "model", "python", "card", "gpu", "vram_gib", "flags")
MAX_MATRIX_BYTES = 4 * 2**20
MIN_SAMPLE_HZ = 0.1  # one sample every 10 s: slower says nothing about a request's peak
MAX_REFERENCES = 64

# Card, flag-set, fixture, server and run names become folder and container names: identifiers only.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
NAME_RULE = "1-64 characters: letters, digits, '-', '_', '.'; starting with a letter or digit"
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ENV_NAME_RULE = "letters, digits, '_'; not starting with a digit"
SIZE_RE = re.compile(r"[0-9]+[xX][0-9]+")
# What a failed `pattern` means, in the matrix's words (pydantic's own line would print the regex).
PATTERN_WORDS = {f"^{NAME_RE.pattern}$": f"must be a name ({NAME_RULE})",
                 f"^{ENV_NAME_RE.pattern}$": f"is not an environment variable name ({ENV_NAME_RULE})",
                 "^/": "must start with '/'"}

# A template holds literal text, `{{` / `}}` (literal braces), `{name}` placeholders (names only: no format
# spec, conversion, attribute or index — str.format would evaluate those) and, in env values, `${VAR}`: a
# variable of the runner's own environment, resolved only when the server starts (never stored).
TEMPLATE_TOKEN = re.compile(r"\$\{([^{}]*)\}|\{\{|\}\}|\{([^{}]*)\}|[{}]")


class UnknownKey(OptionError):
    """A key the file may not set (a value the loader derives: a table's name, a card's options)."""

    def __init__(self, key: str) -> None:
        super().__init__(key, "is not a key of this table")


# --- value types: each carries its own check, so the models below only name them ---------------------------


def _show(value: Any) -> str:
    if isinstance(value, tuple):  # TOML arrays become tuples before their items are checked
        value = list(value)
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _as_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value  # the models are frozen: arrays become tuples


def _template_error(text: str, *, env_refs: bool) -> str | None:
    for m in TEMPLATE_TOKEN.finditer(text):
        token = m.group(0)
        if token in ("{{", "}}"):
            continue
        if m.group(1) is not None:
            if not env_refs:
                return f"references {token}; runner environment references are allowed only in env values"
            if not ENV_NAME_RE.fullmatch(m.group(1)):
                return f"references {_show(token)}, which is not an environment variable name"
            continue
        if m.group(2) is None:
            return f"has a lone {token!r} in {_show(text)} (write {token * 2} for a literal brace)"
        if m.group(2) not in PLACEHOLDERS:
            return (f"uses unknown placeholder {token[:40]} (known: {', '.join(PLACEHOLDERS)}; placeholders "
                    f"are names only; write {{{{ and }}}} for literal braces)")
    return None


def env_refs(text: str) -> list[str]:
    """The runner environment variables a template references (`${VAR}`)."""
    return [m.group(1) for m in TEMPLATE_TOKEN.finditer(text) if m.group(1) is not None]


def _template(text: str) -> str:
    """Placeholders must be known: a typo would otherwise reach the server verbatim."""
    if problem := _template_error(text, env_refs=False):
        raise ValueError(problem)
    return text


def _env_template(text: str) -> str:
    if problem := _template_error(text, env_refs=True):
        raise ValueError(problem)
    return text


def _env_scalar(value: Any) -> Any:
    """`X = 1` in an env table means the string "1" (a finite number; never true/false)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return str(value)
    return value


def _one_of(known: Callable[[], tuple[str, ...]]) -> Callable[[str], str]:
    """A vocabulary's names are read when a matrix is validated: a registry entry added later counts."""
    def check(value: str) -> str:
        if value not in known():
            raise ValueError(f"must be one of {', '.join(known())}, got {_show(value)}")
        return value
    return check


def _enum(known: Callable[[], tuple[str, ...]]) -> Callable[[dict[str, Any]], None]:
    """The names as the schema's enum, read when the schema is generated."""
    return lambda schema: schema.update(enum=list(known()))


def _unique(what: str) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    def check(items: tuple[Any, ...]) -> tuple[Any, ...]:
        dup = next((x for x in items if items.count(x) > 1), None)
        if dup is not None:
            raise ValueError(f"names {_show(dup)} twice" if what == "name" else
                             f"holds {what} {dup} twice (its records would overwrite each other)")
        return items
    return check


def _size(value: Any) -> Any:
    if not isinstance(value, str):
        return value  # None, or a (w, h) given in Python; anything else fails the type below
    if not SIZE_RE.fullmatch(value) or not all(int(x) > 0 for x in value.lower().split("x")):
        raise ValueError(f"must look like '1024x1024', got {_show(value)}")
    w, h = (int(x) for x in value.lower().split("x"))
    if max(w, h) > MAX_SIDE:
        raise ValueError(f"must be at most {MAX_SIDE}x{MAX_SIDE}, got {_show(value)}")
    return (w, h)


def _under_base(value: Any, info: ValidationInfo) -> Any:
    """A path as written, relative to the matrix file's folder (`~` expanded)."""
    if isinstance(value, str):
        if not value.strip() or "\0" in value:
            raise ValueError(f"must be a path, got {_show(value)}")
        value = Path(value).expanduser()
    base = info.context.base if isinstance(info.context, _Context) else None
    return base / value if base is not None and isinstance(value, Path) else value


def _repeats(value: Any) -> Any:
    if value == "auto" or (type(value) is int and 1 <= value <= 100):
        return value
    raise ValueError(f'must be "auto" or an integer from 1 to 100, got {_show(value)}')


T = TypeVar("T")
Seq = Annotated[tuple[T, ...], BeforeValidator(_as_tuple)]  # a TOML array, kept as a tuple
Name = Annotated[str, Field(pattern=f"^{NAME_RE.pattern}$")]
EnvName = Annotated[str, Field(pattern=f"^{ENV_NAME_RE.pattern}$")]
EnvValue = Annotated[str, BeforeValidator(_env_scalar, json_schema_input_type=str | int | float),
                     AfterValidator(_env_template)]
Env = Annotated[Mapping[EnvName, EnvValue], Field(
    description="environment variables: strings (numbers are taken as text); `{placeholder}` and "
                "`${RUNNER_VAR}` (the runner's own environment, resolved at start, never stored) allowed")]
Arg = Annotated[str, AfterValidator(_template)]
RelPath = Annotated[Path, BeforeValidator(_under_base, json_schema_input_type=str)]
Seed = Annotated[int, Field(ge=0, le=2**63 - 1)]
Count = Annotated[int, Field(ge=0, le=MAX_REFERENCES)]
Timeout = Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S)]
RoleName = Annotated[str, AfterValidator(_one_of(lambda: ROLES)), Field(json_schema_extra=_enum(lambda: ROLES))]
BackendName = Annotated[str, AfterValidator(_one_of(BACKENDS.names)), Field(json_schema_extra=_enum(BACKENDS.names))]
DialectName = Annotated[str, AfterValidator(_one_of(DIALECTS.names)), Field(json_schema_extra=_enum(DIALECTS.names))]
MeterName = Annotated[str, AfterValidator(_one_of(listed_meters)), Field(json_schema_extra=_enum(listed_meters))]


def _no_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)  # the default depends on other keys (the description says which)


@dataclass(frozen=True)
class _Context:
    """What validation needs besides the file: the folder relative paths start from."""

    base: Path


class Table(BaseModel):
    """One table of matrix.toml: strict TOML types (`steps = "4"`, `steps = true` are errors), finite
    numbers, unknown keys refused, frozen."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False,
                              populate_by_name=False)
    derived: ClassVar[tuple[str, ...]] = ()  # fields the loader fills in; the file may not set them

    @model_validator(mode="before")
    @classmethod
    def _from_toml(cls, data: Any, info: ValidationInfo) -> Any:
        if isinstance(data, dict) and isinstance(info.context, _Context):
            if stray := next((k for k in data if k in cls.derived), None):
                raise UnknownKey(stray)
            return cls.prepare(data)
        return data

    @classmethod
    def prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        """The table as written → what the model validates (defaults that depend on other keys)."""
        return data


# --- the tables ----------------------------------------------------------------------------------------------


class RunSettings(Table):
    """[run]: what each request holds and how the run behaves."""

    name: Name = Field("run", json_schema_extra=_no_default,
                       description="run name (default: the file's stem); the run id is `<name>-<UTC time>`")
    seeds: Annotated[Seq[Seed], AfterValidator(_unique("seed"))] = Field(
        (0,), min_length=1, description="every step is repeated for each seed (each listed once)")
    steps: int = Field(20, gt=0, description="`num_inference_steps` sent with each request")
    size: Annotated[tuple[int, int] | None, BeforeValidator(
        _size, json_schema_input_type=Annotated[str, Field(pattern=f"^{SIZE_RE.pattern}$")])] = Field(
        None, description='output size "WxH" sent with each request, at most 16384 a side (default: the '
                          "server's)")
    true_cfg_scale: float | None = Field(None, description="true CFG scale sent (default: not sent); vLLM-Omni "
                                                           "0.30 runs true CFG only with a negative_prompt")
    negative_prompt: str | None = Field(None, description="sent as is (default: not sent)")
    request_timeout_s: Timeout = Field(600, description="total deadline of one request's answer, seconds")
    ready_timeout_s: Timeout = Field(900, description="total deadline for the server to answer health_path")
    results_dir: Annotated[RelPath, AfterValidator(Path.resolve)] = Field(
        Path("results"), validate_default=True, description="where `<run-id>/` is written (--results overrides)")
    stop_after_oom: bool = Field(True, description="an OOM at n references implies the larger counts of that "
                                                   "session (recorded as skipped, not sent)")
    restarts: int = Field(1, ge=0, le=100, description="server restarts allowed per session after a crash")
    determinism_check: bool = Field(True, description="send each session's first step once more, untimed "
                                                      "(repeats = 1 or auto), and compare the images")
    repeats_setting: Annotated[Annotated[int, Field(ge=1, le=100)] | Literal["auto"], BeforeValidator(_repeats)] \
        = Field("auto", alias="repeats",
                description='"auto": one timed send per step, more only where a latency ratio is open; an '
                            "integer: timed sends of each step's request")
    max_repeats_setting: int | None = Field(None, alias="max_repeats", ge=2, le=100,
                                            description='repeats = "auto" only: the most timed sends of one '
                                                        "step (default 8)")
    oom_implies_seeds: bool = Field(True, description="with stop_after_oom: an OOM at n references also "
                                                      "implies the remaining seeds at n")
    require_idle_gpu: bool = Field(False, description="a GPU held by a foreign process stops the session")
    diagnosis: Literal["off", "oom", "always"] = Field(
        "oom", description="the diagnosis pass: for a flag set decided by a device OOM, restart its server "
                           "with the allocator history on, send the deciding request once more and collect the "
                           "allocator snapshot (never a timed sample or a peak); always: also the peaks of the "
                           "highest and the lowest served reference counts (which site grows per reference); "
                           "off: none")
    # A floor as well as a ceiling: a rate near zero is a sampling period beyond any clock (1e-300 Hz).
    sample_hz: float = Field(20, ge=MIN_SAMPLE_HZ, le=1000,
                             description="meter sampling rate (each meter caps it to what its source sustains)")
    quiet_s: float = Field(0.3, ge=0, le=60, allow_inf_nan=False,
                           description="the quiet window after each request (and after a server is ready) in which "
                                       "the meters read the level it left behind (`floor_after`); 0: no floors")

    @model_validator(mode="after")
    def _max_repeats_with_auto(self) -> RunSettings:
        if self.max_repeats_setting is not None and self.repeats_setting != "auto":
            raise OptionError("max_repeats", f'applies only to repeats = "auto", but repeats = '
                                             f"{self.repeats_setting}")
        return self

    @property
    def auto_repeats(self) -> bool:
        """repeats = "auto": one timed send per step, more only where a latency ratio is open
        (runner.plan.sequential)."""
        return self.repeats_setting == "auto"

    @property
    def repeats(self) -> int:
        """Timed sends of each step on the first pass (auto: 1); with >= 2 their image bytes are compared."""
        return 1 if self.repeats_setting == "auto" else self.repeats_setting

    @property
    def max_repeats(self) -> int:
        """The most timed sends of one step (a fixed count: that count)."""
        if self.repeats_setting == "auto":
            return self.max_repeats_setting or 8
        return self.repeats_setting


class Mount(Table):
    """One bind mount of a container."""

    source: str = Field(description="a path on the GPU host")
    target: str = Field(description="the path inside the container")
    read_only: bool = Field(True, description="mounted read-only")


class ServerProfile(Table):
    """[servers.NAME]: the server's shape, declared once: the plan and the backend read it from here."""

    name: SkipJsonSchema[str]  # the table's name
    command: Seq[Arg] = Field((), description="the command (local) or the container's arguments (docker); "
                                              "required without image; placeholders: " + ", ".join(PLACEHOLDERS))
    image: str | None = Field(None, description="container image (docker and other image backends)")
    vllm_omni: str | None = Field(None, pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$",
                                  description="the vLLM-Omni release the server runs: flag sets are checked "
                                              "against its command line before anything starts "
                                              "(runner/plan/vllm_omni_flags/); default: the image's tag when "
                                              "it names one (vllm-omni:v0.30.0)")
    port: int = Field(0, ge=0, le=65535, json_schema_extra=_no_default,
                      description="the port the server listens on; 0 (the default without image): a free port "
                                  "picked at each start; 8000 with an image")
    health_path: str = Field("/health", pattern="^/", description="readiness: GET returns 200")
    model_packages: Seq[str] = Field((), description="Python packages whose frames are the served model's own "
                                                     "code (e.g. [\"diffusers\"] when the model's forward is "
                                                     "diffusers'): an OOM's site may be one of their lines")
    dialect: DialectName = Field("vllm-omni-chat", description="the request API")
    model: str = Field("", json_schema_extra=_no_default,
                       description="the `model` field sent (default: the profile's name)")
    env: Env = {}
    mounts: Seq[Mount] = Field((), description="bind mounts (docker)")
    shm_size: str | None = Field(None, description="container shared memory size")
    ipc_mode: str | None = Field(None, description="container IPC mode")

    @classmethod
    def prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        return {"port": 0 if data.get("image") is None else 8000, "model": data.get("name", ""), **data}

    @property
    def own_packages(self) -> tuple[str, ...]:
        """The packages an OOM's or a snapshot block's site may be in: the servers' own and the model's."""
        return (*SERVER_PACKAGES, *self.model_packages)

    @model_validator(mode="after")
    def _runs_something(self) -> ServerProfile:
        if not self.command and not self.image:
            raise OptionError("command", "is required when no image is given")
        return self


def _options(model: type[Options], data: dict[str, Any]) -> Any:
    """One kind's card keys through its declared model; a problem names the key."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        if isinstance(cause := (err.get("ctx") or {}).get("error"), OptionError):
            raise cause from None
        key = ".".join(str(x) for x in err["loc"][:1]) or next(iter(data), "")
        got = f", got {_show(err['input'])}" if err["type"] == "value_error" else ""  # the entries' own words
        raise OptionError(key, _problem(err) + got) from None


class Card(Table):
    """[cards.NAME]: where a server runs. A backend's and a meter's own keys (docker_host, dcgm_url, …) are
    declared by their registry entries (runner.core.registry) and validated through them."""

    derived = ("options", "meter_options")
    name: SkipJsonSchema[str]  # the table's name
    server: str = Field(description="a [servers] name")
    backend: BackendName = Field("local", description="where the server runs (a runner.core.registry.BACKENDS entry)")
    gpu: Annotated[str | None, BeforeValidator(
        lambda v: str(v) if type(v) is int else v, json_schema_input_type=str | int | None)] = Field(
        None, description="GPU index or UUID")
    vram_gib_setting: float | None = Field(None, alias="vram_gib", gt=0,
                                           description="the card's capacity in GiB (exactly one of vram_gib "
                                                       "and vram_mib)")
    vram_mib: float | None = Field(None, gt=0, description="the same capacity in MiB, for tiny emulated cards")
    meters: Seq[MeterName] = Field(("server", "host"), description="memory sources in order of trust")
    env: Env = {}
    # The backend's own card keys (docker: docker_host, publish_host), validated by its entry's model.
    options: SkipJsonSchema[BackendOptions] = BackendOptions()
    meter_options: SkipJsonSchema[Mapping[str, Options]] = {}  # per listed meter that reads card keys

    @property
    def vram_gib(self) -> float:
        return self.vram_gib_setting if self.vram_gib_setting is not None else (self.vram_mib or 0.0) / 1024

    @model_validator(mode="after")
    def _one_capacity(self) -> Card:
        if (self.vram_gib_setting is None) == (self.vram_mib is None):
            raise OptionError("vram_gib", "is required (or vram_mib), exactly one of the two")
        key = "vram_gib" if self.vram_gib_setting is not None else "vram_mib"
        value = self.vram_gib_setting if self.vram_gib_setting is not None else self.vram_mib
        if not 2**20 <= self.vram_gib * 2**30 < 2**50:  # a capacity in whole MiB, below 1 PiB (observe.reading)
            raise OptionError(key, f"must be a device's capacity, at least 1 MiB and below 1 PiB, got {value:g}")
        return self

    @classmethod
    def prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Takes the registry entries' keys out of the table and validates them through their models."""
        data = dict(data)
        backend = data.get("backend", "local")
        if not isinstance(backend, str) or backend not in BACKENDS:
            raise OptionError("backend", f"must be one of {', '.join(BACKENDS.names())}, got {_show(backend)}")
        entry = BACKENDS.get(backend)
        for other in BACKENDS.entries():
            stray = next((k for k in other.options.model_fields if k in data), None)
            if other is not entry and stray and stray not in entry.options.model_fields:
                raise OptionError(stray, f"applies to backend '{other.name}' only, not to this card's '{backend}'")
        data["options"] = _options(entry.options, {k: data.pop(k) for k in entry.options.model_fields if k in data})
        meters = data.get("meters", ("server", "host"))
        listed = meters if isinstance(meters, (list, tuple)) else ()
        meter_options = {}
        for m in METERS.entries():
            if m.options is None:
                continue
            given = {k: data.pop(k) for k in m.options.model_fields if k in data}
            if m.name in listed or given:
                missing = next((k for k, f in m.options.model_fields.items() if k not in given and f.is_required()),
                               None)
                if missing and m.name in listed and not (m.name == "sidecar" and entry.starts_sidecar):
                    raise OptionError(missing, f"is required when meters includes '{m.name}'")
                if not missing:
                    meter_options[m.name] = _options(m.options, given)
        data["meter_options"] = meter_options
        return data


class FlagSet(Table):
    """[flags.NAME]: one flag set, a session per card."""

    name: SkipJsonSchema[str]  # the table's name
    role: RoleName = Field(
        "other", description="what the verdict makes of it: default decides fits-resident, offload roles "
                             "decide offload-works")
    args: Seq[Arg] = Field((), description="appended to the server command")
    env: Env = {}
    description: str = Field("", description="shown in the plan")


class Fixture(Table):
    """[fixtures.NAME]: what to send."""

    name: SkipJsonSchema[str]  # the table's name
    prompt: str = Field(description="the text part of the request")
    references: Seq[RelPath] = Field((), description="reference images in order; a step with n references "
                                                     "sends the first n")


class Exclude(Table):
    """One cell left out; a key left out matches every card (or flag set)."""

    card: str | None = Field(None, description="a card name")
    flags: str | None = Field(None, description="a flag set name")


class Axes(Table):
    """[matrix]: the axes (cards × flag sets × fixtures × reference counts × seeds)."""

    cards: Annotated[Seq[str], AfterValidator(_unique("name"))] = Field(
        (), json_schema_extra=_no_default, description="lanes, run concurrently (default: every card)")
    flags: Annotated[Seq[str], AfterValidator(_unique("name"))] = Field(
        (), json_schema_extra=_no_default, description="sessions within a lane, in this order (default: all)")
    references: Annotated[Seq[Count], AfterValidator(lambda v: tuple(sorted(set(v))))] = Field(
        (1,), min_length=1, description="reference counts (0-64), run ascending")
    fixtures: Annotated[Seq[str], AfterValidator(_unique("name"))] = Field(
        (), json_schema_extra=_no_default, description="fixtures sent (default: all)")
    exclude: Seq[Exclude] = Field((), description="card × flag set cells to leave out")

    def kept(self, card: str, flags: str) -> bool:
        """Whether the card × flag set cell runs (no `exclude` entry matches it)."""
        return not any((ex.card or card) == card and (ex.flags or flags) == flags for ex in self.exclude)


def _cell(value: Any) -> Any:
    if isinstance(value, str):
        card, _, flags = value.rpartition("/")
        return (card or None, flags)
    return value


class Baseline(Table):
    """[baseline]: what to score against: exactly one of dir and cell."""

    directory: RelPath | None = Field(None, alias="dir",
                                      description="a sealed folder holding samples.json (fixture + references "
                                                  "+ seed → image file)")
    cell: Annotated[tuple[str | None, str] | None, BeforeValidator(_cell, json_schema_input_type=str)] = Field(
        None, description="'CARD/FLAGS' (another cell of this run) or 'FLAGS' (each card's own session)")

    @model_validator(mode="after")
    def _one_source(self) -> Baseline:
        if (self.directory is None) == (self.cell is None):
            raise OptionError("", "needs exactly one of 'dir' or 'cell'")
        return self


class VerdictRules(Table):
    """[verdict]: how a card is judged."""

    derived = ("latency_looks", "latency_max_repeats")
    target_references: int = Field(0, json_schema_extra=_no_default,
                                   description="the reference count that matters (default: the largest)")
    max_latency_ratio: float = Field(2.5, gt=0, description="an offload flag set's latency over the reference "
                                                            "latency, judged with its interval")
    min_psnr_db: float = Field(20.0, ge=0, le=100, description="below it an image does not count as served "
                                                              "(100 dB: the cap for identical images)")
    offload_roles: Seq[RoleName] = Field(("offload",), description="roles that can make offload-works")
    max_transparent_share: float = Field(0.5, ge=0, le=1, description="more fully transparent pixels than this "
                                                                      "= broken output")
    min_pixel_std: float = Field(2.0, ge=0, le=255, description="RGB std below this = flat/grey = broken output")
    # How often a latency ratio may be looked at ([run] repeats = "auto": runner.plan.sequential.looks); 1: one
    # fixed set of sends, judged once by the percentile bootstrap.
    latency_looks: SkipJsonSchema[int] = 1
    # [run] max_repeats under auto (0: an integer `repeats`): a ratio still open there is not "rerun with more".
    latency_max_repeats: SkipJsonSchema[int] = 0

    def decides_world(self, role: str) -> bool:
        """Whether a flag set of this role can decide a card's world: `default`, or one of offload_roles."""
        return role == "default" or role in self.offload_roles


MAX_SOAK_REQUESTS = 1_000_000  # a soak longer than this is a typo; 10,000 is a long one (docs/benchmarks.md)


def _listed_once(items: tuple[Any, ...]) -> tuple[Any, ...]:
    dup = next((x for x in items if items.count(x) > 1), None)
    if dup is not None:
        raise ValueError(f"lists {_show(dup)} twice")
    return items


class Soak(Table):
    """[soak]: the profile in service. After a card's sessions, each soaked flag set gets a fresh server start and
    `requests` requests one at a time, its reference counts mixed in `order` (seeds and fixtures cycle as the
    matrix's do); recorded apart (<card>/<flags>/soak/), never a timed sample or a peak of a matrix cell. A soak
    stops at its first failure, at `requests` or at `minutes`."""

    requests: int = Field(ge=1, le=MAX_SOAK_REQUESTS, description="requests sent to each soaked flag set, one at "
                                                                  "a time, on one server start")
    minutes: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S / 60,
                                  description="optional bound per soaked flag set (its requests' time, summed "
                                              "over its server starts); the soak stops at whichever comes first")
    references: Annotated[Seq[Count], AfterValidator(_listed_once)] | None = Field(
        None, min_length=1, json_schema_extra=_no_default,
        description="the reference counts it mixes (default: the matrix's), each listed once")
    order: Literal["cycle", "shuffle"] = Field(
        "cycle", description='"cycle": the counts in ascending order, repeated; "shuffle": each round of the '
                             "counts in a random order drawn from `seed`")
    seed: Seed = Field(0, description='order = "shuffle": the seed of its random order (the same soak on a resume)')
    # An empty list would soak nothing without a word (the plan still promising a soak): refused, as references.
    flags: Annotated[Seq[str], AfterValidator(_unique("name"))] | None = Field(
        None, min_length=1, json_schema_extra=_no_default,
        description="which flag sets (default: those profiles.json lists for the card at every count the soak "
                    "mixes, known after the card's sessions)")
    cards: Annotated[Seq[str], AfterValidator(_unique("name"))] | None = Field(
        None, min_length=1, json_schema_extra=_no_default, description="which cards (default: every card of the "
                                                                        "matrix)")

    @property
    def counts(self) -> tuple[int, ...]:
        """The counts it mixes, ascending (set by the loader: the matrix's when the table names none)."""
        return tuple(sorted(self.references or ()))


NAMED = ("servers", "cards", "flags", "fixtures")


class MatrixFile(Table):
    """matrix.toml: one probe — servers, cards × flag sets, fixtures × reference counts × seeds, the
    baseline and the verdict rules (docs/matrix.md)."""

    run: RunSettings = Field(default_factory=RunSettings, description="[run]: the requests and the run")
    servers: Mapping[Name, ServerProfile] = Field({}, description="how to start each server")
    cards: Mapping[Name, Card] = Field({}, description="where: a card per GPU (or emulated GPU)")
    flags: Mapping[Name, FlagSet] = Field({}, description="the flag sets, a session each per card")
    fixtures: Mapping[Name, Fixture] = Field({}, description="what to send")
    axes: Axes = Field(default_factory=Axes, alias="matrix", description="the axes")
    baseline: Baseline | None = Field(None, description="what to score against (optional)")
    verdict: VerdictRules = Field(default_factory=VerdictRules, description="how to judge")
    soak: Soak | None = Field(None, description="the soak: each soaked flag set in service, many requests on one "
                                                "server start (optional)")

    @classmethod
    def prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        """A named table's name is its key (the file may not set `name` inside it)."""
        data = dict(data)
        for section in NAMED:
            tables = data.get(section)
            if isinstance(tables, dict):
                for key, table in tables.items():
                    if isinstance(table, dict) and "name" in table:
                        raise UnknownKey(f"{section}.{key}.name")
                data[section] = {k: {**t, "name": k} if isinstance(t, dict) else t for k, t in tables.items()}
        return data


# --- pydantic's errors as the matrix's one-line errors ---------------------------------------------------------


TYPE_WORDS = {"int_type": "must be an integer", "float_type": "must be a number", "string_type": "must be a string",
              "bool_type": "must be true or false", "list_type": "must be a list", "tuple_type": "must be a list",
              "dict_type": "must be a table", "mapping_type": "must be a table", "model_type": "must be a table",
              "model_attributes_type": "must be a table", "finite_number": "must be a finite number",
              "missing": "is required"}


def _problem(err: Any, loc: tuple[Any, ...] = ()) -> str:
    """What is wrong, in the matrix's words (our validators' messages as written), with the value."""
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    bounds = {"greater_than": "> {gt}", "greater_than_equal": ">= {ge}", "less_than": "< {lt}",
              "less_than_equal": "<= {le}"}
    if kind in bounds:
        words = _range_words(loc) or "must be " + bounds[kind].format(**{k: f"{v:g}" for k, v in ctx.items()})
    elif kind == "too_short":
        words = f"must hold at least {ctx.get('min_length')} item(s)"
    elif kind == "too_long":
        words = f"must hold at most {ctx.get('max_length')} item(s)"
    elif kind == "string_pattern_mismatch":
        words = PATTERN_WORDS.get(str(ctx.get("pattern")), f"must match {ctx.get('pattern')}")
    elif kind == "literal_error":
        words = f"must be {ctx.get('expected')}"
    else:
        words = TYPE_WORDS.get(kind) or (err["msg"][:1].lower() + err["msg"][1:])
    return words if kind == "missing" else f"{words}, got {_show(err.get('input'))}"


@cache
def _declared() -> dict[str, Any]:
    return MatrixFile.model_json_schema(mode="validation")


def _range_words(loc: tuple[Any, ...]) -> str | None:
    """Both bounds of the number at `loc` (pydantic names only the one that failed), from the schema."""
    doc = _declared()

    def resolved(node: Any) -> Any:
        while isinstance(node, dict) and ("$ref" in node or "anyOf" in node):
            node = doc["$defs"][node["$ref"].rsplit("/", 1)[-1]] if "$ref" in node else node["anyOf"][0]
        return node if isinstance(node, dict) else {}

    node: Any = doc
    for part in loc:
        node = resolved(node)
        node = node.get("items") if isinstance(part, int) else \
            node.get("properties", {}).get(part) or next(iter(node.get("patternProperties", {}).values()), None)
    node = resolved(node)
    num = {k: f"{v:g}" if isinstance(v, float) else str(v) for k, v in node.items() if k.endswith(("imum", "Minimum"))}
    low = next((f"{op} {num[k]}" for k, op in (("minimum", ">="), ("exclusiveMinimum", ">")) if k in num), None)
    high = next((f"{op} {num[k]}" for k, op in (("maximum", "<="), ("exclusiveMaximum", "<")) if k in num), None)
    if "minimum" in num and "maximum" in num:
        return f"must be between {num['minimum']} and {num['maximum']}"
    return f"must be {' and '.join(b for b in (low, high) if b)}" if low or high else None


def _key(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _user_error(file: Path, exc: ValidationError) -> UserError:
    """The first problem as `<file>: key '<a.b.c>' <problem>, got <value>`."""
    err = exc.errors()[0]
    loc = tuple(err["loc"])
    if loc and loc[-1] == "[key]":  # a table name (or an env name) that is not allowed
        loc = loc[:-1]
        if len(loc) == 2 and loc[0] in NAMED:
            return UserError(f"{file}: [{loc[0]}.{_show(loc[1])}] is not a valid name ({NAME_RULE})")
        return UserError(f"{file}: key '{_key(loc)}' {PATTERN_WORDS[f'^{ENV_NAME_RE.pattern}$']}")
    if err["type"] == "extra_forbidden":
        return UserError(f"{file}: unknown key '{_key(loc)}'")
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, OptionError):
        where = ".".join(x for x in (_key(loc), cause.key) if x)
        if isinstance(cause, UnknownKey):
            return UserError(f"{file}: unknown key '{where}'")
        if not cause.key:
            return UserError(f"{file}: [{where}] {cause.problem}")
        return UserError(f"{file}: key '{where}' {cause.problem}")
    return UserError(f"{file}: key '{_key(loc)}' {_problem(err, loc)}")


# --- what needs two tables ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Matrix:
    """A loaded matrix.toml: the file (path, hash, text) and its validated tables, with the defaults that
    depend on other tables filled in. A plain dataclass: it is the loader's result, not a table of the file."""

    path: Path
    sha256: str
    text: str
    run: RunSettings
    servers: Mapping[str, ServerProfile]
    cards: Mapping[str, Card]
    flags: Mapping[str, FlagSet]
    fixtures: Mapping[str, Fixture]
    baseline: Baseline | None
    axes: Axes
    verdict: VerdictRules
    missing_files: tuple[Path, ...] = field(default=())
    soak: Soak | None = None  # [soak] with its defaults filled in (references: the matrix's)

    @property
    def most_references(self) -> int:
        """The most reference images any request sends: the matrix's largest count, or the soak's."""
        return max((*self.axes.references, *(self.soak.counts if self.soak else ())))


def _check_cards(doc: MatrixFile) -> None:
    for name, card in doc.cards.items():
        key = f"cards.{name}"
        if card.server not in doc.servers:
            raise UserError(f"key '{key}.server' names unknown server profile {_show(card.server)} "
                            f"(known: {', '.join(doc.servers)})")
        if BACKENDS.get(card.backend).needs_image and doc.servers[card.server].image is None:
            raise UserError(f"key '{key}.backend' is {card.backend} but server profile '{card.server}' has no image")


def _axes(doc: MatrixFile) -> Axes:
    """The axes with their defaults (every card, flag set and fixture), each name checked."""
    axes, known = doc.axes, {"cards": doc.cards, "flags": doc.flags, "fixtures": doc.fixtures}
    axes = axes.model_copy(update={k: tuple(v) for k, v in known.items() if k not in axes.model_fields_set})
    what = {"cards": "card", "flags": "flag set", "fixtures": "fixture"}
    for key, names_ in known.items():
        for n in getattr(axes, key):
            if n not in names_:
                raise UserError(f"key 'matrix.{key}' names unknown {what[key]} {_show(n)} "
                                f"(known: {', '.join(names_) or 'none'})")
    for i, ex in enumerate(axes.exclude):
        if ex.card is not None and ex.card not in doc.cards:
            raise UserError(f"key 'matrix.exclude[{i}].card' names unknown card {_show(ex.card)}")
        if ex.flags is not None and ex.flags not in doc.flags:
            raise UserError(f"key 'matrix.exclude[{i}].flags' names unknown flag set {_show(ex.flags)}")
    if not (axes.cards and axes.flags and axes.fixtures):
        empty = "cards" if not axes.cards else "flags" if not axes.flags else "fixtures"
        raise UserError(f"the matrix is empty: no {empty} (add a [{empty}.NAME] table)")
    if not any(axes.kept(c, f) for c in axes.cards for f in axes.flags):
        raise UserError(f"key 'matrix.exclude' leaves out every card × flag set cell: nothing would run, got "
                        f"{_show([ex.model_dump(exclude_none=True) for ex in axes.exclude])}")
    for fx in axes.fixtures:
        if len(doc.fixtures[fx].references) < max(axes.references):
            raise UserError(f"key 'fixtures.{fx}.references' holds {len(doc.fixtures[fx].references)} "
                            f"image(s) but the matrix asks for {max(axes.references)}")
    return axes


def _check_baseline(doc: MatrixFile) -> None:
    cell = doc.baseline.cell if doc.baseline else None
    if cell is not None and ((cell[0] and cell[0] not in doc.cards) or cell[1] not in doc.flags):
        raise UserError(f"key 'baseline.cell' must be 'CARD/FLAGS' or 'FLAGS' naming a card and a flag set, got "
                        f"{_show('/'.join(c for c in cell if c))}")


def _verdict(doc: MatrixFile, axes: Axes) -> VerdictRules:
    rules = doc.verdict
    if "target_references" not in rules.model_fields_set:
        rules = rules.model_copy(update={"target_references": max(axes.references)})
    if rules.target_references not in axes.references:
        raise UserError(f"key 'verdict.target_references' must be one of the matrix's reference counts "
                        f"{list(axes.references)}, got {rules.target_references}")
    if doc.run.auto_repeats:
        rules = rules.model_copy(update={"latency_looks": looks(doc.run.max_repeats),
                                         "latency_max_repeats": doc.run.max_repeats})
    return rules


def _soak(doc: MatrixFile, axes: Axes) -> Soak | None:
    """[soak] against the other tables: the cards and flag sets it names run in this matrix, every count it mixes
    is one each fixture can send; its counts default to the matrix's."""
    soak = doc.soak
    if soak is None:
        return None
    for key, names_, known, what, table in (("cards", soak.cards, axes.cards, "card", doc.cards),
                                            ("flags", soak.flags, axes.flags, "flag set", doc.flags)):
        for n in names_ or ():
            if n not in table:
                raise UserError(f"key 'soak.{key}' names unknown {what} {_show(n)} (known: {', '.join(table)})")
            if n not in known:
                raise UserError(f"key 'soak.{key}' names {what} {_show(n)}, which [matrix] {key} leaves out "
                                f"(runs: {', '.join(known)})")
    cards = soak.cards or axes.cards
    for f in soak.flags or ():
        if not any(axes.kept(c, f) for c in cards):
            raise UserError(f"key 'soak.flags' names flag set {_show(f)}, which no soaked card runs "
                            f"([matrix] exclude leaves it out on {', '.join(cards)})")
    counts = tuple(sorted(soak.references if soak.references is not None else axes.references))
    for fx in axes.fixtures:
        held = len(doc.fixtures[fx].references)
        if max(counts) > held:
            raise UserError(f"key 'soak.references' asks for {max(counts)} reference(s) but fixture {_show(fx)} "
                            f"holds {held} image(s)")
    return soak.model_copy(update={"references": counts})


def cfg_warning(run: RunSettings) -> str | None:
    """vLLM-Omni 0.30 runs true CFG only when `true_cfg_scale > 1` *and* a negative prompt is sent
    (pipeline_qwen_image_edit_plus.py), so a matrix without one measures single-pass generation."""
    if run.true_cfg_scale is None or run.negative_prompt is not None:
        return None
    return (f"[run] true_cfg_scale = {run.true_cfg_scale:g} without negative_prompt: vLLM-Omni 0.30 runs true "
            "CFG only when a negative prompt is sent, so these requests run single-pass there "
            "(set negative_prompt = \" \" to get CFG)")


def _read(file: Path) -> bytes:
    try:
        st = file.stat()
        # Stat first: a FIFO (or /dev/zero) passed as the matrix would block the read forever.
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"{file}: cannot read matrix: not a regular file")
        if st.st_size > MAX_MATRIX_BYTES:
            raise UserError(f"{file}: cannot read matrix: {st.st_size} bytes (at most {MAX_MATRIX_BYTES})")
        return file.read_bytes()
    except OSError as exc:
        raise UserError(f"{file}: cannot read matrix: {exc.strerror}") from None


def load_matrix(path: str | Path, *, check_files: bool = True, base: Path | None = None) -> Matrix:
    """`base` is the folder relative paths start from (default: the file's own folder)."""
    file = Path(path)
    raw = _read(file)
    text = raw.decode("utf-8", errors="replace")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{file}: TOML syntax error: {exc}") from None
    base = base or file.resolve().parent
    if isinstance(run := data.get("run", {}), dict) and "name" not in run:
        data["run"] = {**run, "name": slug(file.stem).strip(".-_")[:64] or "run"}
    try:
        doc = MatrixFile.model_validate(data, context=_Context(base))
        _check_cards(doc)
        axes = _axes(doc)
        _check_baseline(doc)
        verdict = _verdict(doc, axes)
        soak = _soak(doc, axes)
    except ValidationError as exc:
        raise _user_error(file, exc) from None
    except UserError as exc:
        raise UserError(f"{file}: {exc}") from None
    if (why := cfg_warning(doc.run)) is not None:
        print(f"runner: warning: {file}: {why}", file=sys.stderr)

    most = max((*axes.references, *(soak.counts if soak else ())))  # what Matrix.most_references says
    needed = [(f"fixtures.{fx}.references[{i}]", "reference image", p) for fx in axes.fixtures
              for i, p in enumerate(doc.fixtures[fx].references[:most])]
    if doc.baseline and doc.baseline.directory is not None:
        needed.append(("baseline.dir", "baseline file", doc.baseline.directory / "samples.json"))
    absent = [(key, kind, p) for key, kind, p in needed if not p.is_file()]
    if check_files and absent:
        key, kind, missing = absent[0]
        what = "is not a regular file" if missing.exists() else "not found"
        raise UserError(f"{file}: key '{key}': {kind} {what}: {missing}")
    return Matrix(path=file, sha256=hashlib.sha256(raw).hexdigest(), text=text, run=doc.run,
                  servers=doc.servers, cards=doc.cards, flags=doc.flags, fixtures=doc.fixtures,
                  baseline=doc.baseline, axes=axes, verdict=verdict, missing_files=tuple(p for _, _, p in absent),
                  soak=soak)


# --- the published schema ---------------------------------------------------------------------------------------


def _draft4(node: Any) -> Any:
    """pydantic's schema → JSON Schema draft 4, what taplo (Even Better TOML) validates with. TOML has no
    null: optional keys are simply left out, so `null` goes; env tables take only the keys they declare."""
    if isinstance(node, list):
        return [_draft4(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _draft4(v) for k, v in node.items() if not (k == "default" and v is None) and k != "title"}
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if node.get("type") == "array":  # pydantic names a list's length bound over a BeforeValidator as a string's
        for text, items in (("minLength", "minItems"), ("maxLength", "maxItems")):
            if text in node:
                node[items] = node.pop(text)
    for bound, strict in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if isinstance(node.get(strict), (int, float)) and not isinstance(node[strict], bool):
            node[bound], node[strict] = node[strict], True
    if "anyOf" in node:
        kept = [s for s in node.pop("anyOf") if s != {"type": "null"}]
        node.update(kept[0] if len(kept) == 1 else {"anyOf": kept})
    if "patternProperties" in node:
        node.setdefault("additionalProperties", False)
    return node


def json_schema() -> dict[str, Any]:
    """matrix.toml's JSON Schema (draft 4), from the models above plus the registry entries' card keys."""
    doc = MatrixFile.model_json_schema(mode="validation", ref_template="#/definitions/{model}")
    doc["definitions"] = doc.pop("$defs")
    card = doc["definitions"]["Card"]
    rules: list[dict[str, Any]] = []
    for kind, entries in (("backend", BACKENDS.entries()), ("meter", METERS.entries())):
        for entry in entries:
            if entry.options is None:
                continue
            sub = entry.options.model_json_schema()
            for key, prop in sub.get("properties", {}).items():
                prop = dict(prop)
                prop["description"] = f"{kind} {entry.name}: {prop.get('description', '')}".rstrip(": ")
                card["properties"].setdefault(key, prop)
            if kind == "backend" and sub.get("required"):  # "if backend = NAME then these keys" in draft 4 words
                rules.append({"anyOf": [{"not": {"properties": {"backend": {"enum": [entry.name]}},
                                                 "required": ["backend"]}},
                                        {"required": sub["required"]}]})
    owners: dict[str, list[str]] = {}  # a backend's key on another backend's card is an error
    for backend in BACKENDS.entries():
        for key in backend.options.model_fields:
            owners.setdefault(key, []).append(backend.name)
    for key, names_ in owners.items():
        allowed: list[dict[str, Any]] = [{"not": {"required": [key]}},
                                         {"properties": {"backend": {"enum": names_}}, "required": ["backend"]}]
        if "local" in names_:
            allowed.append({"not": {"required": ["backend"]}})
        rules.append({"anyOf": allowed})
    if rules:
        card["allOf"] = rules
    return {"$schema": "http://json-schema.org/draft-04/schema#", "id": "runner/matrix.schema.json",
            **_draft4(doc),
            "description": "Generated by `runner schema` from runner/plan/matrix.py (do not edit by hand). "
                           "matrix.toml, documented in docs/matrix.md; editors validate a matrix with it "
                           "(taplo / Even Better TOML: a first line `#:schema ./runner/schema/matrix.schema.json`)."}


def render_schema() -> str:
    return json.dumps(json_schema(), indent=2) + "\n"
