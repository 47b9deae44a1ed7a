"""matrix.toml → a validated, frozen Matrix.

Every problem becomes one UserError line naming the file, the key and the value; unknown keys are errors
(a typo must not silently fall back to a default). Paths are relative to the matrix file's folder.
"""

from __future__ import annotations

import hashlib
import math
import re
import stat
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from runner.errors import UserError
from runner.registry import BACKENDS, DIALECTS, METERS, BackendOptions, OptionError, Options, listed_meters
from runner.sequential import looks
from runner.units import slug
from runner.vocab import Role, names

# Allowed values come from runner.vocab and the registries (read at load: an entry added later counts).
ROLES = names(Role)
MAX_SIDE = 16384  # pixels per side of a requested image
MAX_TIMEOUT_S = 7 * 86400  # a timeout longer than a week is a typo, and must not mean "forever"
PLACEHOLDERS = ("port", "host", "model", "python", "card", "gpu", "vram_gib", "flags")
MAX_MATRIX_BYTES = 4 * 2**20
MIN_SAMPLE_HZ = 0.1  # one sample every 10 s: slower says nothing about a request's peak

# Card, flag-set, fixture, server and run names become folder and container names: identifiers only.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
NAME_RULE = "1-64 characters: letters, digits, '-', '_', '.'; starting with a letter or digit"


@dataclass(frozen=True)
class RunSettings:
    name: str
    seeds: tuple[int, ...]
    steps: int
    size: tuple[int, int] | None  # None: the server's default for the first reference
    true_cfg_scale: float | None
    negative_prompt: str | None
    request_timeout_s: float
    ready_timeout_s: float
    results_dir: Path
    stop_after_oom: bool  # an OOM at n references implies the larger counts of that session
    restarts: int  # server restarts allowed per session after a crash
    determinism_check: bool  # send each session's first step twice (when repeats == 1)
    repeats: int  # timed sends of each step's request; with >= 2 their image bytes are compared (auto: 1)
    oom_implies_seeds: bool  # an OOM at n references also implies the remaining seeds at n
    require_idle_gpu: bool
    sample_hz: float
    # repeats = "auto": one timed send per step, more only where a latency ratio is open (runner.sequential)
    auto_repeats: bool = False
    max_repeats: int = 1  # auto: the most timed sends of one step


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool = True


@dataclass(frozen=True)
class ServerProfile:
    """The server's shape, declared once: the plan and the backend read it from here."""

    name: str
    command: tuple[str, ...] = ()
    image: str | None = None
    port: int = 0  # port inside the container / on the host; 0: the backend picks a free one at each start
    health_path: str = "/health"
    dialect: str = "vllm-omni-chat"
    model: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()
    shm_size: str | None = None
    ipc_mode: str | None = None


@dataclass(frozen=True)
class Card:
    name: str
    server: str
    backend: str  # a runner.registry.BACKENDS name
    gpu: str | None  # index or UUID
    vram_gib: float
    meters: tuple[str, ...]  # runner.registry.METERS names, in the card's order of trust
    env: Mapping[str, str]
    options: BackendOptions  # the backend's own card keys (docker: docker_host, publish_host)
    meter_options: Mapping[str, Options] = field(default_factory=dict)  # per meter that reads card keys


@dataclass(frozen=True)
class FlagSet:
    name: str
    role: str
    args: tuple[str, ...]
    env: Mapping[str, str]
    description: str


@dataclass(frozen=True)
class Fixture:
    name: str
    prompt: str
    references: tuple[Path, ...]


@dataclass(frozen=True)
class Baseline:
    directory: Path | None  # holds samples.json (fixture + references + seed → image file)
    cell: tuple[str | None, str] | None  # (card, flag set) of this run; card None = each card's own


@dataclass(frozen=True)
class Axes:
    cards: tuple[str, ...]
    flags: tuple[str, ...]
    references: tuple[int, ...]
    fixtures: tuple[str, ...]
    exclude: tuple[Mapping[str, str], ...]

    def kept(self, card: str, flags: str) -> bool:
        """Whether the card × flag set cell runs (no `exclude` entry matches it)."""
        return not any(ex.get("card", card) == card and ex.get("flags", flags) == flags for ex in self.exclude)


@dataclass(frozen=True)
class VerdictRules:
    target_references: int
    max_latency_ratio: float
    min_psnr_db: float
    offload_roles: tuple[str, ...]
    max_transparent_share: float
    min_pixel_std: float
    # How often a latency ratio may be looked at ([run] repeats = "auto": runner.sequential.looks); 1: one
    # fixed set of sends, judged once by the percentile bootstrap.
    latency_looks: int = 1


@dataclass(frozen=True)
class Matrix:
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


# --- table reading with exact error lines ----------------------------------------------------------------


class _Table:
    """A TOML table being read: tracks its key path and rejects keys nobody asked for."""

    def __init__(self, file: Path, path: str, data: Any) -> None:
        if not isinstance(data, dict):
            raise UserError(f"{file}: [{path}] must be a table, got {_show(data)}")
        self.file, self.path, self.data = file, path, data
        self.seen: set[str] = set()

    def key(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def _err(self, key: str, msg: str) -> UserError:
        return UserError(f"{self.file}: key '{self.key(key)}' {msg}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ..., *, what: str = "") -> Any:
        self.seen.add(key)
        if key not in self.data:
            if default is ...:
                raise self._err(key, "is required")
            return default
        value = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # bool is an int in Python, but `steps = true` is a mistake, not 1.
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            raise self._err(key, f"must be {what or _kind_name(kinds)}, got {_show(value)}")
        if isinstance(value, float) and not math.isfinite(value):  # TOML allows nan/inf; JSON and timers do not
            raise self._err(key, f"must be a finite number, got {_show(value)}")
        return value

    def raw(self, key: str) -> Any:
        """The value as written, for a declared model to validate."""
        self.seen.add(key)
        return self.data[key]

    def list_of(self, key: str, kind: type, default: Any = ..., *, min_len: int = 0) -> tuple[Any, ...]:
        value = self.get(key, list, default, what=f"a list of {_kind_name((kind,))}")
        for item in value:
            if not isinstance(item, kind) or (isinstance(item, bool) and kind is not bool):
                raise self._err(key, f"must hold only {_kind_name((kind,))}, got {_show(item)}")
            if isinstance(item, float) and not math.isfinite(item):
                raise self._err(key, f"must hold only finite numbers, got {_show(item)}")
        if len(value) < min_len:
            raise self._err(key, f"must hold at least {min_len} item(s), got {_show(value)}")
        return tuple(value)

    def str_map(self, key: str) -> dict[str, str]:
        value = self.get(key, dict, {}, what="a table of strings")
        for k, v in value.items():
            if not isinstance(v, (str, int, float)) or isinstance(v, bool) or \
                    (isinstance(v, float) and not math.isfinite(v)):
                raise self._err(f"{key}.{k}", f"must be a string, got {_show(v)}")
            if not ENV_NAME_RE.fullmatch(k):
                raise self._err(f"{key}.{k}", "is not an environment variable name (letters, digits, '_'; "
                                              "not starting with a digit)")
        return {k: str(v) for k, v in value.items()}

    def choice(self, key: str, choices: tuple[str, ...], default: Any = ...) -> str:
        value = self.get(key, str, default)
        if value not in choices:
            raise self._err(key, f"must be one of {', '.join(choices)}, got {_show(value)}")
        return str(value)

    def positive(self, key: str, kind: type | tuple[type, ...], default: Any = ..., *,
                 maximum: float | None = None) -> Any:
        value = self.get(key, kind, default)
        if value is not None and value <= 0:
            raise self._err(key, f"must be > 0, got {_show(value)}")
        if value is not None and maximum is not None and value > maximum:
            raise self._err(key, f"must be <= {maximum:g}, got {_show(value)}")
        return value

    def between(self, key: str, low: float, high: float, default: Any = ...) -> float:
        value = self.get(key, (int, float), default)
        if not low <= value <= high:
            raise self._err(key, f"must be between {low:g} and {high:g}, got {_show(value)}")
        return float(value)

    def sub(self, key: str) -> _Table:
        self.seen.add(key)
        return _Table(self.file, self.key(key), self.data.get(key, {}))

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.seen)
        if unknown:
            raise UserError(f"{self.file}: unknown key '{self.key(unknown[0])}'")

    def err(self, key: str, msg: str) -> UserError:
        return self._err(key, msg)


def _kind_name(kinds: tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "true or false", list: "a list",
             dict: "a table"}
    if set(kinds) == {int, float}:
        return "a number"
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _name_ok(file: Path, section: str, name: str) -> None:
    if not NAME_RE.fullmatch(name):
        raise UserError(f"{file}: [{section}.{_show(name)}] is not a valid name ({NAME_RULE})")


def parse_size(text: str) -> tuple[int, int] | None:
    try:
        w, h = (int(x) for x in text.lower().split("x"))
    except ValueError:
        return None
    return (w, h) if w > 0 and h > 0 else None


ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A template holds literal text, `{{` / `}}` (literal braces), `{name}` placeholders (names only: no format
# spec, conversion, attribute or index — str.format would evaluate those) and, in env values, `${VAR}`: a
# variable of the runner's own environment, resolved only when the server starts (never stored).
TEMPLATE_TOKEN = re.compile(r"\$\{([^{}]*)\}|\{\{|\}\}|\{([^{}]*)\}|[{}]")


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


def check_template(file: Path, where: str, text: str, *, env_refs: bool = False) -> None:
    """Placeholders must be known: a typo would otherwise reach the server verbatim."""
    problem = _template_error(text, env_refs=env_refs)
    if problem:
        raise UserError(f"{file}: key '{where}' {problem}")


def env_refs(text: str) -> list[str]:
    """The runner environment variables a template references (`${VAR}`)."""
    return [m.group(1) for m in TEMPLATE_TOKEN.finditer(text) if m.group(1) is not None]


def _env_map(file: Path, t: _Table, key: str) -> dict[str, str]:
    env = t.str_map(key)
    for k, v in env.items():
        check_template(file, f"{t.key(key)}.{k}", v, env_refs=True)
    return env


# --- sections ----------------------------------------------------------------------------------------------


def _run(file: Path, t: _Table, base: Path) -> RunSettings:
    size_text = t.get("size", str, None)
    size = None
    if size_text is not None and (size := parse_size(size_text)) is None:
        raise t.err("size", f"must look like '1024x1024', got {_show(size_text)}")
    if size is not None and max(size) > MAX_SIDE:
        raise t.err("size", f"must be at most {MAX_SIDE}x{MAX_SIDE}, got {_show(size_text)}")
    seeds = t.list_of("seeds", int, [0], min_len=1)
    for seed in seeds:
        if not 0 <= seed < 2**63:
            raise t.err("seeds", f"must hold integers from 0 to 2**63-1, got {seed}")
    if len(set(seeds)) != len(seeds):
        dup = next(x for x in seeds if seeds.count(x) > 1)
        raise t.err("seeds", f"holds seed {dup} twice (its records would overwrite each other)")
    restarts = t.get("restarts", int, 1)
    if not 0 <= restarts <= 100:
        raise t.err("restarts", f"must be from 0 to 100, got {restarts}")
    name = t.get("name", str, None)
    if name is not None and not NAME_RE.fullmatch(name):
        raise t.err("name", f"must be a name ({NAME_RULE}), got {_show(name)}")
    results_text = t.get("results_dir", str, "results")
    if not results_text.strip() or "\0" in results_text:
        raise t.err("results_dir", f"must be a folder path, got {_show(results_text)}")
    repeats, auto, max_repeats = _repeats(t)
    run = RunSettings(
        name=name or (slug(file.stem).strip(".-_")[:64] or "run"),
        seeds=seeds,
        steps=t.positive("steps", int, 20),
        size=size,
        true_cfg_scale=t.get("true_cfg_scale", (int, float), None),
        negative_prompt=t.get("negative_prompt", str, None),
        request_timeout_s=float(t.positive("request_timeout_s", (int, float), 600, maximum=MAX_TIMEOUT_S)),
        ready_timeout_s=float(t.positive("ready_timeout_s", (int, float), 900, maximum=MAX_TIMEOUT_S)),
        results_dir=(base / Path(results_text).expanduser()).resolve(),
        stop_after_oom=t.get("stop_after_oom", bool, True),
        restarts=restarts,
        determinism_check=t.get("determinism_check", bool, True),
        repeats=repeats,
        oom_implies_seeds=t.get("oom_implies_seeds", bool, True),
        require_idle_gpu=t.get("require_idle_gpu", bool, False),
        # A floor as well as a ceiling: a rate near zero is a sampling period beyond any clock (1e-300 Hz).
        sample_hz=t.between("sample_hz", MIN_SAMPLE_HZ, 1000, 20),
        auto_repeats=auto, max_repeats=max_repeats,
    )
    t.done()
    if (why := cfg_warning(run)) is not None:
        print(f"runner: warning: {file}: {why}", file=sys.stderr)
    return run


def _repeats(t: _Table) -> tuple[int, bool, int]:
    """(timed sends per step on the first pass, auto?, max_repeats). `repeats` is "auto" (the default) or
    a fixed count; `max_repeats` belongs to auto only."""
    value = t.get("repeats", (int, str), "auto", what='"auto" or an integer')
    if isinstance(value, str) and value != "auto":
        raise t.err("repeats", f'must be "auto" or an integer, got {_show(value)}')
    if value == "auto":
        max_repeats = t.get("max_repeats", int, 8)
        if not 2 <= max_repeats <= 100:
            raise t.err("max_repeats", f"must be from 2 to 100, got {max_repeats}")
        return 1, True, max_repeats
    if "max_repeats" in t.data:
        t.seen.add("max_repeats")
        raise t.err("max_repeats", f'applies only to repeats = "auto", but repeats = {value}')
    return t.positive("repeats", int, maximum=100), False, value


def cfg_warning(run: RunSettings) -> str | None:
    """vLLM-Omni 0.30 runs true CFG only when `true_cfg_scale > 1` *and* a negative prompt is sent
    (pipeline_qwen_image_edit_plus.py), so a matrix without one measures single-pass generation."""
    if run.true_cfg_scale is None or run.negative_prompt is not None:
        return None
    return (f"[run] true_cfg_scale = {run.true_cfg_scale:g} without negative_prompt: vLLM-Omni 0.30 runs true "
            "CFG only when a negative prompt is sent, so these requests run single-pass there "
            "(set negative_prompt = \" \" to get CFG)")


def _server(file: Path, name: str, t: _Table) -> ServerProfile:
    command = t.list_of("command", str, (), min_len=0)
    image = t.get("image", str, None)
    if not command and not image:
        raise t.err("command", "is required when no image is given")
    for i, arg in enumerate(command):
        check_template(file, f"{t.path}.command[{i}]", arg)
    mounts = []
    for i, m in enumerate(t.get("mounts", list, [], what="a list of tables")):
        mt = _Table(file, f"{t.path}.mounts[{i}]", m)
        mounts.append(Mount(mt.get("source", str), mt.get("target", str), mt.get("read_only", bool, True)))
        mt.done()
    health = t.get("health_path", str, "/health")
    if not health.startswith("/"):
        raise t.err("health_path", f"must start with '/', got {_show(health)}")
    port = t.get("port", int, 0 if not image else 8000)
    if not 0 <= port < 65536:
        raise t.err("port", f"must be a TCP port, got {port}")
    profile = ServerProfile(
        name=name, command=command, image=image, port=port, health_path=health,
        dialect=t.choice("dialect", DIALECTS.names(), "vllm-omni-chat"), model=t.get("model", str, name),
        env=_env_map(file, t, "env"), mounts=tuple(mounts), shm_size=t.get("shm_size", str, None),
        ipc_mode=t.get("ipc_mode", str, None),
    )
    t.done()
    return profile


def _options(t: _Table, model: type[Options], data: dict[str, Any]) -> Any:
    """One kind's card keys through its declared model; a problem is one line naming the key."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, OptionError):
            raise t.err(cause.key, cause.problem) from None
        key = ".".join(str(x) for x in err["loc"]) or next(iter(data), "?")
        problem = err["msg"].removeprefix("Value error, ")
        got = f", got {_show(err['input'])}" if err["type"] != "missing" else ""
        raise t.err(key, f"{problem[0].lower()}{problem[1:]}{got}") from None


def _card(file: Path, name: str, t: _Table, servers: Mapping[str, ServerProfile]) -> Card:
    server = t.get("server", str)
    if server not in servers:
        raise t.err("server", f"names unknown server profile {_show(server)} (known: {', '.join(servers)})")
    backend = t.choice("backend", BACKENDS.names(), "local")
    entry = BACKENDS.get(backend)
    for other in BACKENDS.entries():
        stray = next((k for k in other.options.model_fields if k in t.data), None)
        if other is not entry and stray and stray not in entry.options.model_fields:
            raise t.err(stray, f"applies to backend '{other.name}' only, not to this card's '{backend}'")
    mine = {k: t.raw(k) for k in entry.options.model_fields if k in t.data}
    options = _options(t, entry.options, mine)
    if entry.needs_image and servers[server].image is None:
        raise t.err("backend", f"is {backend} but server profile '{server}' has no image")
    gpu = t.get("gpu", (str, int), None)
    meters = t.list_of("meters", str, ("server", "host"))
    known = listed_meters()
    for m in meters:
        if m not in known:
            raise t.err("meters", f"names unknown meter {_show(m)} (known: {', '.join(known)})")
    meter_options = {}
    for m in METERS.entries():
        if m.options is None:
            continue
        given = {k: t.raw(k) for k in m.options.model_fields if k in t.data}
        if m.name in meters or given:
            missing = next((k for k in m.options.model_fields if k not in given
                            and m.options.model_fields[k].is_required()), None)
            if missing and m.name in meters and not (m.name == "sidecar" and entry.starts_sidecar):
                raise t.err(missing, f"is required when meters includes '{m.name}'")
            if not missing:
                meter_options[m.name] = _options(t, m.options, given)
    gib, mib = t.positive("vram_gib", (int, float), None), t.positive("vram_mib", (int, float), None)
    if (gib is None) == (mib is None):
        raise t.err("vram_gib", "is required (or vram_mib), exactly one of the two")
    card = Card(
        name=name, server=server, backend=backend, gpu=None if gpu is None else str(gpu),
        vram_gib=float(gib if gib is not None else mib / 1024), meters=meters, env=_env_map(file, t, "env"),
        options=options, meter_options=meter_options,
    )
    t.done()
    return card


def _flags(file: Path, name: str, t: _Table) -> FlagSet:
    args = t.list_of("args", str, ())
    for i, arg in enumerate(args):
        check_template(file, f"{t.path}.args[{i}]", arg)
    flags = FlagSet(name=name, role=t.choice("role", ROLES, "other"), args=args, env=_env_map(file, t, "env"),
                    description=t.get("description", str, ""))
    t.done()
    return flags


def _fixture(file: Path, name: str, t: _Table, base: Path) -> Fixture:
    refs = t.list_of("references", str, ())
    fixture = Fixture(name=name, prompt=t.get("prompt", str),
                      references=tuple((base / Path(r).expanduser()) for r in refs))
    t.done()
    return fixture


def _axes(file: Path, t: _Table, cards: Mapping[str, Card], flags: Mapping[str, FlagSet],
          fixtures: Mapping[str, Fixture]) -> Axes:
    def names(key: str, known: Mapping[str, Any]) -> tuple[str, ...]:
        chosen = t.list_of(key, str, tuple(known))
        for n in chosen:
            if chosen.count(n) > 1:
                raise t.err(key, f"names {_show(n)} twice")
            if n not in known:
                raise t.err(key, f"names unknown {key[:-1] if key != 'flags' else 'flag set'} {_show(n)} "
                                 f"(known: {', '.join(known) or 'none'})")
        return chosen

    axes = Axes(cards=names("cards", cards), flags=names("flags", flags),
                references=tuple(sorted(set(t.list_of("references", int, [1], min_len=1)))),
                fixtures=names("fixtures", fixtures),
                exclude=tuple(t.get("exclude", list, [], what="a list of tables")))
    for n in axes.references:
        if not 0 <= n <= 64:
            raise t.err("references", f"must hold counts from 0 to 64, got {n}")
    for i, ex in enumerate(axes.exclude):
        et = _Table(file, f"{t.path}.exclude[{i}]", ex)
        card, fl = et.get("card", str, None), et.get("flags", str, None)
        if card is not None and card not in cards:
            raise et.err("card", f"names unknown card {_show(card)}")
        if fl is not None and fl not in flags:
            raise et.err("flags", f"names unknown flag set {_show(fl)}")
        et.done()
    t.done()
    if not (axes.cards and axes.flags and axes.fixtures):
        empty = "cards" if not axes.cards else "flags" if not axes.flags else "fixtures"
        raise UserError(f"{file}: the matrix is empty: no {empty} (add a [{empty}.NAME] table)")
    if not any(axes.kept(c, f) for c in axes.cards for f in axes.flags):
        raise t.err("exclude", "leaves out every card × flag set cell: nothing would run")
    for fx in axes.fixtures:
        if len(fixtures[fx].references) < max(axes.references):
            raise UserError(f"{file}: key 'fixtures.{fx}.references' holds {len(fixtures[fx].references)} "
                            f"image(s) but the matrix asks for {max(axes.references)}")
    return axes


def _baseline(file: Path, t: _Table, base: Path, cards: Mapping[str, Card],
              flags: Mapping[str, FlagSet]) -> Baseline | None:
    if not t.data:
        return None
    directory = t.get("dir", str, None)
    cell = t.get("cell", str, None)
    if (directory is None) == (cell is None):
        raise UserError(f"{file}: [baseline] needs exactly one of 'dir' or 'cell'")
    parsed_cell = None
    if cell is not None:
        card, _, fl = cell.rpartition("/")
        if (card and card not in cards) or fl not in flags:
            raise t.err("cell", f"must be 'CARD/FLAGS' or 'FLAGS' naming a card and a flag set, got {_show(cell)}")
        parsed_cell = (card or None, fl)
    t.done()
    return Baseline(directory=None if directory is None else base / Path(directory).expanduser(),
                    cell=parsed_cell)


def _verdict(t: _Table, axes: Axes) -> VerdictRules:
    rules = VerdictRules(
        target_references=t.get("target_references", int, max(axes.references)),
        max_latency_ratio=float(t.positive("max_latency_ratio", (int, float), 2.5)),
        min_psnr_db=t.between("min_psnr_db", 0, 100, 20.0),  # 100 dB: the cap for identical images
        offload_roles=t.list_of("offload_roles", str, ("offload",)),
        max_transparent_share=t.between("max_transparent_share", 0, 1, 0.5),
        min_pixel_std=t.between("min_pixel_std", 0, 255, 2.0),
    )
    if rules.target_references not in axes.references:
        raise t.err("target_references", f"must be one of the matrix's reference counts "
                                         f"{list(axes.references)}, got {rules.target_references}")
    for role in rules.offload_roles:
        if role not in ROLES:
            raise t.err("offload_roles", f"names unknown role {_show(role)} (known: {', '.join(ROLES)})")
    t.done()
    return rules


def _named_tables(file: Path, root: _Table, key: str) -> dict[str, _Table]:
    section = root.get(key, dict, {})
    tables = {}
    for name in section:
        _name_ok(file, key, name)
        tables[name] = _Table(file, f"{key}.{name}", section[name])
    return tables


def load_matrix(path: str | Path, *, check_files: bool = True, base: Path | None = None) -> Matrix:
    """`base` is the folder relative paths start from (default: the file's own folder)."""
    file = Path(path)
    try:
        st = file.stat()
        # Stat first: a FIFO (or /dev/zero) passed as the matrix would block the read forever.
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"{file}: cannot read matrix: not a regular file")
        if st.st_size > MAX_MATRIX_BYTES:
            raise UserError(f"{file}: cannot read matrix: {st.st_size} bytes (at most {MAX_MATRIX_BYTES})")
        raw = file.read_bytes()
    except OSError as exc:
        raise UserError(f"{file}: cannot read matrix: {exc.strerror}") from None
    text = raw.decode("utf-8", errors="replace")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{file}: TOML syntax error: {exc}") from None
    base = base or file.resolve().parent
    root = _Table(file, "", data)

    run = _run(file, root.sub("run"), base)
    servers = {n: _server(file, n, t) for n, t in _named_tables(file, root, "servers").items()}
    cards = {n: _card(file, n, t, servers) for n, t in _named_tables(file, root, "cards").items()}
    flags = {n: _flags(file, n, t) for n, t in _named_tables(file, root, "flags").items()}
    fixtures = {n: _fixture(file, n, t, base) for n, t in _named_tables(file, root, "fixtures").items()}
    axes = _axes(file, root.sub("matrix"), cards, flags, fixtures)
    baseline = _baseline(file, root.sub("baseline"), base, cards, flags)
    verdict = _verdict(root.sub("verdict"), axes)
    if run.auto_repeats:
        verdict = replace(verdict, latency_looks=looks(run.max_repeats))
    root.done()

    needed = [(f"fixtures.{fx}.references[{i}]", "reference image", p) for fx in axes.fixtures
              for i, p in enumerate(fixtures[fx].references[: max(axes.references)])]
    if baseline and baseline.directory is not None:
        needed.append(("baseline.dir", "baseline file", baseline.directory / "samples.json"))
    absent = [(key, kind, p) for key, kind, p in needed if not p.is_file()]
    missing = tuple(p for _, _, p in absent)
    if check_files and absent:
        key, kind, path = absent[0]
        what = "is not a regular file" if path.exists() else "not found"
        raise UserError(f"{file}: key '{key}': {kind} {what}: {path}")
    return Matrix(path=file, sha256=hashlib.sha256(raw).hexdigest(), text=text, run=run, servers=servers,
                  cards=cards, flags=flags, fixtures=fixtures, baseline=baseline, axes=axes, verdict=verdict,
                  missing_files=missing)
