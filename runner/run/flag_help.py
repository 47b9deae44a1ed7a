"""Preflight: the flags of a vLLM-Omni server that names no release, asked of the server's own command.

A fork (the seed's `8484d85d1`), a pre-release tag, or a release with no shipped vocabulary has no data file
to check a flag set against (runner.plan.cli_flags); its own parser knows. Before any session starts, the
command each pending card would start is run once more with `--help=all` appended (vLLM's parser lists only
its groups under a plain `--help`; `--help=all` lists every flag), else with `--help` (a plain argparse
program refuses `--help=all`), and the option lines of what it prints (cli_flags.parse_help) are the
vocabulary. Where, is the card's backend's (its registry entry's `ask_help`):

- docker: a container of the pinned image on the card's engine (local or ssh://), with the server's
  arguments, no GPU and no network, removed after; never pulled (a start needs the image there too);
- local and slurm: the command as a subprocess here, where the runner runs, with no GPU visible.

A `--help` takes a vLLM import (tens of seconds), so each answer is cached per user
($RUNNER_CACHE_DIR, else $XDG_CACHE_HOME/runner, else ~/.cache/runner; server-flags/), keyed by what decides
it: the image's id (content-addressed) or the program file (path, size, modification time) and a script it
runs, with the arguments asked. (A `python -m module` command is keyed by the interpreter: a refusal read
from the cache names the file, to delete when the module changed.) Where asking is impossible — the image is
not on the engine, the program is not on this machine, `--help` fails, hangs past TIMEOUT_S or lists no
flags — one line says the flags were not checked and why: never silence.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from runner.core.registry import BACKENDS, load
from runner.core.secrets import resolve_env
from runner.plan import cli_flags
from runner.plan.cli_flags import Vocabulary
from runner.plan.lanes import RUNTIME_PORT, Plan, ServerPlan
from runner.plan.matrix import Matrix
from runner.run.reach import one_line

TIMEOUT_S = 180.0  # a vLLM import in a container, cold: well under a minute on the seed's hosts
POLL_S = 0.2
HELP_ARGS = ("--help=all", "--help")
MAX_HELP_BYTES = 4 * 2**20  # vLLM's --help=all is ~150 KB
MAX_CACHE_BYTES = 4 * 2**20
ERR_TAIL_BYTES = 4096


class HelpUnavailable(Exception):
    """Why a server's `--help` cannot be asked (one line)."""


class Asker(Protocol):
    """What a backend's `ask_help` returns for one server: `key` decides the answer (the cache's key),
    `name` says whose flags they are, `where` where they were asked; `run` runs the server's command with
    these arguments and returns (exit status, stdout, the end of stderr)."""

    key: str
    name: str
    where: str

    def run(self, argv: tuple[str, ...], timeout_s: float, stop: threading.Event) -> tuple[int, str, str]: ...

    def close(self) -> None: ...


def help_argv(server: ServerPlan) -> tuple[str, ...]:
    """The server's command as a start renders it, without a flag set's arguments (they are what is being
    checked), a picked port written as 0 (a value argparse reads; nothing is bound)."""
    command = server.argv[: len(server.profile.command)]
    return tuple(a.replace(RUNTIME_PORT, str(server.profile.port or 0)) for a in command)


def shape(argv: tuple[str, ...]) -> tuple[str, ...]:
    """What of a command decides which parser answers: what precedes its first long flag (the program, a script
    or `-m module`, the model) and the option strings, not their values (a card's `{vram_gib}`, a port)."""
    first = next((i for i, a in enumerate(argv) if a.startswith("--")), len(argv))
    return (*argv[:first], *(a.partition("=")[0] for a in argv[first:] if a.startswith("-")))


def cache_dir() -> Path:
    if os.environ.get("RUNNER_CACHE_DIR"):
        return Path(os.environ["RUNNER_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "runner"


def _cache_file(key: str) -> Path:
    return cache_dir() / "server-flags" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def read_cache(key: str) -> tuple[frozenset[str], frozenset[str], str] | None:
    """(flags, valued, how it was asked) cached for this key; None when absent, unreadable or not this key's."""
    path = _cache_file(key)
    try:
        if path.stat().st_size > MAX_CACHE_BYTES:
            return None
        doc = json.loads(path.read_text(encoding="utf-8"))
        flags, valued, asked = doc["flags"], doc["valued"], doc["asked"]
        if doc["key"] != key or asked not in HELP_ARGS or not all(
                isinstance(x, list) and all(isinstance(f, str) and cli_flags.OPTION.fullmatch(f) for f in x)
                for x in (flags, valued)):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return frozenset(flags), frozenset(valued), asked


def write_cache(key: str, vocab: Vocabulary, asked: str) -> None:
    """Best effort: a cache that cannot be written only means the next run asks again."""
    path = _cache_file(key)
    doc = {"key": key, "asked": asked, "at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
           "flags": sorted(vocab.flags), "valued": sorted(vocab.valued or ())}
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(doc, f)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


@dataclass(frozen=True)
class Answer:
    vocab: Vocabulary | None
    cause: str | None  # why there is no vocabulary


def ask(server: ServerPlan, timeout_s: float = TIMEOUT_S, stop: threading.Event | None = None) -> Answer:
    """The server's flags from its own `--help` (cached), or why they could not be read. Never raises."""
    stop = stop or threading.Event()
    entry = BACKENDS.get(server.backend)
    if entry.ask_help is None:
        return Answer(None, f"the {server.backend} backend cannot ask a server for its --help")
    argv = help_argv(server)
    asker: Asker | None = None
    try:
        asker = load(entry.ask_help)(server)
        key = f"{asker.key} argv {json.dumps(shape(argv))}"
        if cached := read_cache(key):
            flags, valued, asked = cached
            return Answer(Vocabulary(asker.name, flags, f"its {asked} {asker.where}, cached in {_cache_file(key)}: "
                                                        f"delete it to ask again", valued), None)
        tried = []
        for extra in HELP_ARGS:
            if stop.is_set():
                return Answer(None, "the run was interrupted")
            rc, out, err = asker.run((*argv, extra), timeout_s, stop)
            vocab = cli_flags.from_help(out, asker.name, f"its {extra} {asker.where}") if rc == 0 else None
            if vocab is not None:
                write_cache(key, vocab, extra)
                return Answer(vocab, None)
            last = next((ln.strip() for ln in reversed(err.splitlines()) if ln.strip()), "")
            tried.append(f"{extra} exited with {rc}" + (f" ({last})" if last and rc else "")
                         if rc else f"{extra} listed no flags")
        return Answer(None, f"{asker.name}: " + "; ".join(tried))
    except HelpUnavailable as exc:
        return Answer(None, f"{asker.name}: {exc}" if asker is not None else str(exc))
    except Exception as exc:  # a preflight ends as a line, never as a traceback
        return Answer(None, f"{asker.name + ': ' if asker is not None else ''}{type(exc).__name__}: {exc}")
    finally:
        if asker is not None:
            with contextlib.suppress(Exception):
                asker.close()


def check(matrix: Matrix, plan: Plan, cards: Iterable[str], *, timeout_s: float = TIMEOUT_S,
          stop: threading.Event | None = None) -> list[str]:
    """Every vLLM-Omni server of these cards that names no release (cli_flags.asks_help): its flag sets against
    its own `--help` where each card runs it (asked in parallel, each distinct engine/command once).
    UserError (one line, cli_flags.check_server) for the first bad flag; returns one line per server whose
    flags could not be asked everywhere (what was not checked, and why)."""
    cards = list(cards)
    targets: dict[tuple[Any, ...], tuple[str, str, ServerPlan]] = {}
    for card in cards:
        name = matrix.cards[card].server
        if cli_flags.asks_help(matrix.servers[name]) is None:
            continue
        server = next((s.server for s in plan.sessions if s.card == card and s.server is not None), None)
        if server is not None:
            ident = (name, server.backend, server.options, server.profile.image, shape(help_argv(server)))
            targets.setdefault(ident, (name, card, server))
    if not targets:
        return []
    todo = list(targets.values())
    with ThreadPoolExecutor(max_workers=min(8, len(todo))) as pool:
        answers = list(pool.map(lambda t: ask(t[2], timeout_s, stop), todo))
    lines = []
    for name in dict.fromkeys(t[0] for t in todo):
        mine = [(card, a) for (n, card, _), a in zip(todo, answers, strict=True) if n == name]
        for _, answer in mine:
            if answer.vocab is not None:
                cli_flags.check_server(matrix, name, answer.vocab)
        missed = [(card, a.cause) for card, a in mine if a.vocab is None]
        if missed:
            checked = [card for card, a in mine if a.vocab is not None]
            what = (f"its flag sets are checked against card(s) {', '.join(checked)} only, not"
                    if checked else "its flag sets are not checked against its own --help")
            why = "; ".join(f"card {card}: {one_line(cause or '')}" for card, cause in missed)
            lines.append(f"server '{name}' names no vLLM-Omni release and {what} ({why}); a bad flag shows "
                         f"only when the server fails to start")
    return lines


# --- the backends' askers -------------------------------------------------------------------------------------


def _identity(path: str) -> str:
    st = os.stat(path)
    return f"{os.path.realpath(path)} {st.st_size} {st.st_mtime_ns}"


def _leading(argv: tuple[str, ...]) -> str:
    """How a command is named in a line: its program's file name and the arguments before its first --flag."""
    head = [os.path.basename(argv[0])] if argv else []
    for a in argv[1:]:
        if a.startswith("--"):
            break
        head.append(a)
    return shlex.join(head)


class LocalAsker:
    """The command as a subprocess here (local and slurm backends: at preflight the runner's machine is the
    one that can be asked), in its own process group, killed when it overruns; no GPU visible to it."""

    def __init__(self, server: ServerPlan) -> None:
        self.server = server
        argv = help_argv(server)
        program = shutil.which(argv[0]) if argv else None
        if program is None:
            raise HelpUnavailable(f"{argv[0] if argv else 'the command'} is not on this machine (the preflight "
                                  f"asks its --help where the runner runs)")
        scripts = [a for a in argv[1:2] if not a.startswith("-") and os.path.isfile(a)]
        self.key = "local " + " ".join(_identity(p) for p in (program, *scripts))
        self.name = f"`{_leading(argv)}`"
        self.where = "on this machine"

    def run(self, argv: tuple[str, ...], timeout_s: float, stop: threading.Event) -> tuple[int, str, str]:
        env = {**os.environ, **resolve_env(self.server.env, os.environ), "CUDA_VISIBLE_DEVICES": ""}
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                                        start_new_session=True)
            except OSError as exc:
                raise HelpUnavailable(f"{argv[0]} cannot be run here: {exc.strerror}") from None
            deadline = time.monotonic() + timeout_s
            while proc.poll() is None and time.monotonic() < deadline and not stop.is_set():
                time.sleep(POLL_S)
            if proc.returncode is None:  # overran, or the run was interrupted: its whole group goes
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise HelpUnavailable("the run was interrupted" if stop.is_set() else
                                      f"{shlex.join(argv[-1:])} did not finish within {timeout_s:g} s")
            return proc.returncode, _read(out, MAX_HELP_BYTES), _tail(err)

    def close(self) -> None:
        pass


def _read(f: Any, limit: int) -> str:
    f.seek(0)
    return bytes(f.read(limit)).decode("utf-8", "replace")


def _tail(f: Any) -> str:
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - ERR_TAIL_BYTES))
    return bytes(f.read()).decode("utf-8", "replace")


class DockerAsker:
    """A container of the pinned image on the card's engine (never pulled), with the server's arguments and
    environment, no GPU, no network; labelled like the runner's servers (managed, owner), so one left by a
    runner that died mid-ask is reaped by the next run."""

    def __init__(self, server: ServerPlan) -> None:
        from docker.errors import ImageNotFound

        from runner.backends.docker import ENGINE_GONE, connect, engine_url

        self.server = server
        options: Any = server.options
        image = server.profile.image or ""
        self.url = engine_url(options.docker_host)
        try:
            self.client = connect(options.docker_host, timeout=60)
        except ENGINE_GONE as exc:
            raise HelpUnavailable(f"the engine {self.url} did not answer ({type(exc).__name__}: {exc})") from None
        try:
            self.image = self.client.images.get(image)
        except ImageNotFound:
            self.close()
            raise HelpUnavailable(f"image {image} is not on the engine {self.url} (the runner never pulls; a "
                                  f"start needs it there too)") from None
        except ENGINE_GONE as exc:
            self.close()
            raise HelpUnavailable(f"the engine {self.url} did not answer ({type(exc).__name__}: {exc})") from None
        self.key = f"docker {self.image.id}"
        self.name = f"image {image}"
        self.where = f"on {self.url}, image id {self.image.id[:19]}"

    def run(self, argv: tuple[str, ...], timeout_s: float, stop: threading.Event) -> tuple[int, str, str]:
        from runner.backends import owner
        from runner.backends.docker import MANAGED

        container = self.client.containers.create(
            self.image.id, command=list(argv), environment=resolve_env(self.server.env, os.environ),
            labels={MANAGED: "true", "runner.purpose": "flag-help", **owner.me().labels()},
            name=f"runner-help-{uuid.uuid4().hex[:12]}", network_disabled=True, init=True)
        try:
            container.start()
            deadline = time.monotonic() + timeout_s
            while True:
                container.reload()
                state = container.attrs.get("State") or {}
                if state.get("Status") in ("exited", "dead"):
                    break
                if stop.is_set():
                    raise HelpUnavailable("the run was interrupted")
                if time.monotonic() > deadline:
                    raise HelpUnavailable(f"{argv[-1]} did not finish within {timeout_s:g} s")
                time.sleep(POLL_S)
            out = bytearray()
            for chunk in container.logs(stdout=True, stderr=False, stream=True):
                out += chunk[: MAX_HELP_BYTES - len(out)]
                if len(out) >= MAX_HELP_BYTES:
                    break
            err = container.logs(stdout=False, stderr=True, tail=20)
            return (int(state.get("ExitCode", -1)), bytes(out).decode("utf-8", "replace"),
                    bytes(err[-ERR_TAIL_BYTES:]).decode("utf-8", "replace"))
        finally:
            with contextlib.suppress(Exception):
                container.remove(force=True)

    def close(self) -> None:
        self.client.close()
