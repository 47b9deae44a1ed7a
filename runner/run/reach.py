"""Preflight over the network: every host a run will use is reached before the first server starts.

A card names up to four places outside this process: its Docker engine (the local socket, `tcp://` or
`ssh://`), the meter sidecar, dcgm-exporter and Prometheus (each only when its meter is in the card's
`meters`). One that does not answer would otherwise surface mid-run as a wall of per-step skips; here it is
one line naming the card, the place and the cause. `endpoints` is pure; `unreachable` probes (bounded in
time, in parallel, each address once).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

from runner.core.registry import BACKENDS, METERS, Target, load
from runner.core.units import clip
from runner.observe import quote
from runner.plan.matrix import Matrix

TIMEOUT_S = 5.0  # per probe; probes run in parallel, so a run with every host down waits about this long
SSH_CONNECT_TIMEOUT_S = 10
CAUSE_CHARS = 200


@dataclass(frozen=True)
class Endpoint:
    card: str
    what: str  # "docker host", "sidecar", "dcgm-exporter", "Prometheus"
    address: str  # as the matrix (or DOCKER_HOST) names it
    probe_url: str  # what is asked: the address itself, or an HTTP URL under it
    # "module:function"(url, timeout_s) of the backend that owns it (or the function: a registry entry made at run
    # time may name the object itself); None: an HTTP GET
    probe: Target | None = None


@dataclass(frozen=True)
class Unreachable:
    endpoint: Endpoint
    cause: str

    @property
    def card(self) -> str:
        return self.endpoint.card

    def line(self) -> str:
        e = self.endpoint
        return f"card '{e.card}': {e.what} {e.address} is unreachable ({self.cause})"


def endpoints(matrix: Matrix, cards: Iterable[str]) -> list[Endpoint]:
    """The places these cards' sessions will talk to, in matrix order: what each backend's and each listed
    meter's registry entry says it reaches."""
    found = []
    for name in cards:
        card = matrix.cards[name]
        backend = BACKENDS.get(card.backend)
        place = load(backend.endpoint)(card.options) if backend.endpoint else None
        if place is not None:
            found.append(Endpoint(name, place[0], place[1], place[1], backend.probe))
        for meter in card.meters:
            entry = METERS.get(meter) if meter in METERS else None
            options = card.meter_options.get(meter)
            url = options.address() if options is not None else None
            if entry is not None and entry.reach is not None and url:
                what, path = entry.reach
                found.append(Endpoint(name, what, url, url.rstrip("/") + path if path else url))
    return found


def unreachable(matrix: Matrix, cards: Iterable[str], timeout_s: float = TIMEOUT_S) -> list[Unreachable]:
    """Every endpoint of these cards that does not answer, with the cause; [] when all do."""
    found = endpoints(matrix, cards)
    targets = list(dict.fromkeys((e.probe, e.probe_url) for e in found))
    if not targets:
        return []
    with ThreadPoolExecutor(max_workers=min(8, len(targets))) as pool:
        causes = dict(zip(targets, pool.map(lambda t: probe(t[0], t[1], timeout_s), targets), strict=True))
    return [Unreachable(e, cause) for e in found if (cause := causes[(e.probe, e.probe_url)]) is not None]


def probe(how: Target | None, url: str, timeout_s: float) -> str | None:
    """None when the place answers; else the cause, one inert line. `how`: the owning backend's probe, or
    None for an HTTP GET."""
    try:
        cause = load(how)(url, timeout_s) if how else _probe_http(url, timeout_s)
    except Exception as exc:  # a probe must end as a cause, never as a traceback
        cause = f"{type(exc).__name__}: {exc}"
    return None if cause is None else one_line(cause)


def one_line(text: str) -> str:
    """Untrusted text (a remote error) for the console: line breaks as spaces, every other control character
    a visible escape (runner.observe.quote), bounded."""
    return clip(quote.console(" ".join(text.splitlines())), CAUSE_CHARS)


def _probe_http(url: str, timeout_s: float) -> str | None:
    import httpx

    try:
        with httpx.stream("GET", url, timeout=timeout_s) as response:  # the body is never read
            if response.is_success:
                return None
            return f"GET {url} answered HTTP {response.status_code}"
    except httpx.HTTPError as exc:
        return f"GET {url}: {type(exc).__name__}: {exc}"


def probe_engine(url: str, timeout_s: float) -> str | None:
    """The docker backend's probe: `ssh://` through the ssh client the SDK will run, else a ping."""
    return _probe_ssh(url) if url.startswith("ssh://") else _probe_engine(url, timeout_s)


def _probe_engine(url: str, timeout_s: float) -> str | None:
    from docker.errors import DockerException

    from runner.backends.docker import connect, engine_url

    host = None if url == engine_url(None) else url  # the environment's engine: from_env, with its TLS settings
    try:
        client = connect(host, timeout=max(1, round(timeout_s)))
        try:
            client.ping()
        finally:
            client.close()
    except DockerException as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def ssh_argv(url: str) -> list[str]:
    """The ssh command the Docker SDK's shell-out mode runs (ssh [-l user] [-p port] -- host …), asking the
    engine for its version instead of dialling it, and never prompting: the run's lanes cannot answer a
    prompt either."""
    parts = urlsplit(url)
    argv = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_CONNECT_TIMEOUT_S}"]
    if parts.username:
        argv += ["-l", parts.username]
    if parts.port:
        argv += ["-p", str(parts.port)]
    return [*argv, "--", parts.hostname or "", "docker", "version", "--format", "{{.Server.Version}}"]


def _probe_ssh(url: str) -> str | None:
    if shutil.which("ssh") is None:
        return "no ssh client on PATH (the Docker SDK's ssh:// mode runs it)"
    try:
        proc = subprocess.run(ssh_argv(url), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              errors="replace", timeout=SSH_CONNECT_TIMEOUT_S + 20)
    except subprocess.TimeoutExpired:
        return f"ssh did not finish within {SSH_CONNECT_TIMEOUT_S + 20} s"
    if proc.returncode == 0 and proc.stdout.strip():
        return None
    lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
    return lines[-1][-CAUSE_CHARS:] if lines else f"ssh exited with {proc.returncode} and said nothing"
