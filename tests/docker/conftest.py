"""Fixtures for the Docker backend tests: a real engine, the refserver image (built once, then reused), and
a check that no container of these tests is left behind.

Tests marked `docker` skip when no engine answers. Every container they create carries run ids starting
with RUN_PREFIX, so the leftover checks never look at another process's containers on a shared engine.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import docker
import pytest
from docker.errors import DockerException, ImageNotFound
from dockerkit import BASE_IMAGE, BUILD, BUILD_TIMEOUT_S, IMAGE, leftovers


@pytest.fixture(scope="session")
def docker_client() -> Iterator[docker.DockerClient]:
    try:
        client = docker.from_env(timeout=30)
        client.ping()
    except (DockerException, OSError) as exc:
        pytest.skip(f"no Docker Engine answers ({type(exc).__name__}: {exc}); start dockerd "
                    f"(scripts/services.sh) to run the docker tests")
    yield client
    # Session-level finalizer: the whole session left nothing behind.
    left = leftovers(client)
    client.close()
    assert not left, f"containers left behind by the docker tests: {left}"


@pytest.fixture(scope="session")
def refserver_image(docker_client: docker.DockerClient) -> str:
    """docker/refserver/build.sh: the base and the image are built once and reused while up to date."""
    t0 = time.monotonic()
    proc = subprocess.run([str(BUILD)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                          env={**os.environ, "IMAGE": IMAGE})
    if proc.returncode != 0:
        pytest.fail(f"{BUILD} failed ({proc.returncode}) after {time.monotonic() - t0:.0f} s:\n"
                    f"{proc.stderr[-3000:]}")
    # The build leaves no untagged stage image behind (the legacy builder keeps every stage as one: 1.4 GB).
    stages = docker_client.images.list(filters={"dangling": True, "label": "runner.build-stage=refserver-venv"})
    assert not stages, f"{BUILD} left untagged build-stage images: {[i.short_id for i in stages]}"
    return IMAGE


@pytest.fixture(scope="session")
def base_image(docker_client: docker.DockerClient, request: pytest.FixtureRequest) -> str:
    """The plain base: reused when present (tests that need only it skip the refserver build)."""
    try:
        docker_client.images.get(BASE_IMAGE)
    except ImageNotFound:
        request.getfixturevalue("refserver_image")  # build.sh makes it on the way to the refserver image
    return BASE_IMAGE


@pytest.fixture(autouse=True)
def _no_container_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every docker test: none of its managed containers remain."""
    if request.node.get_closest_marker("docker") is None:
        yield
        return
    client = request.getfixturevalue("docker_client")
    before = set(leftovers(client))
    yield
    left = sorted(set(leftovers(client)) - before)
    assert not left, f"{request.node.name} left containers behind: {left}"
