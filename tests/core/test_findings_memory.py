"""The memory model, contribution sites, fragmentation and serving profiles on records, with the measured
Qwen-Image peaks and OOMs (tests/core/fixtures/oom) where they fit."""

from __future__ import annotations

import json
from pathlib import Path

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
from runner.judge.decision import Verdict
from runner.judge.findings.build import allocator_pairs, card_findings
from runner.judge.findings.memory import fit, memory_model
from runner.judge.findings.profiles import profiles
from runner.judge.verdict import decide
from runner.judge.verdict_text import findings_lines, size
from runner.observe.oom import read_oom
from runner.plan.matrix import VerdictRules

FIX = Path(__file__).parent / "fixtures" / "oom"
RUNS = json.loads((FIX / "qwen-peaks.json").read_text())["runs"]
GIB = 2**30
GOOD = Sanity(width=64, height=64, mode="RGB", transparent_share=0.0, pixel_std=40.0, nan_or_black=False, broken=False)
RULES = VerdictRules(target_references=4, max_latency_ratio=2.5, min_psnr_db=20, offload_roles=("offload",),
                     max_transparent_share=0.5, min_pixel_std=2.0)


def served(flags: str, n: int, nbytes: int, *, source: str = "server-response", wall: float = 1.0,
           role: str = "default") -> StepRecord:
    return StepRecord(key=f"c/{flags}/refs-{n}/f-seed-1", card="c", flags=flags, role=role, fixture="f",
                      references=n, seed=1, status=Status.OK, wall_s=wall, wall_samples_s=(wall, wall),
                      image_sha256=f"{flags}{n}", peaks=(Peak(source=source, metric="device", bytes=nbytes, samples=1,
                                                              rate_hz=None, available=True),),
                      scores=Scores(baseline="b", psnr_db=30.0, ssim=0.9, size_match=True, reason=None, sanity=GOOD),
                      started_at=float(n))


def oom_step(flags: str, n: int, message: str, role: str = "default") -> StepRecord:
    report = read_oom(log=message)
    return StepRecord(key=f"c/{flags}/refs-{n}/f-seed-1", card="c", flags=flags, role=role, fixture="f",
                      references=n, seed=1, status=Status.FAILED,
                      failure=Failure(kind=FailureClass.OOM, message="HTTP 500", evidence=(message[:400],),
                                      http_status=500, exit_code=None, oom=report))


def session(flags: str, role: str = "default") -> SessionRecord:
    return SessionRecord(key=f"c/{flags}", card="c", flags=flags, role=role, backend="local",
                         starts=(ServerStart(attempt=0, started_at=0.0, ready_s=1.0, failure=None),))


def test_the_line_through_qwen_image_peaks_gives_its_cost_per_reference() -> None:
    allocated = {int(n): v["allocated"] for n, v in RUNS["uncapped"]["peak_bytes_by_references"].items()}
    fixed, slope, worst = fit(sorted(allocated.items()))
    assert abs(slope / GIB - 0.356) < 0.001 and abs(fixed / GIB - 3.004) < 0.001  # the data's README figures
    assert worst < 0.001 * GIB  # "exactly linearly"


def test_the_capped_default_allocator_fits_by_allocated_bytes_and_fails_by_fragmentation() -> None:
    # The real run: allocated grows 0.356 GiB per reference, so 4 references need 4.43 GiB allocated, under the
    # 4.49 GiB cap; it ran out at 4 anyway, with 246 MiB reserved but unallocated. The line of allocated peaks
    # says headroom, the text says the line does not explain the OOM and that fragmentation decided it.
    capped = RUNS["cap_default_allocator"]
    steps = [served("default", int(n), v["allocated"]) for n, v in capped["peak_bytes_by_references"].items()]
    steps.append(oom_step("default", 4, "torch.OutOfMemoryError: " + capped["oom_message"]))
    m = memory_model(steps, session("default"), 4, 24 * GIB)
    assert m.points == 4 and m.predicted_from == "line" and m.oom is not None
    assert m.capacity_source == "oom-allowed" and m.capacity_bytes == round(4.49 * GIB)  # the cap, not 24 GiB
    assert m.shortfall_bytes is not None and -0.1 * GIB < m.shortfall_bytes < 0
    assert m.oom.reserved_unallocated_bytes == round(246.14 * 2**20) > -m.shortfall_bytes
    v = decide("c", steps, [session("default")], RULES, capacity_bytes=24 * GIB)
    assert "fragmentation decided it" in "\n".join(findings_lines(v))
    # by reserved bytes (what vLLM-Omni 0.30 reports as peak_memory_mb) the same run is short at 4
    reserved = [served("default", int(n), v["reserved"]) for n, v in capped["peak_bytes_by_references"].items()]
    r = memory_model([*reserved, steps[-1]], session("default"), 4, 24 * GIB)
    assert r.shortfall_bytes is not None and r.shortfall_bytes > 0


def test_a_whole_device_source_adds_what_the_oom_saw_outside_pytorch() -> None:
    capped = RUNS["cap_default_allocator"]
    steps = [served("default", 1, 4 * GIB, source="nvml"), served("default", 2, int(4.3 * GIB), source="nvml"),
             oom_step("default", 3, capped["oom_message"])]
    m = memory_model(steps, session("default"), 3, 24 * GIB)
    outside = round(4.87 * GIB) - round(3.96 * GIB) - round(246.14 * 2**20)
    assert m.capacity_bytes == round(4.49 * GIB) + outside


def test_fewer_than_two_served_counts_say_so_instead_of_a_slope() -> None:
    m = memory_model([served("default", 2, GIB)], session("default"), 4, 2 * GIB)
    assert m.per_reference_bytes is None and m.points == 1 and "no slope" in (m.no_line or "")
    assert m.predicted_peak_bytes is None and m.shortfall_bytes is None


def test_fragmentation_and_contribution_sites_from_the_real_tracebacks() -> None:
    default_log = (FIX / "qwen-default.txt").read_text()
    expandable_log = (FIX / "qwen-expandable.txt").read_text()
    steps = [served("default", n, v["allocated"]) for n, v in
             ((int(k), x) for k, x in RUNS["cap_default_allocator"]["peak_bytes_by_references"].items())]
    steps.append(oom_step("default", 4, default_log))
    steps += [served("expandable", int(k), x["allocated"], role="offload")
              for k, x in RUNS["cap_expandable_segments"]["peak_bytes_by_references"].items() if int(k) < 4]
    steps.append(oom_step("expandable", 4, expandable_log, role="offload"))  # (here: at 4, as the test wants it)
    pairs = allocator_pairs([("default", (), {}), ("expandable", (), {"PYTORCH_CUDA_ALLOC_CONF":
                                                                       "expandable_segments:True"})])
    assert pairs == (("default", "expandable"),)
    f = card_findings(steps, [session("default"), session("expandable", "offload")],
                      {"default": "default", "expandable": "offload"}, 4, ("offload",), 24 * GIB,
                      {"default": "capacity", "expandable": "capacity"}, pairs)
    (frag,) = f.fragmentation
    assert frag.a_reserved_unallocated_bytes == round(246.14 * 2**20) and frag.b_still_short
    assert frag.b_reserved_unallocated_bytes == round(85.14 * 2**20)
    (site,) = f.contribution_sites  # both stopped at the probe script's own line
    assert site.site == "/home/user/probe/qwen_oom.py:29" and site.flag_sets == ("default", "expandable")
    assert site.tried_bytes == (480 * 2**20, 576 * 2**20)


def test_findings_sentences_are_the_records_numbers() -> None:
    capped = RUNS["cap_default_allocator"]
    steps = [served("default", int(n), v["reserved"]) for n, v in capped["peak_bytes_by_references"].items()]
    steps.append(oom_step("default", 4, (FIX / "qwen-default.txt").read_text()))
    v = decide("c", steps, [session("default")], RULES, capacity_bytes=24 * GIB)
    assert v.world == "not-built" and v.findings is not None
    text = "\n".join(findings_lines(v))
    m = v.findings.flag_sets["default"].memory
    assert f"One more reference costs {size(m.per_reference_bytes)}" in text
    assert f"short by {size(m.shortfall_bytes)}" in text and "(the per-process cap its OOM message states)" in text
    assert ("<code>/home/user/probe/qwen\\_oom.py:29</code> in <code>run</code> stopped default at 4 refs "
            "(tried 480.00 MiB)") in text
    assert "246.14 MiB reserved but unallocated" in text
    assert text.startswith("The reference path works: <code>c/default/refs-1/f-seed-1</code>")


def test_profiles_list_who_serves_each_count_fastest_first_and_drop_the_too_slow() -> None:
    steps = [served("default", 1, GIB, wall=1.0), served("default", 2, 2 * GIB, wall=1.2),
             served("host", 1, GIB // 2, wall=1.5, role="offload"), served("host", 2, GIB, wall=4.0, role="offload"),
             served("slow", 1, GIB, wall=9.0, role="offload")]
    steps = [s.model_copy(update={"wall_samples_s": (s.wall_s, s.wall_s)}) for s in steps]
    rules = RULES.model_copy(update={"target_references": 2})
    v = decide("c", steps, [session("default"), session("host", "offload"), session("slow", "offload")], rules,
               capacity_bytes=3 * GIB)
    doc = profiles("r", [v], rules, {"c": 3 * GIB})
    one, two = doc.cards[0].counts
    assert [e.flags for e in one.serve] == ["default", "host"] and "slow" in one.excluded
    assert [e.flags for e in two.serve] == ["default"] and "host" in two.excluded  # 4.0 / 1.2 = 3.3 > 2.5
    assert one.serve[1].headroom_bytes == 3 * GIB - GIB // 2 and one.serve[1].latency_ratio == 1.5


def test_a_wall_of_zero_seconds_is_no_timing_and_no_divisor() -> None:
    """Issue 30 R-1: an edited record whose served sends took 10 µs (walls are summarised to 0.1 ms: 0 s) gave
    profiles.json a division by zero; such a wall is no timing: no latency ratio is made of it."""
    steps = [served("default", 1, GIB, wall=1e-5), served("host", 1, GIB // 2, wall=1.5, role="offload")]
    rules = RULES.model_copy(update={"target_references": 1})
    v = decide("c", steps, [session("default"), session("host", "offload")], rules, capacity_bytes=3 * GIB)
    (count,) = profiles("r", [v], rules, {"c": 3 * GIB}).cards[0].counts
    assert {e.flags: e.latency_ratio for e in count.serve} == {"default": None, "host": None}


def load_oom_verdict(message: str) -> Verdict:
    """The verdict of a 16 GiB card whose only flag set ran out of memory at load with this message."""
    failure = Failure(kind=FailureClass.OOM_AT_LOAD, message="out of memory at load", evidence=(), http_status=None,
                      exit_code=1, oom=read_oom(log=message))
    sess = SessionRecord(key="c/default", card="c", flags="default", role="default", backend="local",
                         starts=(ServerStart(attempt=0, started_at=0.0, ready_s=None, failure=failure),))
    skipped = StepRecord(key="c/default/refs-1/f-seed-1", card="c", flags="default", role="default", fixture="f",
                         references=1, seed=1, status=Status.SKIPPED, skip_reason="server did not start")
    return decide("c", [skipped], [sess], RULES, capacity_bytes=16 * GIB)


def test_a_load_oom_says_how_short_loading_is_and_where() -> None:
    # the seed's 5080: every flag set out of memory at init, 96 MiB short of room, in vLLM-Omni's init path
    message = ("(EngineCore_0 pid=9) Traceback (most recent call last):\n"
               '(EngineCore_0 pid=9)   File "/opt/venv/lib/python3.12/site-packages/vllm_omni/diffusion/models/'
               'utils.py", line 163, in init_parameters\n'
               "(EngineCore_0 pid=9)     param.data = torch.empty_like(param, device=device)\n"
               "(EngineCore_0 pid=9) torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 96.00 MiB. GPU 0 "
               "has a total capacity of 15.47 GiB of which 33.06 MiB is free. Including non-PyTorch memory, this "
               "process has 15.43 GiB memory in use. Of the allocated memory 15.01 GiB is allocated by PyTorch, and "
               "12.34 MiB is reserved by PyTorch but unallocated.\n")
    v = load_oom_verdict(message)
    assert v.world == "not-built" and v.findings is not None
    (site,) = v.findings.contribution_sites
    assert (site.site, site.function, site.references) == ("vllm_omni/diffusion/models/utils.py:163",
                                                            "init_parameters", (None,))
    text = "\n".join(findings_lines(v))
    assert ("Loading needs at least 15.52 GiB (15.43 GiB in use + 96.00 MiB) against 15.47 GiB usable: short by at "
            "least") in text
    assert "every failure was out of memory" in text  # functional: not known, memory came first


# --- pathological peaks and OOMs (issue 30) ----------------------------------------------------------------

MIB = 2**20


def test_peaks_that_fall_as_references_rise_predict_nothing_and_say_so() -> None:
    # M-1: a line with a negative slope gave a negative predicted peak and "11.00 MiB of headroom" on 8 MiB
    steps = [served("default", 1, 5 * MIB), served("default", 2, 4 * MIB + MIB // 2), served("default", 3, 4 * MIB)]
    m = memory_model(steps, session("default"), 4, 8 * MIB)
    assert m.predicted_peak_bytes is None and m.shortfall_bytes is None
    assert m.fixed_bytes is None and m.per_reference_bytes is None
    assert m.no_line is not None and "not used to predict" in m.no_line and "-512.00 KiB" not in m.no_line
    v = decide("c", steps, [session("default")], RULES, capacity_bytes=8 * MIB)
    text = "\n".join(findings_lines(v))
    assert "headroom" not in text and "the line gives" not in text and "fixed -" not in text, text
    assert "a line that does not describe the data, not used to predict" in text
    # a negative working set (the line's value at 0) is no line either
    rising = [served("default", 1, 1 * MIB), served("default", 2, 10 * MIB)]
    m = memory_model(rising, session("default"), 4, 64 * MIB)
    assert m.predicted_peak_bytes is None and m.fixed_bytes is None and "fixed size" in (m.no_line or "")


def test_the_worked_sum_adds_up_to_the_prediction() -> None:
    # M-2: "10.53 MiB (7.90 MiB + 1 × 3.95 MiB)": the sum started from the last peak, the prediction from the line
    steps = [served("default", 1, 4 * MIB), served("default", 2, 9 * MIB), served("default", 3, 11 * MIB)]
    v = decide("c", steps, [session("default")], RULES, capacity_bytes=64 * MIB)
    m = v.findings.flag_sets["default"].memory if v.findings else None
    assert m is not None and m.predicted_from == "line" and m.fixed_bytes is not None and m.per_reference_bytes
    assert m.predicted_peak_bytes == m.fixed_bytes + 4 * m.per_reference_bytes
    text = "\n".join(findings_lines(v))
    assert (f"the line gives {size(m.predicted_peak_bytes)} ({size(m.fixed_bytes)} fixed + 4 × "
            f"{size(m.per_reference_bytes)})") in text, text


def test_a_load_oom_within_the_capacity_is_not_a_negative_shortfall() -> None:
    # F-4: other processes held the GPU: this load's use + the allocation fit the total, yet it ran out
    message = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 96.00 MiB. GPU 0 has a total capacity "
               "of 15.47 GiB of which 20.00 MiB is free. Including non-PyTorch memory, this process has 15.17 GiB "
               "memory in use. Of the allocated memory 15.01 GiB is allocated by PyTorch, and 12.34 MiB is reserved "
               "by PyTorch but unallocated.\n")
    v = load_oom_verdict(message)
    text = "\n".join(findings_lines(v))
    assert "short by at least -" not in text and "short by at least" not in text, text
    assert ("Loading needs at least 15.26 GiB (15.17 GiB in use + 96.00 MiB), within the 15.47 GiB the message "
            "states and 20.00 MiB free: the rest was held outside this process") in text, text


def test_site_names_render_as_themselves_in_markdown() -> None:
    # F-6: `__init__`, `_x_` and `~~` inside <code> still made bold, italic and strikethrough in report.md
    from markdown_it import MarkdownIt

    tb = ("Traceback (most recent call last):\n"
          '  File "/venv/lib/python3.12/site-packages/vllm_omni/diffusion/__init__.py", line 12, in _x_\n'
          "    y()\n"
          '  File "/venv/lib/python3.12/site-packages/vllm_omni/~~gone~~/a*b*.py", line 3, in __call__\n'
          "    z()\n"
          "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 MiB.\n")
    steps = [served("default", 1, GIB), oom_step("default", 2, tb)]
    v = decide("c", steps, [session("default")], RULES, capacity_bytes=24 * GIB)
    html = MarkdownIt("commonmark").enable("strikethrough").render("\n".join(findings_lines(v)))
    html = html.replace("<strong>default</strong>", "")  # the flag set's own heading
    assert "<strong>" not in html and "<em>" not in html and "<s>" not in html, html
    assert "vllm_omni/~~gone~~/a*b*.py:3" in html and "<code>__call__</code>" in html, html
