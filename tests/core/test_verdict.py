"""The verdict as a pure function of records: the seed's three worlds, and broken output never served."""

from __future__ import annotations

import re

from runner.core.records import (
    Failure,
    FailureClass,
    Peak,
    Sanity,
    Scores,
    ServerStart,
    SessionRecord,
    Status,
    StepRecord,
)
from runner.judge.decision import Stop, World
from runner.judge.verdict import decide, identical_pairs, ratio_interval
from runner.judge.verdict_text import summary
from runner.plan.matrix import VerdictRules

RULES = VerdictRules(target_references=2, max_latency_ratio=2.5, min_psnr_db=20, offload_roles=("offload",),
                     max_transparent_share=0.5, min_pixel_std=2.0)
GOOD = Sanity(width=64, height=64, mode="RGB", transparent_share=0.0, pixel_std=40.0, nan_or_black=False, broken=False)
BROKEN = Sanity(width=64, height=64, mode="RGBA", transparent_share=0.97, pixel_std=0.5, nan_or_black=False,
                broken=True, reasons=("97% of pixels fully transparent",))


def step(flags: str, role: str, n: int, status: Status = Status.OK, *, wall: float = 1.0, gib: float = 1.0,
         psnr: float | None = 30.0, sanity: Sanity = GOOD, kind: FailureClass | None = None, sha: str = "x",
         seed: int = 1, samples: tuple[float, ...] = (), evidence: tuple[str, ...] = (),
         lost: bool = False) -> StepRecord:
    failure = Failure(kind=kind, message="boom", evidence=evidence) if kind else None
    scores = Scores(baseline="b", psnr_db=psnr, ssim=0.9, size_match=True, reason=None,
                    sanity=sanity) if status == Status.OK else None
    return StepRecord(key=f"c/{flags}/refs-{n}/f-seed-{seed}", card="c", flags=flags, role=role, fixture="f",
                      references=n, seed=seed, status=status, wall_s=wall, failure=failure,
                      skip_reason="implied" if status == Status.SKIPPED else None, wall_samples_s=samples,
                      lost=lost,
                      image_sha256=f"{sha}{flags}{n}{seed}" if status == Status.OK else None,
                      peaks=(Peak(source="nvml", metric="device", bytes=int(gib * 2**30), samples=100, rate_hz=100.0,
                                  available=True),), scores=scores)


def session(flags: str, role: str, start_failure: FailureClass | None = None,
            evidence: tuple[str, ...] = ()) -> SessionRecord:
    failure = Failure(kind=start_failure, message="died at load", evidence=evidence) if start_failure else None
    start = ServerStart(attempt=0, started_at=0.0, ready_s=None if failure else 1.0, failure=failure)
    return SessionRecord(key=f"c/{flags}", card="c", flags=flags, role=role, backend="local", starts=(start,))


def test_fits_resident_when_default_serves_target() -> None:
    steps = [step("default", "default", 1), step("default", "default", 2, gib=3.0)]
    v = decide("c", steps, [session("default", "default")], RULES)
    assert v.world == World.FITS_RESIDENT and v.flags == "default"
    assert v.to_json()["evidence"]["peak_bytes"] == 3 * 2**30 and v.to_json()["evidence"]["peak_source"] == "nvml"


def test_offload_works_with_latency_ratio_against_default() -> None:
    steps = [step("default", "default", 1, wall=2.0),
             step("default", "default", 2, Status.FAILED, kind=FailureClass.OOM),
             step("host", "offload", 1, wall=2.5), step("host", "offload", 2, wall=4.0)]
    v = decide("c", steps, [session("default", "default"), session("host", "offload")], RULES)
    assert v.world == World.OFFLOAD_WORKS and v.flags == "host"
    # the same workload on both sides: offload at 1 ref vs default at 1 ref (not offload at 2 vs default at 1)
    assert v.to_json()["evidence"]["latency_ratio"] == 1.25
    assert v.to_json()["evidence"]["latency_reference"]["what"].startswith("default 'default' at 1 reference(s)")
    assert "out of memory at 2" in v.reason
    assert v.to_json()["evidence"]["flag_sets"]["default"]["record"] == "c/default/refs-2/f-seed-1"


def test_offload_too_slow_is_not_built() -> None:
    steps = [step("default", "default", 1, wall=1.0),
             step("default", "default", 2, Status.FAILED, kind=FailureClass.OOM),
             step("host", "offload", 1, wall=9.0), step("host", "offload", 2, wall=9.0)]
    v = decide("c", steps, [session("default", "default"), session("host", "offload")], RULES)
    assert v.world == World.NOT_BUILT and "too slow: latency ratio 9.00× (medians) [9.00–9.00]" in v.reason
    assert v.to_json()["evidence"]["flag_sets"]["host"]["stop"] == "latency"  # its own reason, not quality


def test_broken_output_does_not_count_as_served() -> None:
    steps = [step("default", "default", 2, sanity=BROKEN), step("fp8", "offload", 2, psnr=8.0)]
    v = decide("c", steps, [session("default", "default"), session("fp8", "offload")], RULES)
    assert v.world == World.NOT_BUILT
    assert "broken output" in v.reason and "PSNR 8.0 dB < 20 dB" in v.reason


def test_start_failure_is_named() -> None:
    steps = [step("default", "default", n, Status.SKIPPED) for n in (1, 2)]
    v = decide("c", steps, [session("default", "default", FailureClass.OOM_AT_LOAD)], RULES)
    assert v.world == World.NOT_BUILT and "server did not start (oom_at_load" in v.reason


def test_one_failed_seed_means_not_served_and_a_timeout_proves_nothing() -> None:
    steps = [step("default", "default", 2, seed=1), step("default", "default", 2, Status.FAILED, seed=2,
                                                          kind=FailureClass.TIMEOUT)]
    v = decide("c", steps, [session("default", "default")], RULES)
    assert v.world == World.UNDECIDED
    assert v.to_json()["evidence"]["blocking"][0]["record"] == "c/default/refs-2/f-seed-2"


def test_quantization_serving_is_noted_but_not_offload() -> None:
    steps = [step("default", "default", 2, Status.FAILED, kind=FailureClass.OOM), step("int8", "quantization", 2)]
    v = decide("c", steps, [session("default", "default"), session("int8", "quantization")], RULES)
    assert v.world == World.NOT_BUILT
    assert any("non-offload flag set(s) int8" in n for n in v.notes)


def test_identical_images_found_and_inert_only_when_memory_also_equal() -> None:
    a, b = step("a", "default", 1), step("b", "offload", 1)
    b = b.model_copy(update={"image_sha256": a.image_sha256})
    (pair,) = identical_pairs([a, b])
    assert (pair.a, pair.b, pair.steps, pair.same_memory) == ("a", "b", 1, True)
    assert "inert flag" in pair.note()
    c = b.model_copy(update={"peaks": (Peak(source="nvml", metric="device", bytes=3 * 2**30, samples=10, rate_hz=100.0,
                               available=True),)})
    (pair,) = identical_pairs([a, c])
    assert not pair.same_memory and "only memory" in pair.note()
    assert identical_pairs([step("a", "default", 1), step("b", "offload", 1)]) == []


# --- undecided: what stopped a flag set must say something about memory or quality ----------------------

IMPORT_TAIL = ("Traceback (most recent call last):", '  File "<string>", line 1, in <module>',
               "ModuleNotFoundError: No module named 'opentelemetry'")


def test_start_failure_without_oom_is_undecided_with_the_servers_own_line() -> None:
    steps = [step("default", "default", n, Status.SKIPPED) for n in (1, 2)]
    v = decide("c", steps, [session("default", "default", FailureClass.LOAD_EXIT, IMPORT_TAIL)], RULES)
    assert v.world == World.UNDECIDED and v.flags is None
    assert "ModuleNotFoundError: No module named 'opentelemetry'" in v.reason and "[c/default]" in v.reason
    (block,) = v.to_json()["evidence"]["blocking"]
    assert block["flags"] == "default" and block["stop"] == "unknown" and block["record"] == "c/default"
    assert block["server_says"] == ["ModuleNotFoundError: No module named 'opentelemetry'"]


def test_capacity_and_quality_everywhere_is_not_built_one_crash_makes_it_undecided() -> None:
    base = [step("default", "default", 1), step("default", "default", 2, Status.FAILED, kind=FailureClass.OOM),
            step("fp8", "offload", 2, sanity=BROKEN)]
    sessions = [session("default", "default"), session("fp8", "offload"), session("host", "offload")]
    crash = step("host", "offload", 2, Status.FAILED, kind=FailureClass.CRASH, lost=True,
                 evidence=("INFO refserver: request 2 start", "ERROR refserver: fault exit@2: exiting"))
    v = decide("c", [*base, crash], sessions, RULES)
    assert v.world == World.UNDECIDED
    assert "offload 'host': crash: boom [c/host/refs-2/f-seed-1]" in v.reason
    assert "ERROR refserver: fault exit@2: exiting" in v.reason
    line = "ERROR refserver: fault exit@2: exiting"
    failure = crash.failure.model_copy(update={"message": f"exited: {line}",
                                               "evidence": (f"2026-11-30 02:52:29,185 {line}",)})
    stamped = crash.model_copy(update={"failure": failure})
    assert decide("c", [*base, stamped], sessions, RULES).reason.count("fault exit@2") == 1  # not repeated
    assert "default 'default' stopped by capacity" in v.reason and "offload 'fp8' stopped by quality" in v.reason
    oom_instead = step("host", "offload", 2, Status.FAILED, kind=FailureClass.OOM)
    assert decide("c", [*base, oom_instead], sessions, RULES).world == World.NOT_BUILT


def test_skip_after_the_restart_limit_cites_the_lost_step() -> None:
    steps = [step("default", "default", 1, Status.FAILED, kind=FailureClass.TIMEOUT, lost=True,
                  evidence=("INFO refserver: request 1 start",)),
             step("default", "default", 2, Status.SKIPPED)]
    v = decide("c", steps, [session("default", "default")], RULES)
    assert v.world == World.UNDECIDED
    assert v.to_json()["evidence"]["blocking"][0]["record"] == "c/default/refs-1/f-seed-1"
    assert "after timeout: boom" in v.reason


def test_a_default_that_fits_wins_over_an_undecided_offload() -> None:
    steps = [step("default", "default", 2), step("host", "offload", 2, Status.FAILED, kind=FailureClass.CRASH)]
    v = decide("c", steps, [session("default", "default"), session("host", "offload")], RULES)
    assert v.world == World.FITS_RESIDENT


def test_evidence_cites_the_oom_not_the_skip_it_implied() -> None:
    rules = RULES.model_copy(update={"target_references": 4})
    steps = [step("default", "default", 2), step("default", "default", 3, Status.FAILED, kind=FailureClass.OOM,
                                                   evidence=("torch.OutOfMemoryError: CUDA out of memory",)),
             step("default", "default", 4, Status.SKIPPED)]
    v = decide("c", steps, [session("default", "default")], rules)
    assert v.world == World.NOT_BUILT
    assert v.to_json()["evidence"]["flag_sets"]["default"]["record"] == "c/default/refs-3/f-seed-1"
    assert "out of memory at 3 reference(s) (which implies 4)" in v.reason
    says = v.to_json()["evidence"]["flag_sets"]["default"]["server_says"]
    assert says == ["torch.OutOfMemoryError: CUDA out of memory"]
    # the skip names its deciding step (implied_by): that one is cited, even with another OOM beside it
    seed2 = step("default", "default", 3, Status.FAILED, kind=FailureClass.OOM, seed=2)
    named = [*steps[:2], seed2, steps[2].model_copy(update={"implied_by": seed2.key})]
    v = decide("c", named, [session("default", "default")], rules)
    assert v.to_json()["evidence"]["flag_sets"]["default"]["record"] == "c/default/refs-3/f-seed-2"


def test_baseline_cell_is_labelled_not_scored_against_itself() -> None:
    s = step("default", "default", 2)
    s = s.model_copy(update={"scores": s.scores.model_copy(update={"baseline": s.key, "psnr_db": 100.0})})
    v = decide("c", [s], [session("default", "default")], RULES)
    (cell,) = v.cells
    assert cell.baseline and cell.psnr_db is None
    assert "100" not in v.reason and "the baseline cell" in v.reason


# --- latency with its noise --------------------------------------------------------------------------

def _latency_case(offload_walls: tuple[float, ...], default_walls: tuple[float, ...] = (1.0, 1.1, 0.9)) -> list:
    """default serves 1 ref and OOMs at 2; the offload serves both; two seeds, timed repeats per step."""
    half = len(default_walls) // 2 or 1
    return [step("default", "default", 1, seed=1, wall=default_walls[0], samples=default_walls[:half]),
            step("default", "default", 1, seed=2, wall=default_walls[half], samples=default_walls[half:]),
            step("default", "default", 2, Status.FAILED, kind=FailureClass.OOM),
            *(step("host", "offload", n, seed=sd, wall=ws[0], samples=ws) for n in (1, 2)
              for sd, ws in ((1, offload_walls[:2]), (2, offload_walls[2:])))]


SESSIONS = [session("default", "default"), session("host", "offload")]


def test_ratio_interval_clearly_under_is_offload_works() -> None:
    v = decide("c", _latency_case((1.5, 1.6, 1.4, 1.7)), SESSIONS, RULES)
    assert v.world == World.OFFLOAD_WORKS
    lo, hi = v.to_json()["evidence"]["latency_interval"]
    assert 1.4 / 1.1 <= lo <= v.to_json()["evidence"]["latency_ratio"] <= hi <= min(1.7 / 0.9, RULES.max_latency_ratio)
    assert v.to_json()["evidence"]["latency_reference"]["samples"] == [4, 3]
    assert v.to_json()["evidence"]["wall_spread_s"] == [1.4, 1.7] and v.to_json()["evidence"]["wall_samples"] == 4


def test_ratio_interval_straddling_the_limit_is_undecided() -> None:
    v = decide("c", _latency_case((1.5, 2.9, 2.0, 2.4)), SESSIONS, RULES)  # median 2.2, spread around 2.5
    assert v.world == World.UNDECIDED
    assert "straddles 2.5: rerun with more repeats" in v.reason


def test_an_undecided_offload_flag_set_is_not_called_non_offload() -> None:
    # Seen on the H200: 'layerwise' (offload, ratio straddling) was listed beside fp8/int8 as "non-offload".
    steps = [*_latency_case((1.5, 2.9, 2.0, 2.4)), step("int8", "quantization", 2)]
    v = decide("c", steps, [*SESSIONS, session("int8", "quantization")], RULES)
    assert v.world == World.UNDECIDED
    assert [n for n in v.notes if "non-offload" in n] == [
        "served 2 only under non-offload flag set(s) int8, which do not count for this verdict"]


def test_ratio_interval_clearly_over_rejects_that_flag_set() -> None:
    v = decide("c", _latency_case((3.0, 3.3, 3.1, 3.2)), SESSIONS, RULES)  # 3.0/1.1 = 2.73 > 2.5
    assert v.world == World.NOT_BUILT
    assert v.to_json()["evidence"]["flag_sets"]["host"]["stop"] == "latency" and "too slow" in v.reason


def test_without_a_common_count_the_baseline_wall_time_is_the_reference() -> None:
    steps = [step("default", "default", 1, Status.FAILED, kind=FailureClass.OOM),
             step("host", "offload", 2, wall=20.0, samples=(20.0, 22.0))]
    v = decide("c", steps, SESSIONS, RULES, baseline_wall_s=10.0)
    assert v.world == World.OFFLOAD_WORKS and v.to_json()["evidence"]["latency_interval"] == [2.0, 2.2]
    assert v.to_json()["evidence"]["latency_reference"]["samples"] == [2, 1]
    assert "the baseline's recorded wall time (10 s) at 2" in v.to_json()["evidence"]["latency_reference"]["what"]


def test_more_repeats_narrow_the_interval() -> None:
    few, many = (1.0, 2.0), (1.0, 2.0, 1.4, 1.5, 1.6, 1.45, 1.55, 1.5, 1.6, 1.4, 1.5, 1.55)
    ref = (1.0, 1.0)
    assert ratio_interval(few, ref) == (1.0, 2.0)  # two samples: about the min–max pairing
    low, high = ratio_interval(many, ref)
    assert 1.0 < low < 1.5 < high < 2.0  # the same extremes among many: the median is pinned down
    assert ratio_interval(many, ref) == (low, high)  # a fixed seed: the verdict stays a pure function


def test_a_long_server_line_in_the_reason_is_not_cut_between_a_number_and_its_unit() -> None:
    # Seen in report.md: "... GPU 0 has a total capacity of 5.00 MiB of which 104.05 Ki…".
    line = ("ERROR refserver: request 13 generation failed: CUDA out of memory. Tried to allocate 257.00 KiB "
            "GPU 0 has a total capacity of 5.00 MiB of which 104.05 KiB is free. Including non-PyTorch memory "
            "this process has 4.90 MiB memory in use. Of the allocated memory 4.10 MiB is allocated by PyTorch")
    steps = [step("default", "default", 2, Status.FAILED, kind=FailureClass.CRASH, evidence=(line,))]
    v = decide("c", steps, [session("default", "default")], RULES)
    said = v.reason.split("the server says: ", 1)[1]
    assert len(said) <= 202 and said.endswith(" …") and not re.search(r"\w…", said)  # whole words only
    assert line.startswith(said.removesuffix(" …")) and not re.search(r"\d[\d.]* …$", said)


def test_response_body_text_is_not_labelled_as_the_server_log() -> None:
    # issue 30 F-7: an OOM found in the 500's body was cited as "server log: {"error": …}"
    body = '{"error":{"message":"Image generation failed: CUDA out of memory. Tried to allocate 54.00 MiB."}}'
    steps = [step("default", "default", 2, Status.FAILED, kind=FailureClass.HTTP_ERROR, evidence=(body,))]
    v = decide("c", steps, [session("default", "default")], RULES)
    assert "server log:" not in v.reason and "the server says: " in v.reason, v.reason


def test_a_step_the_scheduler_ended_cites_slurmstepds_line_not_sruns() -> None:
    # issue 30 S-5: the console quoted "srun: … Terminating StepId=7.0", the last line of the step's log
    line = "slurmstepd: error: *** STEP 7.0 ON vm CANCELLED AT 2026-12-01T20:26:40 ***"
    steps = [step("default", "default", 2, Status.FAILED, kind=FailureClass.CANCELLED, lost=True,
                  evidence=(line, "INFO request 3 start", "srun: launch/slurm: _step_signal: Terminating StepId=7.0"))]
    v = decide("c", steps, [session("default", "default")], RULES)
    assert "CANCELLED AT" in summary(v) and "Terminating StepId" not in summary(v), summary(v)


# --- issue 44: a world needs a device-memory figure ------------------------------------------------------

def unmetered(s: StepRecord) -> StepRecord:
    """The step as vLLM-Omni 0.30 on a CPU answers it: an image, `peak_memory_mb: 0.0`, no device meter."""
    return s.model_copy(update={"peaks": (
        Peak(source="server-response", metric="device", bytes=None, samples=0, rate_hz=None, available=False,
             reason="unavailable: choices[0].message.content[0].peak_memory_mb: the server reported 0.0 (not "
                    "measured)"),
        Peak(source="host", metric="host", bytes=2**30, samples=10, rate_hz=10.0, available=True))})


def test_a_default_serving_the_target_with_no_device_figure_decides_no_world() -> None:
    steps = [unmetered(step("default", "default", n)) for n in (1, 2)]
    v = decide("c", steps, [session("default", "default")], RULES)
    assert v.world == World.UNDECIDED and v.flags is None, v.reason
    (b,) = v.stops
    assert (b.stop, b.cause, b.record, b.references) == (Stop.UNKNOWN, "unmetered", "c/default/refs-2/f-seed-1", 2)
    assert b.detail is not None and b.detail.startswith("the server reported 0.0 (not measured) at choices[0]")
    assert "none of the card's meters reads the whole device" in b.detail
    assert summary(v) == "cannot tell — default serves 2 refs, no device-memory figure [c/default/refs-2/f-seed-1]"


def test_one_measured_step_at_the_target_is_a_figure() -> None:
    steps = [step("default", "default", 2, seed=1), unmetered(step("default", "default", 2, seed=2))]
    v = decide("c", steps, [session("default", "default")], RULES)
    assert v.world == World.FITS_RESIDENT and v.evidence.peak_bytes == 2**30


def test_an_unmetered_default_leaves_a_measured_offload_undecided_and_an_unmetered_offload_decides_nothing() -> None:
    offload = [step("cpu-offload", "offload", n, wall=1.2, samples=(1.2, 1.25, 1.18)) for n in (1, 2)]
    default = [unmetered(step("default", "default", n, samples=(1.0, 1.05, 0.98))) for n in (1, 2)]
    sessions = [session("default", "default"), session("cpu-offload", "offload")]
    v = decide("c", default + offload, sessions, RULES)
    assert v.world == World.UNDECIDED, v.reason  # whether the default fits was never measured
    oom = [step("default", "default", 2, Status.FAILED, kind=FailureClass.OOM)]
    v = decide("c", oom + [unmetered(s) for s in offload], sessions, RULES)
    assert v.world == World.UNDECIDED and [b.cause for b in v.stops] == ["oom", "unmetered"], v.reason


def test_identical_images_compare_memory_only_where_both_sides_were_measured() -> None:
    a, b = step("a", "default", 1), step("b", "offload", 1)
    b = b.model_copy(update={"image_sha256": a.image_sha256})
    (pair,) = identical_pairs([unmetered(a), unmetered(b)])
    assert (pair.same_memory, pair.compared, pair.memory) == (None, 0, "unmeasured")
    assert "different" not in pair.note() and "no device-memory figure compares them" in pair.note()
    a2, b2 = step("a", "default", 2, gib=1.0), step("b", "offload", 2, gib=3.0)
    b2 = b2.model_copy(update={"image_sha256": a2.image_sha256})
    (pair,) = identical_pairs([a, unmetered(b), a2, b2])
    assert (pair.same_memory, pair.compared, pair.steps) == (False, 1, 2)
    assert "different memory peaks (on the 1 of 2 shared steps with a device figure on both sides)" in pair.note()
