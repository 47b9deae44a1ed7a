"""The verdict as a pure function of records: the seed's three worlds, and broken output never served."""

from __future__ import annotations

from dataclasses import replace

from runner.matrix import VerdictRules
from runner.records import Failure, FailureClass, Peak, Sanity, Scores, ServerStart, SessionRecord, Status, StepRecord
from runner.verdict import World, decide, identical_pairs

RULES = VerdictRules(target_references=2, max_latency_ratio=2.5, min_psnr_db=20, offload_roles=("offload",),
                     max_transparent_share=0.5, min_pixel_std=2.0)
GOOD = Sanity(64, 64, "RGB", 0.0, 40.0, False, False)
BROKEN = Sanity(64, 64, "RGBA", 0.97, 0.5, False, True, ("97% of pixels fully transparent",))


def step(flags: str, role: str, n: int, status: Status = Status.OK, *, wall: float = 1.0, gib: float = 1.0,
         psnr: float | None = 30.0, sanity: Sanity = GOOD, kind: FailureClass | None = None, sha: str = "x",
         seed: int = 1) -> StepRecord:
    failure = Failure(kind, "boom") if kind else None
    scores = Scores("b", psnr, 0.9, True, None, sanity) if status == Status.OK else None
    return StepRecord(key=f"c/{flags}/refs-{n}/f-seed-{seed}", card="c", flags=flags, role=role, fixture="f",
                      references=n, seed=seed, status=status, wall_s=wall, failure=failure,
                      skip_reason="implied" if status == Status.SKIPPED else None,
                      image_sha256=f"{sha}{flags}{n}{seed}" if status == Status.OK else None,
                      peaks=(Peak("nvml", "device", int(gib * 2**30), 100, 100.0, True),), scores=scores)


def session(flags: str, role: str, start_failure: FailureClass | None = None) -> SessionRecord:
    failure = Failure(start_failure, "died at load") if start_failure else None
    start = ServerStart(0, 0.0, None if failure else 1.0, failure)
    return SessionRecord(f"c/{flags}", "c", flags, role, "local", (start,))


def test_fits_resident_when_default_serves_target() -> None:
    steps = [step("default", "default", 1), step("default", "default", 2, gib=3.0)]
    v = decide("c", steps, [session("default", "default")], RULES)
    assert v.world == World.FITS_RESIDENT and v.flags == "default"
    assert v.evidence["peak_bytes"] == 3 * 2**30 and v.evidence["peak_source"] == "nvml"


def test_offload_works_with_latency_ratio_against_default() -> None:
    steps = [step("default", "default", 1, wall=2.0),
             step("default", "default", 2, Status.FAILED, kind=FailureClass.OOM),
             step("host", "offload", 1, wall=2.5), step("host", "offload", 2, wall=4.0)]
    v = decide("c", steps, [session("default", "default"), session("host", "offload")], RULES)
    assert v.world == World.OFFLOAD_WORKS and v.flags == "host"
    assert v.evidence["latency_ratio"] == 2.0  # vs default at its largest served count (1 ref)
    assert "oom" in v.reason


def test_offload_too_slow_is_not_built() -> None:
    steps = [step("default", "default", 1, wall=1.0),
             step("default", "default", 2, Status.FAILED, kind=FailureClass.OOM),
             step("host", "offload", 2, wall=9.0)]
    v = decide("c", steps, [session("default", "default"), session("host", "offload")], RULES)
    assert v.world == World.NOT_BUILT and "latency ratio 9.0 > 2.5" in v.reason


def test_broken_output_does_not_count_as_served() -> None:
    steps = [step("default", "default", 2, sanity=BROKEN), step("fp8", "offload", 2, psnr=8.0)]
    v = decide("c", steps, [session("default", "default"), session("fp8", "offload")], RULES)
    assert v.world == World.NOT_BUILT
    assert "broken output" in v.reason and "PSNR 8.0 dB < 20 dB" in v.reason


def test_start_failure_is_named() -> None:
    steps = [step("default", "default", n, Status.SKIPPED) for n in (1, 2)]
    v = decide("c", steps, [session("default", "default", FailureClass.OOM_AT_LOAD)], RULES)
    assert v.world == World.NOT_BUILT and "server did not start (oom_at_load" in v.reason


def test_one_failed_seed_means_not_served() -> None:
    steps = [step("default", "default", 2, seed=1), step("default", "default", 2, Status.FAILED, seed=2,
                                                          kind=FailureClass.TIMEOUT)]
    v = decide("c", steps, [session("default", "default")], RULES)
    assert v.world == World.NOT_BUILT


def test_quantization_serving_is_noted_but_not_offload() -> None:
    steps = [step("default", "default", 2, Status.FAILED, kind=FailureClass.OOM), step("int8", "quantization", 2)]
    v = decide("c", steps, [session("default", "default"), session("int8", "quantization")], RULES)
    assert v.world == World.NOT_BUILT
    assert any("non-offload flag set(s) int8" in n for n in v.notes)


def test_identical_images_found_and_inert_only_when_memory_also_equal() -> None:
    a, b = step("a", "default", 1), step("b", "offload", 1)
    b = replace(b, image_sha256=a.image_sha256)
    (pair,) = identical_pairs([a, b])
    assert (pair.a, pair.b, pair.steps, pair.same_memory) == ("a", "b", 1, True)
    assert "inert flag" in pair.note()
    c = replace(b, peaks=(Peak("nvml", "device", 3 * 2**30, 10, 100.0, True),))
    (pair,) = identical_pairs([a, c])
    assert not pair.same_memory and "only memory" in pair.note()
    assert identical_pairs([step("a", "default", 1), step("b", "offload", 1)]) == []
