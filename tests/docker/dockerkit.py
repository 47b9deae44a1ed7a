"""Helpers shared by the docker tests (imported by name: tests/docker is on sys.path via its conftest)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import docker

from runner.backends.base import ServerSpec

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "docker" / "refserver" / "build.sh"
IMAGE = os.environ.get("RUNNER_REFSERVER_IMAGE", "runner-refserver:dev")
BASE_IMAGE = "runner-base:bookworm"
RUN_PREFIX = "pytest-docker-"
BUILD_TIMEOUT_S = 900


def new_run_id() -> str:
    return RUN_PREFIX + uuid.uuid4().hex[:10]


def labels(run_id: str, flags: str = "t", attempt: int = 0) -> dict[str, str]:
    return {"runner.managed": "true", "runner.run": run_id, "runner.card": "c", "runner.flags": flags,
            "runner.attempt": str(attempt)}


def leftovers(client: docker.DockerClient) -> list[str]:
    """Managed containers of these tests still on the engine (running or not)."""
    found = client.containers.list(all=True, filters={"label": "runner.managed=true"})
    return [c.name for c in found if c.labels.get("runner.run", "").startswith(RUN_PREFIX)]


def refserver_argv(*extra: str, vram_gib: str = "1") -> tuple[str, ...]:
    return ("python", "-m", "runner.refserver", "--host", "0.0.0.0", "--port", "8000", "--preset", "tiny",
            "--vram-gib", vram_gib, *extra)


def make_spec(tmp_path: Path, argv: tuple[str, ...], *, image: str = IMAGE, run_id: str | None = None,
              docker_host: str | None = None, **kw: object) -> ServerSpec:
    run_id = run_id or new_run_id()
    return ServerSpec(name=f"runner-{run_id}-c-t-0", argv=argv, env=kw.pop("env", {}), host="127.0.0.1",  # type: ignore[arg-type]
                      port=0, health_path="/health", log_path=tmp_path / "server.log", image=image,
                      container_port=8000, docker_host=docker_host, labels=labels(run_id), **kw)  # type: ignore[arg-type]


def dead_owner_labels() -> dict[str, str]:
    """Owner labels of a runner that has exited (a real process that started and ended on this host)."""
    import socket
    import subprocess

    import psutil

    from runner.backends import owner

    proc = subprocess.Popen(["sleep", "0.1"])
    started = psutil.Process(proc.pid).create_time()
    proc.wait()
    return owner.Owner(socket.gethostname(), proc.pid, started).labels()
