"""Backend `docker`: the server as a container on a local engine (unix://) or a remote one (ssh://, tcp://).

The container publishes its port on a host port the engine picks; the runner reads it back and talks to
`http://<engine host>:<port>`. Its logs are streamed into the session log file, so request-window OOM
lines are found exactly as with the local backend. Every container carries `runner.managed=true`, the
run's labels and its owner (runner host, PID, PID start time); nothing here touches a container without
them, and reap() removes only containers whose owner is provably dead.

`ssh://user@host[:port]` uses the SDK's shell-out mode (`use_ssh_client=True`): the local `ssh` binary with
the user's own config, keys and agent, running `docker system dial-stdio` on the host. The SDK imports
paramiko for any ssh:// URL even in this mode, so paramiko must be installed (the `docker[ssh]` extra).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import docker
import requests
from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from docker.models.containers import Container
from docker.types import DeviceRequest
from docker.types import Mount as DockerMount

from runner.backends import owner
from runner.backends.base import Attempt, ExitInfo, RunningServer
from runner.core.registry import LOOPBACK, DockerOptions
from runner.core.secrets import resolve_env
from runner.plan.lanes import ServerPlan
from runner.plan.matrix import Mount

MANAGED = "runner.managed"
STOP_TIMEOUT_S = 10  # SIGTERM grace before the engine sends SIGKILL
LOG_DRAIN_S = 5.0  # how long exited()/stop() wait for the log stream to reach the file
# What the SDK raises when the engine itself is gone (dockerd stopped, the ssh link cut): requests' own
# ConnectionError is not a DockerException.
ENGINE_GONE = (DockerException, requests.exceptions.RequestException, OSError)
WILDCARD = ("", "0.0.0.0", "::")


# --- engine addressing -------------------------------------------------------------------------------------


def engine_url(docker_host: str | None) -> str:
    """The engine URL actually used: the card's, else DOCKER_HOST, else the local socket."""
    return docker_host or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def is_local(docker_host: str | None) -> bool:
    """True when the engine runs on this machine (its bind paths and published ports are ours)."""
    url = urlsplit(engine_url(docker_host))
    return url.scheme in ("unix", "npipe") or (url.hostname or "") in LOOPBACK


def _ssh_close(self: Any) -> None:
    """docker-py 7's shell-out SSHSocket.close writes two newlines to the ssh process's stdin on every call and never
    closes it: once ssh has exited, a later close (the pool's, or garbage collection's after the test summary)
    raises BrokenPipeError, printed as "Exception ignored in ..." (docker/docker-py#3218). Here a pipe to an
    ssh that is gone is not an error, and the pipe is closed, so a second close does nothing."""
    proc = self.proc
    if not proc or proc.stdin.closed:
        return
    try:
        proc.stdin.write(b"\n\n")
        proc.stdin.flush()
    except (BrokenPipeError, ValueError):  # the ssh process already exited (or closed its end)
        pass
    finally:
        with contextlib.suppress(OSError):
            proc.stdin.close()
        proc.terminate()


def _tolerate_closed_ssh() -> None:
    from docker.transport import sshconn

    sshconn.SSHSocket.close = _ssh_close  # type: ignore[method-assign]


def connect(docker_host: str | None, timeout: int = 60) -> docker.DockerClient:
    url = engine_url(docker_host)
    if url.startswith("ssh://"):
        _tolerate_closed_ssh()
        return docker.DockerClient(base_url=url, use_ssh_client=True, timeout=timeout)
    if docker_host is None:
        return docker.from_env(timeout=timeout)  # honours DOCKER_HOST/DOCKER_TLS_VERIFY/DOCKER_CERT_PATH
    return docker.DockerClient(base_url=url, timeout=timeout)


def reachable_host(docker_host: str | None, publish_host: str) -> str:
    """The address the runner uses for a port published on `publish_host` by this engine."""
    if publish_host not in WILDCARD and publish_host not in LOOPBACK:
        return publish_host  # bound to one specific address: that is where it answers
    if is_local(docker_host):
        return "127.0.0.1"
    if publish_host in LOOPBACK:
        raise ValueError(f"publish_host {publish_host} on the remote engine {docker_host} is unreachable from "
                         f"the runner; set the card's publish_host to '0.0.0.0' or the host's address")
    return urlsplit(engine_url(docker_host)).hostname or "127.0.0.1"


# --- container options ---------------------------------------------------------------------------------------


def bind_mounts(mounts: tuple[Mount, ...], docker_host: str | None) -> list[DockerMount]:
    """Bind mounts; `~` is expanded only for a local engine (a remote path belongs to the remote host)."""
    local = is_local(docker_host)
    out = []
    for m in mounts:
        source = str(Path(m.source).expanduser().resolve()) if local else m.source
        if not source.startswith("/"):
            raise ValueError(f"mount source {m.source!r} must be an absolute path on the remote host "
                             f"{docker_host} ('~' cannot be expanded there)")
        out.append(DockerMount(target=m.target, source=source, type="bind", read_only=m.read_only))
    return out


def gpu_request(gpu: str | None) -> list[DeviceRequest]:
    """One card by index or UUID (`GPU-...`); none when the spec names no GPU (CPU servers)."""
    if gpu is None or gpu == "":
        return []
    return [DeviceRequest(device_ids=[str(gpu)], capabilities=[["gpu"]])]


def published_port(container: Container, container_port: int) -> int | None:
    bindings = (container.attrs.get("NetworkSettings") or {}).get("Ports") or {}
    for binding in bindings.get(f"{container_port}/tcp") or []:
        if binding.get("HostPort"):
            return int(binding["HostPort"])
    return None


def working_set(stats: dict[str, Any]) -> int | None:
    """Container memory as `docker stats` shows it: usage less the reclaimable inactive file cache."""
    mem = stats.get("memory_stats") or {}
    usage = mem.get("usage")
    if usage is None:
        return None
    detail = mem.get("stats") or {}
    cache = detail.get("total_inactive_file", detail.get("inactive_file", 0))  # cgroup v1 / v2
    return max(0, int(usage) - int(cache))


def cgroup_files(pid: int, container_id: str) -> tuple[Path, Path] | None:
    """(usage file, memory.stat) of a local container's memory cgroup, found from its init process.

    Reading these costs microseconds; the engine's stats endpoint answers about once a second. The
    container id must be in the path: a PID from another PID namespace could name a different process.
    """
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    entries = [line.split(":", 2) for line in lines if line.count(":") >= 2]
    for _, controllers, path in entries:  # cgroup v1 (or hybrid): the memory controller's own tree
        if "memory" in controllers.split(",") and container_id in path:
            base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            return base / "memory.usage_in_bytes", base / "memory.stat"
    for hierarchy, _, path in entries:  # cgroup v2: one unified tree
        if hierarchy == "0" and container_id in path:
            base = Path("/sys/fs/cgroup") / path.lstrip("/")
            return base / "memory.current", base / "memory.stat"
    return None


def read_cgroup_working_set(files: tuple[Path, Path]) -> int:
    usage = int(files[0].read_text())
    stat = dict(line.split(" ", 1) for line in files[1].read_text().splitlines() if " " in line)
    cache = int(stat.get("total_inactive_file", stat.get("inactive_file", 0)))
    return max(0, usage - cache)


# --- the server --------------------------------------------------------------------------------------------


class DockerServer(RunningServer):
    options: DockerOptions

    def __init__(self, plan: ServerPlan, attempt: Attempt) -> None:
        super().__init__(plan, attempt)
        assert isinstance(plan.options, DockerOptions), "the registry pairs this backend with DockerOptions"
        self.options = plan.options
        self.profile = plan.profile
        self.client: docker.DockerClient | None = None
        self.container: Container | None = None
        self.host_port: int | None = None
        self._info: dict[str, Any] = {"docker_host": engine_url(self.options.docker_host)}
        self._exit: ExitInfo | None = None
        self._log_thread: threading.Thread | None = None
        self._stopped = False
        self._cgroup: tuple[Path, Path] | None = None

    @property
    def base_url(self) -> str:
        host = reachable_host(self.options.docker_host, self.options.publish_host)
        return f"http://{host}:{self.host_port or 0}"

    def start(self) -> None:
        profile, options = self.profile, self.options
        if not profile.image or not profile.port:
            raise ValueError("the docker backend needs the server profile's image and port")
        reachable_host(options.docker_host, options.publish_host)  # fail before creating anything
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.client = connect(options.docker_host)
        image = self._image()
        self._remove_stale(self.name)
        # The server listens on the profile's port inside the container; the engine publishes it on a free
        # host port, read back below.
        argv, env = self.command(profile.port)
        # create, then start: a start the engine refuses (no NVIDIA runtime for a GPU request, port taken)
        # leaves a created container, which stop() must still be able to remove.
        self.container = self.client.containers.create(
            image.id, command=list(argv), environment=resolve_env(env, os.environ),
            labels={**self.labels, **owner.me().labels()},
            name=self.name, auto_remove=False, mounts=bind_mounts(profile.mounts, options.docker_host),
            # An init as PID 1 forwards stop's SIGTERM (a shell or `sleep` as PID 1 ignores it) and reaps
            # the server's worker processes.
            init=True,
            ports={f"{profile.port}/tcp": (options.publish_host, None)},
            device_requests=gpu_request(self.plan.gpu), shm_size=profile.shm_size, ipc_mode=profile.ipc_mode,
            # swap equal to the limit: the server cannot page its way past it, the OOM killer ends it
            mem_limit=options.mem_limit, memswap_limit=options.mem_limit,
        )
        self.container.start()
        self._info["container_id"] = self.container.id
        self._info["mem_limit"] = options.mem_limit
        self._info["container_name"] = self.name
        self._start_log_stream()
        self.host_port = self.port = self._read_port()
        self._cgroup = self._find_cgroup()

    def _image(self) -> Any:
        """The local image (never pulled: the digest recorded must be the one that ran)."""
        assert self.client is not None
        try:
            image = self.client.images.get(self.profile.image)
        except ImageNotFound:
            raise ValueError(f"image {self.profile.image} is not on the engine {self._info['docker_host']}; "
                             f"build or load it there first (see docs/docker.md)") from None
        version = self.client.version()
        self._info.update(image=self.profile.image, image_id=image.id,
                          repo_digests=list(image.attrs.get("RepoDigests") or []),
                          engine_version=version.get("Version"), engine_api=version.get("ApiVersion"),
                          engine_os=f"{version.get('Os')}/{version.get('Arch')}", gpu=self.plan.gpu)
        return image

    def _remove_stale(self, name: str) -> None:
        """A container of the same deterministic name left by an interrupted attempt (resume) goes first."""
        assert self.client is not None
        try:
            old = self.client.containers.get(name)
        except NotFound:
            return
        if old.labels.get(MANAGED) != "true":
            raise ValueError(f"a container named {name} exists and is not managed by runner; not touching it")
        # Same name = same run id: an earlier attempt of this run. Replaced unless a live runner (another
        # process resuming the same run) still owns it.
        dead, why = owner.owner_state(old.labels)
        previous = owner.from_labels(old.labels)
        if previous is not None and not dead and previous != owner.me():
            raise ValueError(f"a container named {name} exists and belongs to another run ({why}); "
                             f"not touching it")
        with contextlib.suppress(NotFound):  # its dead owner's reaper may have been quicker
            old.remove(force=True)

    def _read_port(self) -> int | None:
        """The engine assigns the host port at start; a container that already exited has none."""
        assert self.container is not None
        for _ in range(20):
            self.container.reload()
            port = published_port(self.container, self.profile.port)
            if port is not None or self.container.status not in ("created", "running"):
                return port
            time.sleep(0.1)
        return None

    def _find_cgroup(self) -> tuple[Path, Path] | None:
        assert self.container is not None
        pid = (self.container.attrs.get("State") or {}).get("Pid") or 0
        files = cgroup_files(pid, self.container.id) if pid and is_local(self.options.docker_host) else None
        if files is not None and not files[0].is_file():
            files = None
        if files is not None:
            # A host PID of this machine (the container's init; the server is its descendant): the NVML
            # meter tells the server's GPU processes from others' by it. Only when the cgroup check proved
            # the PID is in our namespace.
            self._info["pid"] = pid
        self._info["host_memory_source"] = "cgroup" if files else "engine stats API (about 1 Hz)"
        return files

    # -- logs -------------------------------------------------------------------------------------------
    def _start_log_stream(self) -> None:
        self._log_thread = threading.Thread(target=self._stream_logs, name=f"logs-{self.name}",
                                            daemon=True)
        self._log_thread.start()

    def _stream_logs(self) -> None:
        assert self.container is not None
        with self.log_path.open("ab") as log:
            try:
                for chunk in self.container.logs(stream=True, follow=True, stdout=True, stderr=True):
                    log.write(chunk)
                    log.flush()
            except (DockerException, OSError, ValueError) as exc:  # engine gone or stream cut: say so
                log.write(f"\n[runner] container log stream ended: {type(exc).__name__}: {exc}\n".encode())

    def _drain_logs(self) -> None:
        if self._log_thread is not None:
            self._log_thread.join(timeout=LOG_DRAIN_S)

    # -- state ------------------------------------------------------------------------------------------
    def exited(self) -> ExitInfo | None:
        if self._exit is not None:
            return self._exit
        if self.container is None:
            return ExitInfo(None)
        try:
            self.container.reload()
        except NotFound:
            self._exit = ExitInfo(None)
            return self._exit
        except ENGINE_GONE as exc:  # the engine went away: the server is lost to this run, whatever it does
            why = f"its Docker engine {self._info['docker_host']} does not answer: {type(exc).__name__}"
            self._exit = ExitInfo(None, lost=why)
            self._info.update(engine_lost=f"{why}: {exc}"[:500])
            return self._exit
        state = self.container.attrs.get("State") or {}
        if state.get("Status") in ("created", "running", "restarting", "paused"):
            return None
        # The log stream ends with the container: let it reach the file before anyone reads the tail.
        self._drain_logs()
        self._exit = ExitInfo(state.get("ExitCode"), bool(state.get("OOMKilled")))
        self._info.update(exit_code=self._exit.code, oom_killed=self._exit.oom_killed,
                          finished_at=state.get("FinishedAt"), error=state.get("Error") or None)
        return self._exit

    def stop(self) -> None:
        """Stop (SIGTERM, then SIGKILL after STOP_TIMEOUT_S) and remove. Never raises: a container the
        engine could not remove is named in info() and left for reap() at the next run."""
        if self._stopped:
            return
        self._stopped = True
        try:
            if self.container is not None and self.container.labels.get(MANAGED) == "true":
                with contextlib.suppress(NotFound):
                    self.exited()  # keep the exit code for info() before the container goes
                    self.container.stop(timeout=STOP_TIMEOUT_S)
                self._drain_logs()
                with contextlib.suppress(NotFound):
                    self.container.remove(force=True)
        except ENGINE_GONE as exc:
            if not (isinstance(exc, APIError) and exc.status_code == 409):  # 409: removal already under way
                self._info["stop_error"] = f"{type(exc).__name__}: {exc}"[:500]
        except Exception as exc:  # the docstring promises it never raises, whatever the SDK does
            self._info["stop_error"] = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            if self.client is not None:
                with contextlib.suppress(Exception):
                    self.client.close()

    def kill(self) -> None:
        """SIGKILL now, then the usual removal (a second Ctrl-C); never raises."""
        if self.container is not None and not self._stopped:
            with contextlib.suppress(Exception):
                self.container.kill()
        self.stop()

    def foreign_answer(self) -> str | None:
        """The runner talks to the port the engine published for this container: it must still be this
        container's, and the container must be running (else another listener could have the port)."""
        if self.container is None or self.host_port is None:
            return None
        try:
            self.container.reload()
        except NotFound:
            return f"container {self.name} is gone; not probing port {self.host_port}"
        except ENGINE_GONE as exc:
            return f"the Docker engine does not answer ({type(exc).__name__}); not probing port {self.host_port}"
        port = published_port(self.container, self.profile.port)
        if port != self.host_port:
            return (f"port {self.host_port} is no longer published by container {self.name} "
                    f"(now {port}); not measuring whatever answers there")
        return None

    def host_memory_bytes(self) -> int | None:
        """The container's working set: from its cgroup files on a local engine, else one-shot stats."""
        if self.container is None or self._stopped or self._exit is not None:
            return None
        if self._cgroup is not None:
            try:
                return read_cgroup_working_set(self._cgroup)
            except (OSError, ValueError):
                return None  # the cgroup goes with the container
        try:
            stats = self.container.stats(stream=False, one_shot=True)
        except ENGINE_GONE:
            return None
        return working_set(stats)

    def info(self) -> dict[str, Any]:
        return {**self._info, "host_port": self.host_port, "base_url": self.base_url if self.host_port else None}


# --- cleanup of earlier runs -----------------------------------------------------------------------------


def endpoint(options: DockerOptions) -> tuple[str, str]:
    """What preflight reaches for a docker card: the engine URL this backend will use."""
    return "docker host", engine_url(options.docker_host)


def reap_hosts(options: list[DockerOptions]) -> list[str]:
    """The backend's cleanup before a run (registry entry `reap`): on each engine the cards name, the
    managed containers whose runner is provably dead are removed; each line says what and why."""
    lines = []
    for host in dict.fromkeys(o.docker_host for o in options):
        where = host or "local engine"
        try:
            for name, removed, why in reap(host):
                lines.append(f"{'removed' if removed else 'left'} container {name} ({where}): {why}")
        except DockerException as exc:
            lines.append(f"could not check {where} for leftover containers: {exc}")
    return lines


def reap(docker_host: str | None, keep_run: str | None = None) -> list[tuple[str, bool, str]]:
    """Remove managed containers whose owning runner is provably dead, on one engine.

    A container is removed only when its labels name a runner on this host whose PID (with its start time)
    no longer runs; a live run's containers, another host's, this run's (`keep_run`) and ones without owner
    labels are kept. Containers without runner.managed=true are never listed, so never touched.
    Returns (name, removed, why) for every managed container looked at.
    """
    client = connect(docker_host)
    notes = []
    try:
        for c in client.containers.list(all=True, filters={"label": f"{MANAGED}=true"}, ignore_removed=True):
            if c.labels.get(MANAGED) != "true" or (keep_run and c.labels.get("runner.run") == keep_run):
                continue
            dead, why = owner.owner_state(c.labels)
            if dead:
                with contextlib.suppress(NotFound):
                    c.remove(force=True)
            notes.append((c.name, dead, why))
    finally:
        client.close()
    return notes


PROFILE_TARGET = "/runner-profile"


def profile_dir(plan: ServerPlan, folder: Path) -> tuple[ServerPlan, str]:
    """A container sees the runner's folder through a writable bind mount; a remote engine's mount would be a
    folder on that host, which the runner does not read."""
    options = plan.options
    host = getattr(options, "docker_host", None)
    if host and not str(host).startswith("unix://"):
        raise ValueError(f"the server runs on the remote Docker host {host}: a snapshot it writes stays there")
    from runner.plan.matrix import Mount

    mounts = (*plan.profile.mounts, Mount(source=str(folder), target=PROFILE_TARGET, read_only=False))
    return replace(plan, profile=plan.profile.model_copy(update={"mounts": mounts})), PROFILE_TARGET

