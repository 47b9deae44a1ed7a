"""DockerServer against a real engine: a full session, failures at load, mounts, reaping — and the pure
helpers that decide addresses, mounts and GPUs."""

from __future__ import annotations

import contextlib
import io
import time

import docker
import httpx
import psutil
import pytest
from dockerkit import dead_owner_labels, labels, make_spec, new_run_id, refserver_argv
from PIL import Image

from runner.backends import create
from runner.backends.base import StartFailed
from runner.backends.docker import (
    DockerServer,
    bind_mounts,
    gpu_request,
    reachable_host,
    reap,
    working_set,
)
from runner.core.records import FailureClass
from runner.plan.matrix import Mount
from runner.run import dialects


def png(seed: int, size: int = 48) -> bytes:
    img = Image.new("RGB", (size, size), (seed * 40 % 256, 90, 200 - seed * 30))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def wait_for(predicate, timeout: float = 20.0, step: float = 0.1) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(step)
    return False


def gone(client: docker.DockerClient, name: str) -> bool:
    return not client.containers.list(all=True, filters={"name": f"^/{name}$"}, ignore_removed=True)


# --- against the engine ---------------------------------------------------------------------------------


@pytest.mark.docker
def test_session_start_request_stop(docker_client, refserver_image, tmp_path):
    spec = make_spec(tmp_path, refserver_argv())
    server = create(*spec)
    assert isinstance(server, DockerServer)
    try:
        server.start()
        assert server.base_url.startswith("http://127.0.0.1:") and server.host_port not in (None, 8000, 0)
        ready_s = server.wait_ready(90)
        assert ready_s < 90

        info = server.info()
        image = docker_client.images.get(refserver_image)
        assert info["image_id"] == image.id and info["repo_digests"] == list(image.attrs["RepoDigests"])
        assert info["engine_version"] == docker_client.version()["Version"]
        container = docker_client.containers.get(info["container_id"])
        assert container.name == spec.name and dict(spec.labels).items() <= container.labels.items()
        assert info["host_memory_source"] == "cgroup"
        assert any(p.name() == "python" or "python" in " ".join(p.cmdline())
                   for p in psutil.Process(info["pid"]).children(recursive=True))  # NVML attribution

        call = dialects.build("vllm-omni-chat", dialects.ImageRequest(
            model="refserver", prompt="two shapes", references=(("image/png", png(1)), ("image/png", png(2))),
            seed=7, steps=2, size=(64, 48)))
        response = httpx.post(server.base_url + call.path, json=call.body, timeout=60)
        assert response.status_code == 200, response.text[:500]
        parsed = dialects.parse("vllm-omni-chat", response.content)
        assert parsed.image is not None, parsed.problem
        assert Image.open(io.BytesIO(parsed.image)).size == (64, 48)

        rss = server.host_memory_bytes()
        assert rss is not None and 20 * 2**20 < rss < 4 * 2**30  # python + torch, in a working-set range
        assert server.exited() is None
        # The container's own log reached the session log file (streamed, not fetched at the end).
        assert wait_for(lambda: "request 1" in server.read_log())
    finally:
        server.stop()
    assert gone(docker_client, spec.name)
    server.stop()  # idempotent
    assert server.exited() is not None and server.host_memory_bytes() is None
    assert server.info()["container_id"]  # still answers after stop, for the session record


@pytest.mark.docker
def test_oom_at_load_is_classified_from_exit_and_log(docker_client, refserver_image, tmp_path):
    # 1 MiB of "VRAM" cannot hold the tiny preset's ~6 MiB of weights: the server exits unbound.
    spec = make_spec(tmp_path, refserver_argv(vram_gib="0.001"))
    server = DockerServer(*spec)
    server.start()
    with pytest.raises(StartFailed) as caught:
        server.wait_ready(90)
    failure = caught.value.failure
    assert failure.kind == FailureClass.OOM_AT_LOAD
    assert failure.exit_code == 1
    assert any("CUDA out of memory. Tried to allocate" in line for line in failure.evidence)
    assert server.info()["exit_code"] == 1 and server.info()["oom_killed"] is False
    assert gone(docker_client, spec.name)  # wait_ready stopped (and removed) it


@pytest.mark.docker
def test_exit_at_load_without_oom_is_load_exit(docker_client, refserver_image, tmp_path):
    server = DockerServer(*make_spec(tmp_path, refserver_argv("--fault", "load-fail")))
    server.start()
    with pytest.raises(StartFailed) as caught:
        server.wait_ready(60)
    assert caught.value.failure.kind == FailureClass.LOAD_EXIT
    assert caught.value.failure.exit_code == 3
    assert "load failed on purpose" in "\n".join(caught.value.failure.evidence)


@pytest.mark.docker
def test_read_only_mount_env_and_tilde(docker_client, base_image, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # `~` expands on the runner's side for a local engine
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "hello.txt").write_text("weights-are-here\n")
    script = "cat /w/hello.txt; echo \"greeting=$GREETING\"; touch /w/new 2>&1 || true; echo done"
    spec = make_spec(tmp_path / "session", ("sh", "-c", script), image=base_image, env={"GREETING": "hi"},
                     mounts=(Mount(source="~/weights", target="/w"),))
    server = DockerServer(*spec)
    try:
        server.start()
        assert wait_for(lambda: server.exited() is not None)
        log = server.read_log()
    finally:
        server.stop()
    assert server.exited().code == 0
    assert "weights-are-here" in log and "greeting=hi" in log and "done" in log
    assert "Read-only file system" in log
    assert not (tmp_path / "weights" / "new").exists()


@pytest.mark.docker
def test_missing_image_fails_before_creating_anything(docker_client, tmp_path):
    spec = make_spec(tmp_path, ("true",), image="runner-no-such-image:none")
    server = DockerServer(*spec)
    with pytest.raises(ValueError, match="runner-no-such-image:none is not on the engine"):
        server.start()
    server.stop()
    assert gone(docker_client, spec.name)


@pytest.mark.docker
def test_stale_container_of_same_name_is_replaced_foreign_one_is_not(docker_client, base_image, tmp_path):
    run_id = new_run_id()
    spec = make_spec(tmp_path, ("sleep", "30"), image=base_image, run_id=run_id)
    stale = docker_client.containers.run(base_image, "sleep 30", name=spec.name, labels=labels(run_id),
                                         detach=True)
    server = DockerServer(*spec)
    try:
        server.start()
        assert server.container is not None and server.container.id != stale.id
    finally:
        server.stop()
    foreign = docker_client.containers.run(base_image, "sleep 30", name=spec.name, detach=True)
    try:
        with pytest.raises(ValueError, match="not managed by runner"):
            DockerServer(*spec).start()
        foreign.reload()
        assert foreign.status == "running"
    finally:
        foreign.remove(force=True)


@pytest.mark.docker
def test_reap_removes_only_managed_containers(docker_client, base_image):
    old_run, current_run = new_run_id(), new_run_id()
    dead = {**labels(old_run), **dead_owner_labels()}
    old = docker_client.containers.run(base_image, "sleep 60", labels=dead, detach=True)
    old_exited = docker_client.containers.run(base_image, "true", labels=dead, detach=True)
    current = docker_client.containers.run(base_image, "sleep 60", labels=labels(current_run), detach=True)
    unmanaged = docker_client.containers.run(base_image, "sleep 60", labels={"runner.run": old_run},
                                             detach=True)
    no_owner = docker_client.containers.run(base_image, "sleep 60", labels=labels(old_run), detach=True)
    try:
        notes = {name: (removed, why) for name, removed, why in reap(None, keep_run=current_run)}
        assert notes[old.name][0] and notes[old_exited.name][0] and "is gone" in notes[old.name][1]
        assert notes[no_owner.name] == (False, notes[no_owner.name][1]) and "no owner labels" in notes[no_owner.name][1]
        assert current.name not in notes and unmanaged.name not in notes
        assert gone(docker_client, old.name) and gone(docker_client, old_exited.name)
        for c in (current, unmanaged, no_owner):
            c.reload()
            assert c.status == "running"
    finally:
        for c in (current, unmanaged, no_owner):
            c.remove(force=True)


@pytest.mark.docker
def test_reap_survives_a_container_removed_while_it_lists(docker_client, base_image, monkeypatch):
    """Another runner on the same engine removes a container between reap's list and its inspect of it (the
    race seen when tests ran in parallel): reap goes on with the rest instead of raising NotFound."""
    dead = {**labels(new_run_id()), **dead_owner_labels()}
    vanishing = docker_client.containers.run(base_image, "sleep 60", labels=dead, detach=True)
    staying = docker_client.containers.run(base_image, "sleep 60", labels=dead, detach=True)
    inspect = docker.api.client.APIClient.inspect_container

    def removed_first(api, container_id):  # the other runner wins the race for this one container
        if container_id == vanishing.id:
            api.remove_container(container_id, force=True)
        return inspect(api, container_id)

    monkeypatch.setattr(docker.api.client.APIClient, "inspect_container", removed_first)
    try:
        notes = {name: removed for name, removed, _ in reap(None)}
        assert notes.get(staying.name) is True and vanishing.name not in notes
        assert gone(docker_client, vanishing.name) and gone(docker_client, staying.name)
    finally:
        monkeypatch.undo()
        for c in (vanishing, staying):
            with contextlib.suppress(docker.errors.NotFound):
                c.remove(force=True)


@pytest.mark.docker
def test_stats_api_fallback_reads_memory(docker_client, base_image, tmp_path):
    """Remote engines have no cgroup files here: the one-shot stats endpoint must give a figure."""
    server = DockerServer(*make_spec(tmp_path, ("sleep", "30"), image=base_image))
    try:
        server.start()
        server._cgroup = None
        value = server.host_memory_bytes()
        assert value is not None and 0 < value < 2**30
    finally:
        server.stop()


# --- pure helpers (no engine) ----------------------------------------------------------------------------


def test_reachable_host_follows_the_engine():
    assert reachable_host(None, "127.0.0.1") == "127.0.0.1"
    assert reachable_host("unix:///var/run/docker.sock", "0.0.0.0") == "127.0.0.1"
    assert reachable_host("ssh://root@127.0.0.1:2222", "127.0.0.1") == "127.0.0.1"
    assert reachable_host("ssh://me@gpu-box.example:22", "0.0.0.0") == "gpu-box.example"
    assert reachable_host("tcp://gpu-box.example:2375", "0.0.0.0") == "gpu-box.example"
    assert reachable_host("ssh://me@gpu-box.example", "10.9.8.7") == "10.9.8.7"  # bound to one address
    with pytest.raises(ValueError, match="unreachable from the runner"):
        reachable_host("ssh://me@gpu-box.example", "127.0.0.1")


def test_bind_mounts_expand_tilde_only_for_local_engines(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    spec = make_spec(tmp_path, ("true",), mounts=(Mount(source="~/w", target="/w"),
                                                  Mount(source="/data/x", target="/x", read_only=False)))
    local = bind_mounts(spec.plan.profile.mounts, spec.plan.options.docker_host)
    assert local[0]["Source"] == str(tmp_path / "w") and local[0]["ReadOnly"] is True
    assert local[1]["Source"] == "/data/x" and local[1]["ReadOnly"] is False
    remote = make_spec(tmp_path, ("true",), docker_host="ssh://me@gpu-box.example", publish_host="0.0.0.0",
                       mounts=(Mount(source="/home/me/w", target="/w"),))
    assert bind_mounts(remote.plan.profile.mounts, remote.plan.options.docker_host)[0]["Source"] == "/home/me/w"
    tilde = make_spec(tmp_path, ("true",), docker_host="ssh://me@gpu-box.example", publish_host="0.0.0.0",
                      mounts=(Mount(source="~/w", target="/w"),))
    with pytest.raises(ValueError, match="absolute path on the remote host"):
        bind_mounts(tilde.plan.profile.mounts, tilde.plan.options.docker_host)


def test_gpu_request_by_index_or_uuid():
    assert gpu_request(None) == [] and gpu_request("") == []
    (by_index,) = gpu_request("0")
    assert by_index["DeviceIDs"] == ["0"] and by_index["Capabilities"] == [["gpu"]]
    (by_uuid,) = gpu_request("GPU-5b1c3f0e-1111-2222-3333-444455556666")
    assert by_uuid["DeviceIDs"] == ["GPU-5b1c3f0e-1111-2222-3333-444455556666"]


def test_working_set_subtracts_inactive_file_cache():
    v1 = {"memory_stats": {"usage": 1000, "stats": {"total_inactive_file": 300, "inactive_file": 5}}}
    v2 = {"memory_stats": {"usage": 1000, "stats": {"inactive_file": 100}}}
    assert working_set(v1) == 700 and working_set(v2) == 900
    assert working_set({"memory_stats": {}}) is None


@pytest.mark.docker
def test_gpu_request_refused_by_the_engine_leaves_nothing(docker_client, base_image, tmp_path):
    """No NVIDIA runtime here: the engine refuses to start the container; stop() still removes it."""
    if "nvidia" in (docker_client.info().get("Runtimes") or {}):
        pytest.skip("this engine has the NVIDIA runtime")
    spec = make_spec(tmp_path, ("true",), image=base_image, gpu="0")
    server = DockerServer(*spec)
    with pytest.raises(docker.errors.APIError, match=r"(?i)device driver|gpu"):
        server.start()
    assert server.container is not None  # created, never started
    server.stop()
    assert gone(docker_client, spec.name) and "stop_error" not in server.info()
