"""What held the memory at an OOM (runner.judge.findings.held) and its words: the shortfall under the cap that
bound, what moving each part frees, and the report's sentence — from a snapshot reading (observe.snapshot.Held)."""

from __future__ import annotations

from runner.judge.findings.held import Reading, counterfactuals, held_memory, shortfall, with_held
from runner.judge.findings.models import MemoryModel, OomFacts
from runner.judge.verdict_text import held_sentence
from runner.observe.snapshot import Held, Named, Site

MIB, GIB = 2**20, 2**30


def reading(**kw: object) -> Held:
    base: dict = dict(at="oom", exact="segments at the oom", active_bytes=round(23.23 * GIB),
                      resident_bytes=round(21.64 * GIB), request_bytes=round(23.23 * GIB) - round(21.64 * GIB),
                      inactive_bytes=317 * MIB, reserved_bytes=round(23.23 * GIB) + 317 * MIB, segments=496,
                      blocks=1135, tried_bytes=576 * MIB, frames=True,
                      by_site=(Site("diffusers/models/activations.py:78", "__init__", "resident", 5 * GIB, 136),
                               Site("diffusers/models/activations.py:88", "forward", "request", 576 * MIB, 1),
                               Site("diffusers/models/transformers/transformer_qwenimage.py:698", "forward",
                                    "request", 144 * MIB, 1)))
    return Held(**(base | kw))


OOM = OomFacts(record="c/default/refs-5/f-seed-1", references=5, tried_bytes=576 * MIB,
               allocated_bytes=round(23.23 * GIB), reserved_unallocated_bytes=317 * MIB,
               in_use_bytes=round(24.21 * GIB), capacity_bytes=24 * GIB)


def test_shortfall_under_a_per_process_cap_is_what_the_failed_allocation_lacked() -> None:
    # 24 GiB allowed, 23.23 GiB allocated + 317 MiB reserved-unallocated: 0.46 GiB free, 576 MiB tried
    short = shortfall(reading(), OOM, None)
    assert short == round(23.23 * GIB) + 317 * MIB + 576 * MIB - 24 * GIB
    assert 0 < short < 576 * MIB


def test_against_the_gpu_total_the_processs_in_use_counts() -> None:
    oom = OOM.model_copy(update={"capacity_bytes": 24 * GIB, "in_use_bytes": round(23.9 * GIB)})
    assert shortfall(reading(), oom, None) == round(23.9 * GIB) + 576 * MIB - 24 * GIB


def test_without_the_ooms_figures_the_snapshot_and_the_card_capacity() -> None:
    h = reading()
    assert shortfall(h, None, 24 * GIB) == h.reserved_bytes + 576 * MIB - 24 * GIB
    assert shortfall(h, None, None) is None


def test_counterfactuals_resident_named_largest_request_site_fragmentation() -> None:
    h = reading(named=(Named("conditioning cache", "request", 300 * MIB, 60),))
    moves = counterfactuals(h, 200 * MIB)
    assert [m.move.split(" (")[0] for m in moves] == [
        "the resident set", "the conditioning cache off the device", "the largest request-time allocation",
        "the fragmentation"]
    assert [m.frees_bytes for m in moves] == [h.resident_bytes, 300 * MIB, 576 * MIB, 317 * MIB]
    assert all(m.enough for m in moves)
    small = counterfactuals(h, 400 * MIB)
    assert [m.enough for m in small] == [True, False, True, False]
    assert "diffusers/models/activations.py:88 in forward" in moves[2].move


def test_unknown_split_gives_no_resident_move_and_says_so() -> None:
    h = reading(resident_bytes=None, request_bytes=None,
                by_site=(Site("no frames recorded", None, "unknown", round(23.23 * GIB), 1135),), frames=False)
    held = held_memory(h, OOM, None, file="x.pickle", record="c/default", references=5)
    assert [c.move.split(" (")[0] for c in held.counterfactuals] == ["the fragmentation"]
    text = held_sentence("default", MemoryModel(source=None, target_references=4, held=held))
    assert "not told apart" in text and "No frames recorded" in text


def test_the_sentence_names_the_split_the_site_and_the_moves() -> None:
    model = MemoryModel(source="nvml", target_references=4, capacity_bytes=24 * GIB, oom=OOM)
    m = with_held(model, (Reading("c/default", "oom", 5, "c/default/diagnosis/oom/x.pickle", reading(), None),), None)
    assert m.held is not None and m.held.by_site[1].site == "diffusers/models/activations.py:88"
    text = held_sentence("default", m)
    assert text.startswith("'default': at the 5-reference OOM, 21.64 GiB of the 23.23 GiB held were resident "
                           "before the request; the request's largest live allocation was 576.00 MiB at "
                           "`diffusers/models/activations.py:88 in forward`")
    assert "317.00 MiB sat in segments unallocated" in text
    assert "Against a shortfall of at least" in text
    assert "the resident set (weights and what lived before the request) to the host frees 21.64 GiB: enough" in text
    assert "pytorch.org/memory_viz" in text


def test_no_snapshot_is_one_line() -> None:
    model = MemoryModel(source=None, target_references=4)
    why = "no allocator snapshot: this server cannot record one (its dialect has no profiler interface)"
    m = with_held(model, (Reading("c/default", "oom", 2, None, None, why),), None)
    assert m.held is None and m.no_held is not None and m.no_held.why == why
    assert held_sentence("default", m) == f"'default': {why}."


def test_which_site_grows_per_reference_between_two_snapshots() -> None:
    """diagnosis = always: the lowest served count's peak against the OOM (or the highest peak): per request-time
    site, what one more reference adds; the resident set and a site that shrinks are not growth."""
    mlp, attn = "diffusers/models/activations.py:88", "diffusers/models/transformers/transformer_qwenimage.py:698"
    weights = Site("diffusers/models/activations.py:78", "__init__", "resident", 5 * GIB, 1)
    low = reading(at="snapshot", by_site=(weights, Site(mlp, "forward", "request", 240 * MIB, 1),
                                          Site(attn, "forward", "request", 60 * MIB, 1),
                                          Site("x.py:1", "f", "request", 10 * MIB, 1)))
    high = reading(by_site=(weights,
                            Site(mlp, "forward", "request", 576 * MIB, 1),
                            Site(attn, "forward", "request", 144 * MIB, 1),
                            Site("x.py:1", "f", "request", 4 * MIB, 1)))
    model = MemoryModel(source="nvml", target_references=4, capacity_bytes=24 * GIB, oom=OOM)
    m = with_held(model, (Reading("c/default", "oom", 5, None, high, None),
                          Reading("c/default", "peak", 1, None, low, None)), None)
    assert m.held is not None and m.held.at == "oom"
    assert [(g.site, g.per_reference_bytes, g.from_references, g.to_references) for g in m.held.growth] == [
        (mlp, 84 * MIB, 1, 5), (attn, 21 * MIB, 1, 5)]
    assert ("What one more reference adds (1 → 5 references, two snapshots): `diffusers/models/activations.py:88 "
            "in forward` grows most, 84.00 MiB per reference") in held_sentence("default", m)
    one = with_held(model, (Reading("c/default", "oom", 5, None, high, None),), None)
    assert one.held is not None and one.held.growth == ()  # one snapshot: no growth, and no sentence for it
    assert "one more reference adds" not in held_sentence("default", one)


def test_what_the_process_held_outside_pytorchs_allocator() -> None:
    """The OOM message's in-use figure beyond PyTorch's reserved bytes: the CUDA context (the H200's 3090
    emulation: 0.68 GiB); none from the CPU ledger's message, where in-use is PyTorch's alone."""
    model = MemoryModel(source="nvml", target_references=4, capacity_bytes=24 * GIB, oom=OOM)
    m = with_held(model, (Reading("c/default", "oom", 5, None, reading(), None),), None)
    assert m.held is not None
    assert m.held.outside_pytorch_bytes == round(24.21 * GIB) - round(23.23 * GIB) - 317 * MIB
    assert "was outside PyTorch's allocator (CUDA context, libraries)" in held_sentence("default", m)
    cpu = OOM.model_copy(update={"in_use_bytes": round(23.23 * GIB) + 317 * MIB})
    none = with_held(model.model_copy(update={"oom": cpu}), (Reading("c/default", "oom", 5, None, reading(), None),),
                     None)
    assert none.held is not None and none.held.outside_pytorch_bytes is None


def test_many_resident_sites_never_hide_the_requests_largest() -> None:
    # 34 layers of weights make more resident sites than are kept: the request's activation is still named
    weights = tuple(Site(f"diffusers/models/attention.py:{n}", "__init__", "resident", GIB, 34) for n in range(20))
    h = reading(by_site=(*weights, Site("diffusers/models/activations.py:88", "forward", "request", 384 * MIB, 1)))
    m = with_held(MemoryModel(source="nvml", target_references=4, oom=OOM),
                  (Reading("c/default", "oom", 5, None, h, None),), None)
    assert m.held is not None
    assert "largest live allocation was 384.00 MiB at `diffusers/models/activations.py:88 in forward`" \
        in held_sentence("default", m)
    assert [s.site for s in m.held.by_site if s.phase == "resident"][-1] == "other sites"


def test_identical_readings_share_one_sentence_with_every_snapshot() -> None:
    from runner.judge.verdict_text import held_lines

    def model(file: str) -> MemoryModel:
        return with_held(MemoryModel(source="nvml", target_references=4, oom=OOM),
                         (Reading("c/x", "oom", 5, file, reading(), None),), None)

    other = with_held(MemoryModel(source="nvml", target_references=4, oom=OOM),
                      (Reading("c/z", "oom", 5, "z.pickle", reading(inactive_bytes=0), None),), None)
    lines = held_lines([("default", model("a.pickle")), ("int8", model("b.pickle")), ("fp8", other)])
    assert len(lines) == 2
    assert lines[0].startswith("'default', 'int8' (the same reading): at the 5-reference OOM")
    assert lines[0].endswith("Snapshots (open in pytorch.org/memory_viz): `a.pickle`, `b.pickle`.")
    assert lines[1].startswith("'fp8': at the 5-reference OOM") and "`z.pickle`" in lines[1]


def test_a_diagnosis_that_failed_elsewhere_than_the_measured_send_says_so() -> None:
    oom = OOM.model_copy(update={"tried_bytes": 98 * MIB, "site": "runner/refserver/qwen_image/prefix.py:149",
                                 "function": "_attend"})
    m = with_held(MemoryModel(source="nvml", target_references=4, oom=oom),
                  (Reading("c/x", "oom", 5, None, reading(tried_bytes=384 * MIB), None),), None)
    text = held_sentence("cond-host", m)
    assert ("failed at another allocation than the measured send, which asked 98.00 MiB at "
            "`runner/refserver/qwen\\_image/prefix.py:149 in \\_attend`") in text
    assert "another allocation" not in held_sentence("default", with_held(
        MemoryModel(source="nvml", target_references=4, oom=OOM), (Reading("c/x", "oom", 5, None, reading(), None),),
        None))


def test_weights_onloaded_for_the_request_are_their_own_move_never_the_largest_activation() -> None:
    # --cpu-offload: the transformer is copied in per request; those copies are the request's largest blocks
    onload = Site("runner/refserver/qwen_image/engine.py:76", "onload", "request", 2 * GIB, 32, "onloaded weights")
    h = reading(by_site=(onload, *reading().by_site), request_bytes=2 * GIB + 720 * MIB,
                named=(Named("onloaded weights", "request", 2 * GIB, 32),))
    moves = {m.move.split(" (")[0]: m.frees_bytes for m in counterfactuals(h, 200 * MIB)}
    assert moves["the onloaded weights off the device"] == 2 * GIB
    assert moves["the largest request-time allocation"] == 576 * MIB  # the activation, not the weights
    held = held_memory(h, OOM, None, file="x.pickle", record="c/cpu-offload", references=5)
    assert held.by_site[0].part == "onloaded weights"
    text = held_sentence("cpu-offload", MemoryModel(source=None, target_references=4, held=held))
    assert "largest live allocation was 576.00 MiB at `diffusers/models/activations.py:88 in forward`" in text
    assert "2.00 GiB of the request's bytes were the server's onloaded weights" in text
