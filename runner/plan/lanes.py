"""Matrix → Plan: lanes (run concurrently) → sessions (one server start per card × flag set) → steps
(reference count ascending × fixture × seed, one request at a time). Pure. Under `repeats = "auto"` a flag set
that decides no card's world sends only the first seed at the counts other than the target
(first_seed_off_target).

A lane is one physical device: cards that name the same GPU on the same host (e.g. two capacities emulated
on one H200) share a lane and run one after another, so a whole-device meter never sees the other card's
server. Cards without a GPU (CPU emulation, accounted memory) get a lane each.

A step's key is its path in the run directory and its resume key.

The plan is complete: each session carries the exact server it starts (argv, env, image, backend, labels,
rendered from the profile, card and flag set with every placeholder filled but a runtime-picked port) and
the request shape its steps send (everything but the port and the image bytes). `runner plan` prints it.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from runner.core.registry import BACKENDS, BackendOptions, LocalOptions
from runner.core.secrets import MASK, mask_env
from runner.core.units import GIB, fmt_bytes
from runner.plan import soak
from runner.plan.matrix import TEMPLATE_TOKEN, Card, FlagSet, Matrix, RunSettings, ServerProfile

RUNTIME_PORT = "{port}"  # left in argv/env when the local backend picks a free port at each start


@dataclass(frozen=True)
class Step:
    card: str
    flags: str
    fixture: str
    references: int
    seed: int

    @property
    def key(self) -> str:
        return f"{self.card}/{self.flags}/refs-{self.references}/{self.fixture}-seed-{self.seed}"


@dataclass(frozen=True)
class ServerPlan:
    """Exactly what a session starts: the profile's declared shape (image, port, health path, mounts…, read
    from `profile`, never copied) with argv/env rendered for one card and flag set. The backend consumes it
    as it is and decides the port: where the argv/env say RUNTIME_PORT (profile port 0) it puts the one it
    picks at each start."""

    backend: str  # a runner.core.registry.BACKENDS name
    profile: ServerProfile
    argv: tuple[str, ...]  # the command (local) or the container's arguments (docker)
    env: Mapping[str, str]  # the real values: shown or stored only through secrets.mask_env
    labels: Mapping[str, str] = field(default_factory=dict)  # the run id and attempt are added at start
    gpu: str | None = None
    options: BackendOptions = field(default_factory=LocalOptions)  # the card's keys for its backend

    def command_line(self) -> str:
        return shlex.join(self.argv)


@dataclass(frozen=True)
class RequestShape:
    """What every step of a session sends, but its reference images' bytes, its seed and the port."""

    dialect: str
    model: str
    prompt_by_fixture: Mapping[str, str]
    steps: int
    size: tuple[int, int] | None
    true_cfg_scale: float | None
    negative_prompt: str | None

    def to_json(self) -> dict[str, Any]:
        return {"dialect": self.dialect, "model": self.model, "steps": self.steps,
                "size": list(self.size) if self.size else None, "true_cfg_scale": self.true_cfg_scale,
                "negative_prompt": self.negative_prompt}


@dataclass(frozen=True)
class Session:
    card: str
    flags: str
    steps: tuple[Step, ...]
    server: ServerPlan | None = field(default=None, compare=False)
    request: RequestShape | None = field(default=None, compare=False)

    @property
    def key(self) -> str:
        return f"{self.card}/{self.flags}"


@dataclass(frozen=True)
class Lane:
    name: str
    cards: tuple[str, ...]
    sessions: tuple[Session, ...]


@dataclass(frozen=True)
class Plan:
    lanes: tuple[Lane, ...]

    @property
    def sessions(self) -> tuple[Session, ...]:
        return tuple(s for lane in self.lanes for s in lane.sessions)

    @property
    def steps(self) -> tuple[Step, ...]:
        return tuple(step for s in self.sessions for step in s.steps)


def device_of(matrix: Matrix, card: str) -> str:
    c = matrix.cards[card]
    if c.gpu is None:
        return card
    return f"{c.options.host()}#gpu{c.gpu}"


def render_template(text: str, values: Mapping[str, str]) -> str:
    """Fill `{name}` placeholders of a template the matrix accepted (names only, no str.format, which would
    evaluate format specs); `${VAR}` stays for the backend, which resolves it when the server starts."""
    def sub(m: re.Match[str]) -> str:
        token = m.group(0)
        if m.group(1) is not None:
            return token
        if token in ("{{", "}}"):
            return token[0]
        return values[m.group(2)] if m.group(2) is not None else token

    return TEMPLATE_TOKEN.sub(sub, text)


def server_plan(matrix: Matrix, card: Card, flags: FlagSet) -> ServerPlan:
    """Server profile + card + flag set → exactly what the backend starts. The port placeholder is the
    profile's port, or RUNTIME_PORT where the backend picks one at each start."""
    profile: ServerProfile = matrix.servers[card.server]
    values = {"port": str(profile.port) if profile.port else RUNTIME_PORT,
              "host": BACKENDS.get(card.backend).bind_host, "model": profile.model, "python": sys.executable,
              "card": card.name, "gpu": card.gpu or "", "vram_gib": f"{card.vram_gib:g}", "flags": flags.name}
    return ServerPlan(
        backend=card.backend, profile=profile,
        argv=tuple(render_template(a, values) for a in (*profile.command, *flags.args)),
        env={k: render_template(v, values) for k, v in {**profile.env, **card.env, **flags.env}.items()},
        labels={"runner.managed": "true", "runner.card": card.name, "runner.flags": flags.name},
        gpu=card.gpu, options=card.options)


def request_shape(matrix: Matrix, card: Card) -> RequestShape:
    profile, run = matrix.servers[card.server], matrix.run
    return RequestShape(dialect=profile.dialect, model=profile.model,
                        prompt_by_fixture={n: f.prompt for n, f in matrix.fixtures.items()}, steps=run.steps,
                        size=run.size, true_cfg_scale=run.true_cfg_scale, negative_prompt=run.negative_prompt)


def first_seed_off_target(matrix: Matrix, card: str, flags: str) -> bool:
    """Under `repeats = "auto"`, whether this session sends only the first seed at the reference counts other
    than the target (every seed at the target): its flag set decides no world — its role is neither `default`
    nor an offload role, so it is in no latency ratio and no rule reads it — and it is not the baseline cell
    (whose images the others are scored against, seed by seed). What its other counts show, memory per
    reference and whether the output is broken, one seed shows: memory at a fixed size and count does not
    depend on the seed — the premise of `oom_implies_seeds`, so not with that set false."""
    run = matrix.run
    cell = matrix.baseline.cell if matrix.baseline else None
    return (run.auto_repeats and run.oom_implies_seeds and len(run.seeds) > 1
            and not matrix.verdict.decides_world(matrix.flags[flags].role)
            and not (cell is not None and cell[1] == flags and cell[0] in (card, None)))


def seeds_at(matrix: Matrix, card: str, flags: str, references: int) -> tuple[int, ...]:
    """The seeds a session sends at a reference count (first_seed_off_target)."""
    seeds = matrix.run.seeds
    if references != matrix.verdict.target_references and first_seed_off_target(matrix, card, flags):
        return seeds[:1]
    return seeds


def make_plan(matrix: Matrix) -> Plan:
    axes = matrix.axes
    by_device: dict[str, list[Session]] = {}
    cards_of: dict[str, list[str]] = {}
    for card in axes.cards:
        flag_names = [f for f in axes.flags if axes.kept(card, f)]
        # A baseline cell on this card runs first, so its images exist before the others are scored.
        cell = matrix.baseline.cell if matrix.baseline else None
        if cell and cell[0] in (card, None):
            flag_names.sort(key=lambda f: f != cell[1])
        c = matrix.cards[card]
        sessions = tuple(
            Session(card, flags, tuple(Step(card, flags, fx, n, seed) for n in axes.references for fx in axes.fixtures
                                       for seed in seeds_at(matrix, card, flags, n)),
                    server_plan(matrix, c, matrix.flags[flags]), request_shape(matrix, c))
            for flags in flag_names
        )
        if sessions:
            device = device_of(matrix, card)
            by_device.setdefault(device, []).extend(sessions)
            cards_of.setdefault(device, []).append(card)
    return Plan(tuple(Lane(d, tuple(cards_of[d]), tuple(ss)) for d, ss in by_device.items()))


def sends_text(run: RunSettings) -> str:
    """How many timed sends each step gets, in words: `repeats` fixed, or auto's one and its ceiling."""
    if run.auto_repeats:
        return f"1 timed send (repeats = auto: up to {run.max_repeats} where a latency ratio is open)"
    return f"{run.repeats} timed send(s)"


def describe(plan: Plan, matrix: Matrix) -> str:
    """The text `runner plan` prints: what would start and what would be sent, nothing run."""
    run = matrix.run
    size = "server default" if run.size is None else f"{run.size[0]}x{run.size[1]}"
    lines = [
        f"matrix {matrix.path} (sha256 {matrix.sha256[:12]}), run '{run.name}'",
        f"{len(plan.lanes)} lane(s) in parallel, {len(plan.sessions)} session(s), "
        f"{len(plan.steps)} step(s) × {sends_text(run)}; {run.steps} steps, size {size}, "
        f"seeds {list(run.seeds)}",
    ]
    for lane in plan.lanes:
        if len(lane.cards) > 1:
            lines.append(f"lane {lane.name}: cards {', '.join(lane.cards)} share this device, one after another")
        for s in lane.sessions:
            if s is next(x for x in lane.sessions if x.card == s.card):
                card = matrix.cards[s.card]
                lines.append(f"card {s.card}: {fmt_bytes(card.vram_gib * GIB)}, gpu {card.gpu or '-'}, "
                             f"{card.options.where()}, "
                             f"server '{card.server}', meters {', '.join(card.meters)}")
            fs = matrix.flags[s.flags]
            lines.append(f"  session {s.key} [{fs.role}]")
            if s.server is not None:
                srv = s.server
                line = BACKENDS.get(srv.backend).start_line
                what = line(srv) if line else srv.backend
                lines.append(f"    starts ({what}, ready at GET {srv.profile.health_path}):")
                lines.append(f"      {srv.command_line() or '(image default command)'}")
                env = mask_env(srv.env)
                if env:
                    shown = (f"{k}={v if v == MASK else shlex.quote(v)}" for k, v in env.items())
                    lines.append("      env " + " ".join(shown))
            refs = sorted({st.references for st in s.steps})
            lines.append(f"    {len(s.steps)} step(s) × {sends_text(run)}: references {refs} × fixtures "
                         f"{list(matrix.axes.fixtures)} × seeds {list(run.seeds)}")
            if first_seed_off_target(matrix, s.card, s.flags):
                lines.append(f"      (role '{fs.role}' decides no world: every seed at "
                             f"{matrix.verdict.target_references} reference(s), seed {run.seeds[0]} only at the "
                             f"other counts)")
            if s.request is not None:
                rq = s.request
                lines.append(f"    request: {rq.dialect}, model {rq.model!r}, {rq.steps} steps, size {size}"
                             f"{'' if rq.true_cfg_scale is None else f', true_cfg_scale {rq.true_cfg_scale:g}'}"
                             f"{'' if rq.negative_prompt is None else ', negative prompt'}")
    if matrix.baseline:
        b = matrix.baseline
        cell = b.cell and (f"{b.cell[0]}/{b.cell[1]}" if b.cell[0] else f"each card's own '{b.cell[1]}'")
        lines.append(f"baseline: {b.directory if b.directory else 'cell ' + str(cell)}")
    lines += soak.describe(matrix)
    for path in matrix.missing_files:
        lines.append(f"warning: file not found here (needed to run): {path}")
    return "\n".join(lines)
