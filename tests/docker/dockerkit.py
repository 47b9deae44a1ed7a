"""Helpers shared by the docker tests (imported by name: tests/docker is on sys.path via its conftest)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import NamedTuple

import docker

from runner.backends.base import Attempt
from runner.core.registry import DockerOptions
from runner.plan.lanes import ServerPlan
from runner.plan.matrix import Mount, ServerProfile

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "docker" / "refserver" / "build.sh"
IMAGE = os.environ.get("RUNNER_REFSERVER_IMAGE", "runner-refserver:dev")
BASE_IMAGE = "runner-base:bookworm"
# This process's own (a pytest-xdist worker, or another checkout's suite on the same engine): the leftover
# checks count only this session's containers.
RUN_PREFIX = f"pytest-docker-{os.getpid()}-"
BUILD_TIMEOUT_S = 900


def new_run_id() -> str:
    return RUN_PREFIX + uuid.uuid4().hex[:10]


def labels(run_id: str, flags: str = "t", attempt: int = 0) -> dict[str, str]:
    return {"runner.managed": "true", "runner.run": run_id, "runner.card": "c", "runner.flags": flags,
            "runner.attempt": str(attempt)}


def leftovers(client: docker.DockerClient) -> list[str]:
    """Managed containers of these tests still on the engine (running or not)."""
    found = client.containers.list(all=True, filters={"label": "runner.managed=true"}, ignore_removed=True)
    return [c.name for c in found if c.labels.get("runner.run", "").startswith(RUN_PREFIX)]


def refserver_argv(*extra: str, vram_gib: str = "1") -> tuple[str, ...]:
    return ("python", "-m", "runner.refserver", "--host", "0.0.0.0", "--port", "8000", "--preset", "tiny",
            "--vram-gib", vram_gib, *extra)


class Spec(NamedTuple):
    """A planned docker server and one start of it: `DockerServer(*spec)`."""

    plan: ServerPlan
    attempt: Attempt

    @property
    def name(self) -> str:
        return self.attempt.name

    @property
    def labels(self) -> dict[str, str]:
        return {**self.plan.labels, **self.attempt.labels}


def make_spec(tmp_path: Path, argv: tuple[str, ...], *, image: str = IMAGE, run_id: str | None = None,
              docker_host: str | None = None, env: dict[str, str] | None = None, gpu: str | None = None,
              mounts: tuple[Mount, ...] = (), publish_host: str = "127.0.0.1") -> Spec:
    run_id = run_id or new_run_id()
    profile = ServerProfile(name="t", command=argv, image=image, port=8000, mounts=mounts)
    plan = ServerPlan(backend="docker", profile=profile, argv=argv, env=env or {}, labels=labels(run_id), gpu=gpu,
                      options=DockerOptions(docker_host=docker_host, publish_host=publish_host))
    return Spec(plan, Attempt(name=f"runner-{run_id}-c-t-0", log_path=tmp_path / "server.log"))


def dead_owner_labels() -> dict[str, str]:
    """Owner labels of a runner that has exited (a real process that started and ended on this host)."""
    import socket
    import subprocess

    from runner.backends import owner

    proc = subprocess.Popen(["sleep", "0.1"])
    started = owner.started(proc.pid)
    proc.wait()
    return owner.Owner(socket.gethostname(), owner.boot_id(), proc.pid, started).labels()
