"""The allocator-snapshot reader (runner.observe.snapshot) on the three real snapshots of the real Qwen-Image
transformer OOMing on an emulated 24 GiB card of an H200 (fixtures/qwen-image-snapshot/ beside this file, README
there), and on hostile pickles."""

from __future__ import annotations

import gzip
import os
import pickle
from pathlib import Path

import pytest

from runner.observe import snapshot as S

DATA = Path(__file__).with_name("fixtures") / "qwen-image-snapshot"
MIB, GIB = 2**20, 2**30


def _probe_request_began(snap: dict) -> int:
    """Where the probe's 5th (OOM'd) request began on the trace's clock: its script frees the previous
    request's output at top level (an event whose innermost frame is `<module>`) right before it; the real
    probe recorded history from the process's start, so the start must be given (as a server that clears its
    history at /start_profile gives it by construction)."""
    events = S._events(snap)
    oom = max(i for i, e in enumerate(events) if e["action"] == "oom")
    last = max(i for i, e in enumerate(events[:oom]) if e["frames"] and e["frames"][0]["name"] == "<module>")
    return events[last]["time_us"] + 1


_cache: dict[str, tuple[dict, S.Held | None]] = {}


def real(name: str, began: bool = True) -> tuple[dict, S.Held]:
    """One real snapshot, read once per test session (the default one is 140 MB unpickled)."""
    if name not in _cache:
        snap = S.load((DATA / f"snapshot-{name}.pickle.gz").read_bytes())
        _cache[name] = (snap, None)
    snap, held = _cache[name]
    if held is None:
        held = S.read(snap, _probe_request_began(snap) if S._events(snap) else None)
        _cache[name] = (snap, held)
    return snap, held if began else S.read(snap)


def site(held: S.Held, where: str, function: str) -> S.Site:
    return next(s for s in held.by_site if s.site == where and s.function == function)


def test_default_allocator_resident_weights_and_the_request_mlp_activation() -> None:
    _, h = real("default")
    assert h.at == "oom" and h.exact == "segments at the oom"
    assert h.active_bytes == 24_940_293_632  # 23.23 GiB, the OOM message's "allocated by PyTorch"
    assert h.resident_bytes is not None and h.request_bytes is not None
    assert h.resident_bytes + h.request_bytes == h.active_bytes
    assert 21.60 * GIB <= h.resident_bytes <= 21.70 * GIB  # 21.60 GiB of weights + small buffers
    mlp = site(h, "diffusers/models/activations.py:88", "forward")
    assert (mlp.phase, mlp.bytes, mlp.blocks) == ("request", 576 * MIB, 1)
    request = [s for s in h.by_site if s.phase == "request"]
    assert request[0] == mlp  # the largest request-time allocation
    assert sum(s.bytes for s in request) == h.request_bytes
    # the weights by construction site: the MLPs' first projections, the modulation layers
    assert site(h, "diffusers/models/activations.py:78", "__init__").phase == "resident"
    assert site(h, "diffusers/models/transformers/transformer_qwenimage.py:609", "__init__").bytes == 3_851_624_448
    assert h.tried_bytes == 576 * MIB  # the GELU one line later
    assert round(h.inactive_bytes / MIB, 2) == 317.08  # "317.08 MiB is reserved by PyTorch but unallocated"
    assert h.segments == 496 and h.expandable_segments is False


def test_expandable_segments_inactive_bytes() -> None:
    _, h = real("expandable")
    assert round(h.inactive_bytes / MIB, 1) == 99.6
    assert h.segments == 6 and h.expandable_segments is True
    mlp = site(h, "diffusers/models/activations.py:88", "forward")  # 6 refs: 28,672 tokens x 12,288 x 2 B
    assert (mlp.phase, mlp.bytes) == ("request", 672 * MIB)
    assert h.tried_bytes == 672 * MIB


def test_without_a_known_request_start_the_split_is_unknown_not_guessed() -> None:
    _, h = real("default", began=False)
    assert h.resident_bytes is None and h.request_bytes is None
    assert {s.phase for s in h.by_site} == {"unknown"}
    assert any("cannot be told apart" in n for n in h.notes)
    assert h.active_bytes == 24_940_293_632


def test_no_history_snapshot_has_no_sites() -> None:
    _, h = real("no-history")
    assert not h.frames
    assert [s.site for s in h.by_site] == [S.NO_FRAMES]
    assert h.by_site[0].bytes == h.active_bytes == 24_940_293_632
    assert h.resident_bytes is None
    assert round(h.inactive_bytes / MIB, 2) == 317.08
    assert any(n.startswith("no frames recorded") for n in h.notes)


class _Runs:
    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.path}",))

    def __init__(self, path: Path) -> None:
        self.path = path


def test_a_pickle_naming_a_global_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    evil = pickle.dumps({"segments": [], "x": _Runs(marker)})
    assert b"system" in evil
    for data in (evil, gzip.compress(evil)):
        with pytest.raises(S.SnapshotError, match=r"refused: the pickle names a global \((posix|os)\.system\)"):
            S.load(data)
    assert not marker.exists()
    # the same pickle through the ordinary unpickler does run it: the test would see it
    pickle.loads(evil)
    assert marker.exists()


@pytest.mark.parametrize(("data", "why"), [
    (b"", "not a pickle"),
    (b"\x80\x05garbage", "not a pickle"),
    (pickle.dumps([1, 2]), "no 'segments' list"),
    (b"\x1f\x8b\x08rest", "broken gzip"),
    (pickle.dumps({"segments": []}) * 0 + b"x" * 100, "too large"),
])
def test_broken_or_oversized_input_is_one_line(data: bytes, why: str) -> None:
    with pytest.raises(S.SnapshotError, match=why) as exc:
        S.load(data, max_bytes=50)
    assert "\n" not in str(exc.value)


def test_decompression_is_bounded() -> None:
    bomb = gzip.compress(b"\0" * (4 * MIB))
    with pytest.raises(S.SnapshotError, match="once decompressed"):
        S.load(bomb, max_bytes=MIB)


def _block(addr: int, size: int, state: str = "active_allocated", frames: list | None = None) -> dict:
    return {"address": addr, "size": size, "requested_size": size, "state": state, "frames": frames or []}


def _frame(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


TORCH = "/venv/lib/python3.12/site-packages/torch/nn/modules/linear.py"
OWN = "/srv/app/engine.py"


def test_a_snapshot_taken_after_the_oom_is_replayed_to_the_oom_event() -> None:
    """vLLM-Omni's profiler dumps at /stop_profile, after the failed request freed its activations: the
    weights (allocated before the history started: no frames, no event) are resident, the request's blocks
    live at the oom event come from the trace."""
    act = [_frame(TORCH, 134, "forward"), _frame(OWN, 88, "forward")]
    blocks = [_block(0, 1000), _block(1000, 2000, "inactive")]
    snap = {"segments": [{"address": 0, "total_size": 3000, "blocks": blocks}],
            "device_traces": [[
                {"action": "alloc", "addr": 1000, "size": 700, "time_us": 5, "frames": act},
                {"action": "alloc", "addr": 1700, "size": 200, "time_us": 6, "frames": act},
                {"action": "free_completed", "addr": 1700, "size": 200, "time_us": 7, "frames": act},
                {"action": "oom", "size": 900, "time_us": 8, "frames": act},
                {"action": "free_completed", "addr": 1000, "size": 700, "time_us": 9, "frames": act},
            ]]}
    h = S.read(snap)
    assert h.exact == "trace replayed to the oom"
    assert (h.active_bytes, h.resident_bytes, h.request_bytes, h.tried_bytes) == (1700, 1000, 700, 900)
    assert h.inactive_bytes is None  # not known at the OOM from a later snapshot
    req = next(s for s in h.by_site if s.phase == "request")
    assert (req.site, req.function, req.bytes) == ("/srv/app/engine.py:88", "forward", 700)
    assert next(s for s in h.by_site if s.phase == "resident").site == S.NO_FRAMES


def test_named_parts_come_from_the_servers_metadata() -> None:
    frames = [_frame(OWN, 113, "build")]
    blocks = [_block(0, 500), _block(500, 400, frames=frames)]
    snap = {"segments": [{"address": 0, "total_size": 900, "blocks": blocks}],
            "device_traces": [[{"action": "alloc", "addr": 500, "size": 400, "time_us": 1, "frames": frames,
                                "user_metadata": "conditioning cache"},
                               {"action": "oom", "size": 300, "time_us": 2, "frames": frames}]]}
    h = S.read(snap)
    assert [(n.name, n.phase, n.bytes) for n in h.named] == [("conditioning cache", "request", 400)]
    assert (h.resident_bytes, h.request_bytes, h.inactive_bytes) == (500, 400, 0)


def test_a_snapshot_of_a_served_request_is_replayed_to_its_peak() -> None:
    """diagnosis = always: /stop_profile comes after the request freed its activations; what held the memory
    is the trace at its high point (the weights, pre-trace, resident; the request's blocks live then)."""
    act, attn = [_frame(TORCH, 134, "forward"), _frame(OWN, 88, "forward")], [_frame(OWN, 60, "attend")]
    blocks = [_block(0, 1000), _block(1000, 2000, "inactive")]
    snap = {"segments": [{"address": 0, "total_size": 3000, "blocks": blocks}],
            "device_traces": [[
                {"action": "alloc", "addr": 1000, "size": 300, "time_us": 5, "frames": attn},
                {"action": "alloc", "addr": 1300, "size": 700, "time_us": 6, "frames": act},
                {"action": "free_completed", "addr": 1300, "size": 700, "time_us": 7, "frames": act},
                {"action": "alloc", "addr": 1300, "size": 100, "time_us": 8, "frames": act},
                {"action": "free_completed", "addr": 1000, "size": 300, "time_us": 9, "frames": attn},
                {"action": "free_completed", "addr": 1300, "size": 100, "time_us": 10, "frames": act},
            ]]}
    h = S.read(snap, request_began_us=0)
    assert (h.at, h.exact) == ("snapshot", "trace replayed to the peak")
    assert (h.active_bytes, h.resident_bytes, h.request_bytes) == (2000, 1000, 1000)
    assert [(s.site, s.bytes) for s in h.by_site if s.phase == "request"] == [("/srv/app/engine.py:88", 700),
                                                                             ("/srv/app/engine.py:60", 300)]


def test_a_kept_pass_reads_what_outlived_the_request_not_its_peak() -> None:
    """The kept pass (issue 45): at its high point a request holds its activations; what it leaves is what is
    live at the snapshot, after it. An H100 run read the peak and named diffusers' GELU output as kept."""
    act, store = [_frame(TORCH, 134, "forward")], [_frame(OWN, 40, "store")]
    blocks = [_block(0, 1000), _block(1000, 300, frames=store), _block(1300, 1700, "inactive")]
    snap = {"segments": [{"address": 0, "total_size": 3000, "blocks": blocks}],
            "device_traces": [[
                {"action": "alloc", "addr": 1000, "size": 300, "time_us": 5, "frames": store},
                {"action": "alloc", "addr": 1300, "size": 1700, "time_us": 6, "frames": act},
                {"action": "free_completed", "addr": 1300, "size": 1700, "time_us": 7, "frames": act},
            ]]}
    peak = S.read(snap, request_began_us=0)
    assert peak.request_bytes == 2000  # the activation was live at the high point
    end = S.read(snap, request_began_us=0, at_end=True)
    assert (end.exact, end.resident_bytes, end.request_bytes) == ("segments", 1000, 300)
    assert [(s.site, s.bytes) for s in end.by_site if s.phase == "request"] == [("/srv/app/engine.py:40", 300)]
    assert not end.history_full


def test_a_full_history_does_not_call_the_blocks_before_it_resident() -> None:
    """A trace of max_entries events has wrapped: a live block whose alloc was overwritten may be the request's
    (the refserver's retained K/V, made at the request's start) as well as the load's: the split is unknown."""
    act = [_frame(OWN, 88, "forward")]
    events = [{"action": "alloc" if i % 2 == 0 else "free_completed", "addr": 5000, "size": 10, "time_us": 10 + i,
               "frames": act} for i in range(S.HISTORY_ENTRIES)]
    snap = {"segments": [{"address": 0, "total_size": 6000, "blocks": [_block(0, 1000), _block(1000, 4000)]}],
            "device_traces": [events]}
    h = S.read(snap, request_began_us=0, at_end=True)
    assert h.history_full and h.resident_bytes is None and h.request_bytes is None
    assert any(n.startswith("the allocator's history is full (100,000 events") for n in h.notes)
    # a load OOM's trace (began after it) is not in doubt: everything before it is the load's
    load = S.read(snap, request_began_us=2**62, at_end=True)
    assert not load.history_full and load.resident_bytes == 5000


def test_a_model_package_outside_site_packages_is_named_from_its_package() -> None:
    """diffusers installed into a folder of its own on PYTHONPATH (the H200 run's /tmp/h200-site): its frames are
    package-relative, as the OOM's site from the traceback is, once the matrix names it in model_packages."""
    act = [_frame(TORCH, 134, "forward"), _frame("/tmp/h200-site/diffusers/models/activations.py", 88, "forward")]
    snap = {"segments": [{"address": 0, "total_size": 700, "blocks": [_block(0, 700, frames=act)]}],
            "device_traces": [[{"action": "alloc", "addr": 0, "size": 700, "time_us": 1, "frames": act},
                               {"action": "oom", "size": 300, "time_us": 2, "frames": act}]]}
    named = S.read(snap, 0, own=("runner", "diffusers"))
    assert [s.site for s in named.by_site] == ["diffusers/models/activations.py:88"]
    assert [s.site for s in S.read(snap, 0).by_site] == ["/tmp/h200-site/diffusers/models/activations.py:88"]


def test_a_snapshot_before_the_request_tells_what_it_kept_however_long_the_trace() -> None:
    """The H200 kept passes (docs/evidence/h200-retention): a 1024² request wrapped the 100,000-event history, so
    the retained K/V, made at the request's start, had lost its alloc. A snapshot taken just before the request
    (nothing sent under the profiler) holds the load's blocks: a block live in both is resident, any other kept
    by the request, at its own frames — the same answer as a trace that had not wrapped."""
    act, kv = [_frame(OWN, 88, "forward")], [_frame(OWN, 137, "cond_stream")]
    events = [{"action": "alloc" if i % 2 == 0 else "free_completed", "addr": 9000, "size": 10, "time_us": 10 + i,
               "frames": act} for i in range(S.HISTORY_ENTRIES)]
    weights, reused = _block(0, 1000), _block(5000, 500)  # reused: freed and made again at another size
    before = {"segments": [{"address": 0, "total_size": 9000, "blocks": [weights, _block(1000, 4000, "inactive"),
                                                                          _block(5000, 700)]}]}
    after = {"segments": [{"address": 0, "total_size": 9000,
                           "blocks": [weights, _block(1000, 4000, frames=kv), reused]}], "device_traces": [events]}
    h = S.read(after, request_began_us=0, at_end=True, before=S.live(before))
    assert not h.history_full and h.exact == "segments against a snapshot before the request"
    assert (h.resident_bytes, h.request_bytes) == (1000, 4500)
    assert [(s.site, s.function, s.bytes) for s in h.by_site if s.phase == "request"] == [
        ("/srv/app/engine.py:137", "cond_stream", 4000), (S.NO_FRAMES, None, 500)]
    assert not any("history" in n or "cannot be told" in n for n in h.notes), h.notes
    # without it the same snapshot cannot say which is which
    assert S.read(after, request_began_us=0, at_end=True).request_bytes is None
    # through the bounded child, as the runner reads both files
    import pickle

    from runner.observe import isolated
    told = isolated.read("live", pickle.dumps(before), {}, S.SnapshotError)
    doc = isolated.read("snapshot", pickle.dumps(after), {"request_began_us": 0, "at_end": True, "before": told},
                        S.SnapshotError)
    assert S.from_json(doc).request_bytes == 4500
