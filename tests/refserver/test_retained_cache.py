"""What a request leaves on the device (issue 45 part 5): `--cond-cache retain` keeps each distinct reference's
K/V across requests and a repeat is faster; `--fault leak=SIZE` leaves SIZE per request; the default frees what
a request made. Read as the runner reads them: the server's own figure after each response, /metrics
`refserver_device_memory_bytes` (the accounted memory now, between requests)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import httpx
import pytest
from refserver_helpers import Server, chat_body, chat_pngs, make_ref, peak_mb

from runner.refserver.config import PRESETS, QWEN_PRESETS
from runner.refserver.faults import FaultPlan
from tests.conftest import needs_diffusers

if TYPE_CHECKING:
    from runner.refserver.engine import AnyEngine

QWEN = ["--arch", "qwen-image", "--preset", "tiny"]
LEAK = 100 * 1024
SERVERS = {
    "qwen-default": QWEN,
    "qwen-retain": [*QWEN, "--cond-cache", "retain"],
    "qwen-leak": [*QWEN, "--fault", f"leak={LEAK // 1024}KiB"],
    "dit-default": [],
    "dit-retain": ["--cond-cache", "retain"],
}
FLOAT32 = 4
# What retain keeps per reference: K and V, every layer, the reference's tokens, the model's width (float32)
R = {"qwen": 2 * QWEN_PRESETS["tiny"].layers * QWEN_PRESETS["tiny"].ref_tokens * QWEN_PRESETS["tiny"].dim * FLOAT32,
     "dit": 2 * PRESETS["tiny"].layers * PRESETS["tiny"].ref_tokens * PRESETS["tiny"].dim * FLOAT32}
REFS = [make_ref(i) for i in range(12)]
# The runner's order: 1, 2, 3, 4 references of one fixture, each sent twice (two seeds)
SEQUENCE = [1, 1, 2, 2, 3, 4, 4]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    logs = tmp_path_factory.mktemp("retention-logs")
    started = {name: Server(name, args, logs) for name, args in SERVERS.items()}
    yield started
    for s in started.values():
        s.stop()


def floor(server: Server) -> int:
    """The server's accounted device memory now (its /metrics gauge), read after a response: what is left."""
    return int(server.metrics()["refserver_device_memory_bytes"])


def floors(server: Server, counts: list[int]) -> tuple[int, list[int]]:
    """The floor at load, then after each request of the first `count` references (a fresh server)."""
    at_load = floor(server.ready())
    after = []
    for seed, count in enumerate(counts):
        chat_pngs(server.chat(chat_body(refs=REFS[:count], seed=seed)))
        after.append(floor(server))
    return at_load, after


Floors = Callable[[str], tuple[int, list[int]]]


@pytest.fixture(scope="module")
def default_floors(servers: dict[str, Server]) -> Floors:
    """The default's floors over SEQUENCE, read once per arch on its fresh server (what a later request leaves
    depends on the shapes earlier ones left behind)."""
    return functools.cache(lambda arch: floors(servers[f"{arch}-default"], SEQUENCE))


@pytest.mark.parametrize("arch", [pytest.param("qwen", marks=needs_diffusers), "dit"])
def test_retain_keeps_r_per_distinct_reference_and_nothing_on_a_repeat(
        servers: dict[str, Server], default_floors: Floors, arch: str) -> None:
    """Against the default's floors over the same requests (which hold what the model itself keeps of a new
    shape): retain's differ by exactly R per distinct reference seen."""
    base_load, base = default_floors(arch)
    kept_load, kept = floors(servers[f"{arch}-retain"], SEQUENCE)
    assert kept_load == base_load
    distinct = [max(SEQUENCE[: i + 1]) for i in range(len(SEQUENCE))]
    assert [k - b for k, b in zip(kept, base, strict=True)] == [R[arch] * d for d in distinct]
    metrics = servers[f"{arch}-retain"].metrics()
    assert metrics["refserver_cond_cache_retained_bytes"] == 4 * R[arch]
    assert metrics["refserver_cond_cache_retained_entries"] == 4
    assert f"cond_cache_bytes_per_reference={R[arch]}" in servers[f"{arch}-retain"].log()


@pytest.mark.parametrize("arch", [pytest.param("qwen", marks=needs_diffusers), "dit"])
def test_the_default_frees_what_a_request_made(default_floors: Floors, arch: str) -> None:
    """A repeat leaves exactly nothing. A new shape leaves only what the model keeps of it: diffusers' RoPE
    tables (an lru_cache: 16 KiB for the first shape, 8 KiB per new reference count on tiny), nothing on our DiT."""
    at_load, after = default_floors(arch)
    for i in range(1, len(SEQUENCE)):
        if SEQUENCE[i] == SEQUENCE[i - 1]:
            assert after[i] == after[i - 1], (SEQUENCE, after)
    assert after[-1] - at_load <= (64 * 1024 if arch == "qwen" else 0), (at_load, after)


def engine(arch: str, *flags: str) -> AnyEngine:
    from runner.refserver.cli import build_parser, config_from_args
    from runner.refserver.engine import Engine, configure_torch

    config = config_from_args(build_parser().parse_args([*(QWEN if arch == "qwen" else []), *flags]))
    configure_torch(config)
    if arch == "qwen":
        from runner.refserver.qwen_image.engine import QwenEngine

        return QwenEngine(config)
    return Engine(config)


@pytest.mark.parametrize("arch", [pytest.param("qwen", marks=needs_diffusers), "dit"])
def test_a_request_whose_references_are_kept_runs_faster_and_answers_the_same(arch: str) -> None:
    """Four references, two steps, no CFG: a miss makes four references' K/V, a hit none. Timed as the CPU time
    of the thread that runs the request (torch on one thread): on this shared machine wall time is mostly other
    work."""
    from runner.refserver.engine import GenerationRequest

    e = engine(arch, "--cond-cache", "retain")
    cold, cached = [], []
    for first in (0, 4, 8):  # references never sent before
        req = GenerationRequest(prompt="the shapes together", references=tuple(REFS[first : first + 4]), width=128,
                                height=128, steps=2, seed=1, true_cfg_scale=1.0)
        t0 = time.thread_time()
        miss = e.generate(req)
        t1 = time.thread_time()
        hit = e.generate(req)
        cold.append(t1 - t0)
        cached.append(time.thread_time() - t1)
        assert hit.images[0].tobytes() == miss.images[0].tobytes()  # the kept K/V are the ones a miss makes
    assert e.retained.hits == 12 and e.retained.misses == 12
    assert sorted(cached)[1] < 0.8 * sorted(cold)[1], (cold, cached)


@needs_diffusers
def test_leak_leaves_l_per_request(servers: dict[str, Server],
                                   default_floors: Floors) -> None:
    base_load, base = default_floors("qwen")
    leak_load, leaked = floors(servers["qwen-leak"], SEQUENCE)
    assert leak_load == base_load
    assert [k - b for k, b in zip(leaked, base, strict=True)] == [LEAK * (i + 1) for i in range(len(SEQUENCE))]
    assert servers["qwen-leak"].metrics()["refserver_leaked_bytes"] == LEAK * len(SEQUENCE)


def test_a_leak_fails_the_request_it_no_longer_fits_as_out_of_memory(servers: dict[str, Server],
                                                                   launch: Callable[..., Server]) -> None:
    """Our DiT with 1 MiB left per request, on a card of its floor at load + 2.5 MiB + what a request needs
    above its floor (X, from the default's peak): request n fits while load + n MiB + X fits, so 1 and 2 are
    served and 3 and 4 fail as out of memory, the server serving on."""
    d = servers["dit-default"].ready()
    load = floor(d)
    extra = round(peak_mb(d.chat(chat_body(refs=REFS[:1]))) * 2**20) - load
    card = load + 2.5 * 2**20 + extra
    s = launch("dit-leak-oom", "--vram-gib", repr(card / 2**30), "--fault", "leak=1MiB").ready()
    replies = [s.chat(chat_body(refs=REFS[:1])) for _ in range(4)]
    assert [r.status_code for r in replies] == [200, 200, 500, 500], [r.text[:200] for r in replies]
    assert "out of memory" in replies[2].json()["error"]["message"]
    assert httpx.get(s.url + "/health", timeout=5).status_code == 200


@pytest.mark.parametrize(("spec", "nbytes", "request_n"), [
    ("leak=64MiB", 64 * 2**20, None), ("leak=1.5GiB@3", 3 * 2**29, 3), ("leak=4096", 4096, None),
])
def test_leak_sizes(spec: str, nbytes: int, request_n: int | None) -> None:
    plan = FaultPlan.parse([spec])
    assert plan.leak_bytes(request_n or 7) == nbytes
    assert plan.leak_bytes(2) == (0 if request_n else nbytes)


@pytest.mark.parametrize("spec", ["leak", "leak=0", "leak=-1MiB", "leak=2PiB", "leak=nan", "leak=1e3", "leak=5XB"])
def test_a_leak_size_that_is_none_is_one_line(spec: str) -> None:
    with pytest.raises(ValueError, match="leak needs a size"):
        FaultPlan.parse([spec])


@pytest.mark.parametrize("arch", [pytest.param("qwen", marks=needs_diffusers), "dit"])
def test_hits_count_each_reference_once_per_request_with_true_cfg(arch: str) -> None:
    """With true CFG (the runner's requests: a negative prompt) the condition is made twice per request, once
    per pass: a cold request is still all misses and a repeat all hits, one per reference."""
    from runner.refserver.engine import GenerationRequest

    e = engine(arch, "--cond-cache", "retain")
    req = GenerationRequest(prompt="the shapes together", references=tuple(REFS[:2]), width=64, height=64,
                            steps=1, seed=1, true_cfg_scale=4.0, negative_prompt=" ")
    e.generate(req)
    assert (e.retained.hits, e.retained.misses) == (0, 2)
    e.generate(req)
    assert (e.retained.hits, e.retained.misses) == (2, 2)
