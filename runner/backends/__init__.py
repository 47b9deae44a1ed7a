"""Where a server runs: `local` (a subprocess) or `docker` (a container, local engine or ssh://)."""

from __future__ import annotations

from runner.backends.base import ExitInfo, RunningServer, ServerSpec, StartFailed


def create(backend: str, spec: ServerSpec) -> RunningServer:
    if backend == "local":
        from runner.backends.local import LocalServer

        return LocalServer(spec)
    if backend == "docker":
        from runner.backends.docker import DockerServer

        return DockerServer(spec)
    raise ValueError(f"unknown backend {backend!r}")


__all__ = ["ExitInfo", "RunningServer", "ServerSpec", "StartFailed", "create"]
