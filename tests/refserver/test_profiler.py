"""The reference server speaks vLLM-Omni's profiler interface (--profiler-config, POST /start_profile,
/stop_profile, DIR/<timestamp>_<name>/memory_snapshot_rank0.pickle); on CPU its snapshot comes from the
accounted ledger in PyTorch's format, and the runner's reader (runner.observe.snapshot) reads it."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from refserver_helpers import Server, chat_body, make_ref

from runner.judge.findings.held import largest_request_site
from runner.observe import snapshot as S

MIB = 2**20


def config(folder: Path) -> str:
    return json.dumps({"profiler": "torch", "torch_profiler_dir": str(folder), "torch_profiler_with_memory": True})


def test_a_request_oom_is_snapshotted_at_the_oom_with_the_cache_named(tmp_path: Path) -> None:
    # examples/local.toml's cpu-tight: 7.75 MiB serves 2 references with the cache on the device and runs out at
    # 3, with the cache's first layers built (at 6.5 MiB it runs out embedding the references, before any cache)
    server = Server("profiled", ["--vram-gib", str(7.75 / 1024), "--profiler-config", config(tmp_path)], tmp_path)
    try:
        server.ready(timeout=600)
        assert httpx.post(server.url + "/start_profile", timeout=30).json() == {"status": "started"}
        refs = [make_ref(i) for i in range(3)]
        assert server.chat(chat_body(refs=refs)).status_code == 500  # the OOM
        stopped = httpx.post(server.url + "/stop_profile", timeout=30).json()
    finally:
        server.stop()
    path = Path(stopped["memory_snapshot"])
    assert path.name == "memory_snapshot_rank0.pickle" and path.parent.parent == tmp_path
    assert path.parent.name.endswith("_oom")  # taken by the observer at the OOM itself
    held = S.read_bytes(path.read_bytes())
    assert held.at == "oom" and held.exact == "segments at the oom"
    assert held.resident_bytes is not None and held.request_bytes is not None
    assert held.resident_bytes >= 4 * MIB  # the weights, allocated before /start_profile
    weights = [s for s in held.by_site if s.phase == "resident"]
    assert weights and all(s.site.startswith("runner/refserver/engine.py:") for s in weights)
    request = [s for s in held.by_site if s.phase == "request"]
    assert request and all(s.site.startswith("runner/refserver/") for s in request)
    assert sum(s.bytes for s in request) == held.request_bytes > 0
    cache = [n for n in held.named if n.name == "conditioning cache"]
    assert cache and cache[0].phase == "request" and cache[0].bytes > 0
    assert held.tried_bytes and held.tried_bytes > 0
    assert held.inactive_bytes == 0  # the ledger does not fragment


def test_a_load_oom_leaves_a_snapshot_before_the_process_exits(tmp_path: Path) -> None:
    server = Server("load-oom", ["--vram-gib", "0.003", "--profiler-config", config(tmp_path)], tmp_path)
    assert server.wait_exit(600) == 1
    found = sorted(tmp_path.glob("*_oom/memory_snapshot_rank0.pickle"))
    assert len(found) == 1
    held = S.read_bytes(found[0].read_bytes(), request_began_us=2**62)
    assert held.at == "oom" and held.request_bytes == 0 and held.resident_bytes == held.active_bytes > 0
    assert all(s.site.startswith("runner/refserver/engine.py:") for s in held.by_site)


def test_without_the_config_there_are_no_endpoints_and_a_bad_config_is_a_usage_error(tmp_path: Path) -> None:
    bad = Server("bad-config", ["--profiler-config", "{\"profiler\": \"nsys\"}"], tmp_path)
    assert bad.wait_exit(600) == 2
    assert "--profiler-config needs" in bad.log()


def test_weights_onloaded_for_the_request_are_named_and_never_its_largest_activation(tmp_path: Path) -> None:
    # --cpu-offload keeps the transformer on the host and copies it in per request: the copies are request-time
    # blocks, but chunking cannot shrink them, so the reader must not offer them as the largest activation
    server = Server("offloaded", ["--arch", "qwen-image", "--preset", "tiny", "--cpu-offload",
                                  "--vram-gib", str(16 / 1024), "--profiler-config", config(tmp_path)], tmp_path)
    try:
        server.ready(timeout=600)
        httpx.post(server.url + "/start_profile", timeout=30).raise_for_status()
        assert server.chat(chat_body(refs=[make_ref(0)])).status_code == 200
        stopped = httpx.post(server.url + "/stop_profile", timeout=30).json()
    finally:
        server.stop()
    # 0: the history was cleared at /start_profile, so every traced block is the request's (as the runner reads it)
    held = S.read_bytes(Path(stopped["memory_snapshot"]).read_bytes(), request_began_us=0)
    onloaded = [s for s in held.by_site if s.part == "onloaded weights"]
    assert onloaded and {s.phase for s in onloaded} == {"request"}
    assert all(s.site.startswith("runner/refserver/qwen_image/engine.py:") for s in onloaded)
    named = {n.name: n for n in held.named}
    assert named["onloaded weights"].bytes == sum(s.bytes for s in onloaded) > 0
    largest = largest_request_site(held)
    assert largest is not None and largest.part is None
    assert largest.bytes <= max(s.bytes for s in onloaded)  # the weights outweigh it: the name sets them apart
    assert "onload" not in (largest.function or "")
