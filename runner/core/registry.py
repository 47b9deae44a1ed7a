"""One place per kind: every meter, backend and request dialect is one entry here, declaring its factory,
the card keys it reads (a frozen pydantic model) and its traits. Whatever used to branch on a kind's name
(matrix validation, plan lines, lanes, the idle gate, reconciliation, the report's glossary, cleanup,
preflight) reads the entry instead, so adding a meter or a backend is one new module plus one entry.

Pure: factories are named "module:attribute" and imported only when a server or meter is built, so loading
the matrix, planning and reporting never pull in httpx, docker or NVML.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any, Generic, Literal, Protocol, TypeVar
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from runner.core.vocab import MemoryMetric

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@cache
def load(target: str | Callable[..., Any]) -> Any:
    """The object a "module:attribute" names (imported now, not when the entry was declared); an entry made
    at run time (a plugin, a test) may name the object itself."""
    if not isinstance(target, str):
        return target
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


Target = str | Callable[..., Any]  # "module:attribute", or the object itself


class Options(BaseModel):
    """The card keys one kind reads (e.g. a backend's `docker_host`); unknown keys are errors."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    def address(self) -> str | None:
        """The place outside this process these options name (a meter's URL), for preflight's reach check."""
        return next((v for v in self.model_dump().values() if isinstance(v, str)), None)


class _Named(Protocol):
    @property
    def name(self) -> str: ...


E = TypeVar("E", bound=_Named)


class Registry(Generic[E]):
    """Entries of one kind by name, in declaration order."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, E] = {}

    def register(self, entry: E) -> E:
        if entry.name in self._entries:
            raise ValueError(f"{self.kind} {entry.name!r} is registered twice")
        self._entries[entry.name] = entry
        return entry

    def remove(self, name: str) -> None:
        self._entries.pop(name, None)

    @contextmanager
    def added(self, entry: E) -> Iterator[E]:
        """An entry registered for the duration of a block (tests, plugins loaded for one run)."""
        self.register(entry)
        try:
            yield entry
        finally:
            self.remove(entry.name)

    def get(self, name: str) -> E:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r} (known: {', '.join(self._entries)})") from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def entries(self) -> tuple[E, ...]:
        return tuple(self._entries.values())


# --- meters --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeterEntry:
    """A memory source. `factory(card, server, hz) -> Meter` gets the run's sample_hz already clamped to
    [min_hz, max_hz]; a source that cannot run there returns an UnavailableMeter with the reason."""

    name: str
    factory: Target | None  # "module:function"; None: a source that is recorded, never listed (server-response)
    scope: Literal["device", "process"]  # whole device (every process on the GPU) or the server's own figure
    rank: int  # preference among equally fast sources: lower is closer to the GPU
    glossary: str  # what it reads (report glossary, plot notes)
    metric: MemoryMetric = MemoryMetric.DEVICE
    min_hz: float | None = None
    max_hz: float | None = None
    reads_gpu: bool = False  # reads the GPU itself: a card listing it is gated by the idle baseline
    after_ready: bool = False  # reads the server's own endpoint: no reading before its port opens (load)
    refines: str | None = None  # a per-request figure recorded right before this polled source's peak
    reach: tuple[str, str] | None = None  # (what, path): preflight GETs the options' URL + path before a run
    idle: Target | None = None  # "module:function"(card) -> IdleBaseline: who holds the device before a start
    options: type[Options] | None = None  # the card keys it needs when the card lists it
    listed: bool = True  # a card may name it in `meters`

    def clamp(self, hz: float) -> float:
        return min(max(hz, self.min_hz or hz), self.max_hz or hz)

    @property
    def whole_device(self) -> bool:
        return self.scope == "device"


class DcgmOptions(Options):
    dcgm_url: str = Field(description="dcgm-exporter's /metrics URL")


class PrometheusOptions(Options):
    prometheus_url: str = Field(description="the Prometheus server that scrapes dcgm-exporter")


class SidecarOptions(Options):
    sidecar_url: str = Field(description="`runner meter` on the GPU's host")


METERS: Registry[MeterEntry] = Registry("meter")
for _entry in (
    MeterEntry("nvml", "runner.meters.nvml:build", "device", 0, reads_gpu=True, min_hz=500, max_hz=2000,
               idle="runner.meters.nvml:idle",
               glossary="whole-device VRAM in use (NVML `used`) on the runner's host, 500 Hz–2 kHz"),
    MeterEntry("sidecar", "runner.meters.sidecar_meter:build", "device", 1, reads_gpu=True, min_hz=2, max_hz=10,
               idle="runner.meters.sidecar_meter:idle", options=SidecarOptions, reach=("sidecar", "/info"),
               glossary="the same NVML figure sampled on the GPU's own host by `runner meter`, polled for "
                        "window maxima"),
    MeterEntry("dcgm", "runner.meters.dcgm:build", "device", 2, max_hz=10, options=DcgmOptions,
               reach=("dcgm-exporter", ""),
               glossary="dcgm-exporter's `DCGM_FI_DEV_FB_USED`, as fine as the exporter's collection interval"),
    MeterEntry("prometheus", "runner.meters.prometheus:build", "device", 3, options=PrometheusOptions,
               reach=("Prometheus", "/api/v1/query?query=1"),
               glossary="`max_over_time` of the DCGM figure in Prometheus: sub-second peaks are lost"),
    MeterEntry("server", "runner.meters.server:build", "process", 4, max_hz=20, after_ready=True,
               glossary="the server's own `/metrics` memory gauge, ≤ 20 Hz; the server opens its port only "
                        "after load, so it has no reading while loading"),
    MeterEntry("server-response", None, "process", 5, listed=False, refines="server",
               glossary="the `peak_memory_mb` the server reports in each response: the allocator's peak over "
                        "the request, short spikes included (one figure per request, no time series)"),
    MeterEntry("host", "runner.meters.host:build", "process", 6, metric=MemoryMetric.HOST, max_hz=10,
               glossary="host RAM (RSS) of the server's process tree or container, ≤ 10 Hz: where offloaded "
                        "memory goes"),
):
    METERS.register(_entry)


def listed_meters() -> tuple[str, ...]:
    """The names a card may put in `meters`."""
    return tuple(e.name for e in METERS.entries() if e.listed)


# --- backends ------------------------------------------------------------------------------------------------


class BackendOptions(Options):
    """A backend's card keys, with what the pure layers ask of them."""

    def host(self) -> str:
        """The machine the server runs on: cards naming the same GPU there share a lane."""
        return "local"

    def where(self) -> str:
        """How `runner plan` names the place a card's servers start."""
        return "local"


class LocalOptions(BackendOptions):
    pass


# Docker's own size notation (`docker run --memory`): a number and an optional unit b, k, m or g.
DOCKER_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([bkmg]?)", re.IGNORECASE)
DOCKER_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30}
DOCKER_MIN_MEMORY = 6 * 2**20  # the engine refuses a smaller memory limit


def docker_size(value: object) -> int:
    """`"512m"` → 536870912 bytes; a TOML integer is bytes. ValueError with the accepted forms."""
    found = DOCKER_SIZE.fullmatch(value.strip()) if isinstance(value, str) else None
    if found is not None:
        size = int(float(found[1]) * DOCKER_UNITS[found[2].lower()])
    elif isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        raise ValueError('must be a size such as "512m" or "4g" (b, k, m, g), or a number of bytes')
    if size < DOCKER_MIN_MEMORY:
        raise ValueError("must be at least 6m (the engine's smallest memory limit)")
    return size


class DockerOptions(BackendOptions):
    docker_host: str | None = Field(None, description="unix://, tcp:// or ssh://user@host (default: DOCKER_HOST, "
                                                      "else the local socket)")
    publish_host: str = Field("127.0.0.1", description="the address the container's port is published on (for a "
                                                      "remote docker_host: one the runner reaches)")
    # The container's host-memory limit in bytes (`mem_limit = "512m"` in the matrix), swap included: past it
    # the kernel's OOM killer ends the server, and the failure says host memory. None: no limit.
    mem_limit: int | None = Field(None, description='the container\'s host-memory limit, swap included: "512m", "4g" '
                                                    "(b, k, m, g) or bytes; past it the kernel's OOM killer ends the "
                                                    "server (default: none)")

    @field_validator("mem_limit", mode="before", json_schema_input_type=str | int | None)
    @classmethod
    def _size(cls, v: object) -> int | None:
        return None if v is None else docker_size(v)

    @field_validator("docker_host")
    @classmethod
    def _scheme(cls, v: str | None) -> str | None:
        if v and not v.startswith(("unix://", "tcp://", "ssh://", "npipe://")):
            raise ValueError("must start with unix://, tcp:// or ssh://")
        return v

    @model_validator(mode="after")
    def _reachable(self) -> DockerOptions:
        url = urlsplit(self.docker_host or "")
        remote = url.scheme in ("ssh", "tcp") and (url.hostname or "") not in LOOPBACK  # its ports are not ours
        if remote and self.publish_host in LOOPBACK:
            raise OptionError("publish_host", f"is {self.publish_host!r} but docker_host {self.docker_host!r} is "
                              "another machine: the runner could not reach the server; use the host's address "
                              "(or '0.0.0.0')")
        return self

    def host(self) -> str:
        return self.docker_host or "local"

    def where(self) -> str:
        return f"docker {self.docker_host or 'local engine'}"


class OptionError(ValueError):
    """A problem of one option key that the matrix reports as `key '<card>.<key>' <problem>`."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(problem)
        self.key, self.problem = key, problem


@dataclass(frozen=True)
class BackendEntry:
    """Where a server runs. `factory(plan, attempt) -> RunningServer` decides the port and starts the
    process/container; the running server checks before every probe that what answers is its own."""

    name: str
    factory: Target  # "module:Class" of a runner.backends.base.RunningServer
    options: type[BackendOptions]  # the card keys it reads
    bind_host: str  # what {host} in the server's command becomes: where the server listens
    reaches: str  # how the runner reaches the server (docs, plan)
    needs_image: bool = False  # the server profile must name an image
    reap: Target | None = None  # "module:function"(options: list[BackendOptions]) -> list[str]: leftovers stopped
    preflight: Target | None = None  # "module:function"(matrix, plan) -> None, raising UserError
    start_line: Callable[[Any], str] | None = None  # the plan's "starts (...)" text for a ServerPlan
    # "module:function"(options) -> (what, address) | None: the host preflight reaches before a run (its
    # probe is the backend's `probe`, "module:function"(address, timeout_s) -> cause | None)
    endpoint: Target | None = None
    probe: Target | None = None
    # "module:function"(lane, run context) -> context manager: what a lane holds while its sessions run
    # (slurm: the lane's allocations, released when the lane ends)
    lane: Target | None = None
    starts_sidecar: bool = False  # the backend starts `runner meter` beside each server itself (no sidecar_url)
    # "module:function"(ServerPlan, host folder) -> (ServerPlan, the folder as the server sees it): how a folder of
    # the runner's reaches the server, for the allocator snapshot it writes (raises ValueError: why it cannot)
    profile_dir: Target = "runner.backends.base:same_path"
    # "module:function"(ServerPlan) -> an asker of the server's own `--help` (runner.run.flag_help): how the
    # preflight reads a vLLM-Omni fork's flags where it runs (None: this backend cannot ask, and says so)
    ask_help: Target | None = None


def _local_line(server: Any) -> str:
    port = server.profile.port
    return f"local process, port {port or 'a free port picked at each start'}"


def _docker_line(server: Any) -> str:
    limit = server.options.mem_limit
    return (f"image {server.profile.image} on {server.options.docker_host or 'local engine'}, "
            f"container port {server.profile.port} published on a free host port"
            + (f", host memory limited to {limit / 2**20:g} MiB" if limit else ""))


BACKENDS: Registry[BackendEntry] = Registry("backend")
BACKENDS.register(BackendEntry("local", "runner.backends.local:LocalServer", LocalOptions, "127.0.0.1",
                               "a subprocess of this runner, on 127.0.0.1", reap="runner.backends.local:reap",
                               preflight="runner.backends.local:preflight", start_line=_local_line,
                               ask_help="runner.run.flag_help:LocalAsker"))
BACKENDS.register(BackendEntry("docker", "runner.backends.docker:DockerServer", DockerOptions, "0.0.0.0",
                               "a container on a local or remote Docker Engine, at its published port",
                               needs_image=True, reap="runner.backends.docker:reap_hosts",
                               endpoint="runner.backends.docker:endpoint", probe="runner.run.reach:probe_engine",
                               start_line=_docker_line, profile_dir="runner.backends.docker:profile_dir",
                               ask_help="runner.run.flag_help:DockerAsker"))


# --- request dialects ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DialectEntry:
    """One request API (runner.run.dialects): how a request is built, where a 200 response keeps its images."""

    name: str
    build: str  # "module:function"(ImageRequest) -> HttpCall
    images: str  # "module:function"(response JSON) -> list of base64 payloads / data URIs, or the problem
    doc: str
    # "module:function"(folder) -> the server's args that make it write allocator snapshots there, with the
    # start/stop paths it then serves (runner.run.dialects.Profiler); None: the server cannot record one
    profiler: str | None = None
    # the route refuses a `model` the server does not serve (vLLM-Omni 0.30's images routes: 400 "Model
    # mismatch"; its chat route serves any): what the served-model line says becomes of the requests
    checks_model: bool = False


DIALECTS: Registry[DialectEntry] = Registry("dialect")
for _dialect in (
    DialectEntry("vllm-omni-chat", "runner.run.dialects:chat", "runner.run.dialects:chat_images",
                 "chat completions, ordered image_url references, literal extra_body",
                 profiler="runner.run.dialects:vllm_omni_profiler"),
    DialectEntry("openai-images", "runner.run.dialects:generations", "runner.run.dialects:images_data",
                 "images/generations (no references)", checks_model=True),
    DialectEntry("openai-images-edits", "runner.run.dialects:edits", "runner.run.dialects:images_data",
                 "multipart images/edits, one image[] part per reference",
                 profiler="runner.run.dialects:vllm_omni_profiler", checks_model=True),
):
    DIALECTS.register(_dialect)


_SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^\d+-\d+$|^(UNLIMITED|INFINITE)$", re.IGNORECASE)
_GRES = re.compile(r"^(gres[:/])?gpu(:[A-Za-z0-9_.-]+)?(:\d+)?$|^[A-Za-z][A-Za-z0-9_.-]*$")


class SlurmOptions(BackendOptions):
    """A card submitted through Slurm: one allocation per lane, one job step per server start."""

    partition: str = Field(description="the partition the lane's allocation is asked of")
    gres: str = Field(description='"gpu:rtx3090:1", "gpu:1", or a GPU type name ("rtx3090" = gpu:rtx3090:1)')
    account: str | None = Field(None, description="sbatch --account of the allocation")
    qos: str | None = Field(None, description="sbatch --qos of the allocation")
    time_limit: str | None = Field(None, description='sbatch --time: "30", "1:30:00", "1-00:00:00", "UNLIMITED"')
    constraint: str | None = Field(None, description="sbatch --constraint (node features)")
    sbatch_args: tuple[str, ...] = Field((), description="more sbatch arguments for the allocation, as given")
    srun_args: tuple[str, ...] = Field((), description="more srun arguments for every step (server and meter)")
    meter_args: tuple[str, ...] = Field((), description="more `runner meter` arguments for the sidecar step "
                                                        "(e.g. --hz 200)")
    python: str | None = Field(None, description="the interpreter on the compute nodes that has runner installed "
                                                 "(default: this one)")

    @field_validator("sbatch_args", "srun_args", "meter_args", mode="before")
    @classmethod
    def _list(cls, v: Any) -> Any:
        return tuple(v) if isinstance(v, list) else v  # TOML arrays are lists; the options are frozen tuples

    @field_validator("partition", "account", "qos", "constraint")
    @classmethod
    def _word(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9_.,:|&*!\[\]-]+", v):
            raise ValueError("must be a Slurm name (letters, digits, _ . - and, for constraint, & | , [ ])")
        return v

    @field_validator("gres")
    @classmethod
    def _gres(cls, v: str) -> str:
        if not _GRES.match(v):
            raise ValueError("must be gpu[:TYPE][:COUNT] or a GPU type name")
        return v

    @field_validator("time_limit")
    @classmethod
    def _time(cls, v: str | None) -> str | None:
        if v is not None and not _SLURM_TIME.match(v):
            raise ValueError("must be a Slurm time (minutes, MM:SS, HH:MM:SS, D-HH[:MM[:SS]] or UNLIMITED)")
        return v

    @field_validator("sbatch_args", "srun_args")
    @classmethod
    def _not_ours(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        # The runner owns these: the ownership marks, where output goes, and which job a step joins.
        owned = ("--job-name", "-J", "--comment", "--output", "-o", "--error", "-e", "--jobid", "--parsable",
                 "--wrap")
        bad = next((a for a in v if a.split("=", 1)[0] in owned), None)
        if bad:
            raise ValueError(f"must not set {bad.split('=', 1)[0]} (the runner sets it)")
        return v

    @property
    def gres_request(self) -> str:
        """What sbatch --gres gets: a bare type name is one GPU of that type."""
        if ":" in self.gres or self.gres == "gpu":
            return self.gres.removeprefix("gres:").removeprefix("gres/")
        return f"gpu:{self.gres}:1"

    def host(self) -> str:
        return f"slurm:{self.partition}"

    def where(self) -> str:
        return f"slurm partition {self.partition}, gres {self.gres_request}"


def _slurm_line(server: Any) -> str:
    o = server.options
    return (f"a job step in the lane's allocation (partition {o.partition}, gres {o.gres_request}), on a port "
            f"chosen on its node")


BACKENDS.register(BackendEntry("slurm", "runner.backends.slurm:SlurmServer", SlurmOptions, "0.0.0.0",
                               "a job step on the node Slurm allocated, at the port the step chose there",
                               reap="runner.backends.slurm:reap", preflight="runner.backends.slurm:preflight",
                               start_line=_slurm_line, lane="runner.backends.slurm:lane",
                               starts_sidecar=True, ask_help="runner.run.flag_help:LocalAsker"))
