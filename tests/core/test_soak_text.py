"""report.md's Soak section (runner.judge.soak_text) for each outcome — held, stopped by its minutes, failed,
interrupted, not run — each sentence checked against the records it came from (tests/core/soak_records.py): the
figures in it are computed here from the same parameters the records were built from."""

from __future__ import annotations

import numpy as np
from soak_records import MIB, oom, request, series, soak_record

from runner.judge.findings.soak import card_soak, flag_soak
from runner.judge.soak_text import flag_soak_lines, soak_lines
from runner.plan.matrix import Soak

EXACT = "exact: the server's own live-tensor figure"
UPPER = "an upper bound: a whole-device figure, the allocator's cache included"


def test_a_soak_that_held_every_request_says_so_with_its_level_peak_and_latency() -> None:
    leak = 2 * MIB  # per request: 12 requests, 1 and 2 references in turn
    reqs = series(range(1, 13), counts=(1, 2), floor=lambda n, refs, a: 40 * MIB + leak * n,
                  peak=lambda n, refs, a: 60 * MIB + 10 * MIB * refs + leak * n, wall=lambda n, refs: 0.25 * refs)
    f = flag_soak(soak_record(requests=12, stopped="requests", references=(1, 2)), reqs, 1024 * MIB)
    head, level, peaks, latency = flag_soak_lines("default", f)
    assert head == "**default** (named in \\[soak\\] flags): held all 12 requests, none failed."
    # floors 42 MiB (request 1) … 64 MiB (request 12), growing 2 MiB a request within each count: no residual
    assert level == (f"The level after each request (server, {EXACT}) went from 42.00 MiB after the first served "
                     "request to 64.00 MiB after the last; drift 2.00 MiB per request (95 % interval 2.00 MiB to "
                     "2.00 MiB; 10 requests).")  # requests 1 and 2 brought their references first: not in a drift
    # peaks: the highest is request 12's, 60 + 20 + 24 MiB; the last round's 104 MiB reaches 1 GiB in 460 more
    assert peaks == ("Request peaks (server) reached 104.00 MiB; drift 2.00 MiB per request (95 % interval 2.00 MiB "
                     "to 2.00 MiB; 10 requests); at that drift a peak reaches the card's 1.00 GiB within 460 more "
                     "request(s).")
    walls = [0.25, 0.5] * 6  # each count as fast at the end as at the start: no drift
    assert latency == (f"Latency over 12 served request(s): p50 {np.median(walls):.2f} s, p95 "
                       f"{np.percentile(walls, 95):.2f} s, max 0.50 s; drift 0 s per request (95 % interval 0 s to "
                       "0 s, not distinguishable from 0; 10 requests).")


def test_a_soak_that_ran_out_of_minutes_says_how_many_it_held_in_them() -> None:
    reqs = series(range(1, 8), floor=lambda n, refs, a: 30 * MIB)
    f = flag_soak(soak_record(requests=200, minutes=0.5, stopped="minutes"), reqs, None)
    head = flag_soak_lines("default", f)[0]
    assert head == "**default** (named in \\[soak\\] flags): held 7 requests in its 0.5 min (200 asked), none failed."


def test_a_failed_soak_names_the_request_its_site_the_floor_it_started_from_and_the_servers_line() -> None:
    reqs = [*series(range(1, 6), floor=lambda n, refs, a: (16 + 2 * (n - 1)) * MIB), request(6, failure=oom())]
    f = flag_soak(soak_record(requests=40, stopped="failure"), reqs, 64 * MIB)
    head = flag_soak_lines("default", f)[0]
    # the floor after request 5 (24 MiB) over the first's (16 MiB)
    assert head == ("**default** (named in \\[soak\\] flags): failed at request 6 of 40: out of memory in "
                    "`vllm_omni/diffusion/models/qwen_image/pipeline.py:737` (`forward`) with the floor 8.00 MiB "
                    "above the first request's; 5 request(s) served before it. The server said: "
                    "<code>torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 MiB</code>.")


def test_an_interrupted_soak_is_no_failure_and_a_resume_continues_it() -> None:
    reqs = series(range(1, 5), floor=lambda n, refs, a: 30 * MIB, bound="upper-bound")
    f = flag_soak(soak_record(requests=12, stopped="interrupted", starts=2), reqs, None)
    head, level, *_ = flag_soak_lines("default", f)
    assert head == ("**default** (named in \\[soak\\] flags): interrupted after 4 of 12 requests, none failed: a "
                    "resume continues it (an interrupted soak is no failure) over 2 server starts (a resume starts a "
                    "fresh one).")
    assert f"(server, {UPPER})" in level  # a whole-device source says it is an upper bound


def test_a_soak_that_never_sent_says_why_in_inert_text() -> None:
    why = "load_exit: exited with <script>alert(1)</script> [x](javascript:y)"
    f = flag_soak(soak_record(requests=12, stopped="start failed", why=why), [], None)
    assert flag_soak_lines("default", f) == [
        "**default** (named in \\[soak\\] flags): not run: load\\_exit: exited with "
        "&lt;script&gt;alert(1)&lt;/script&gt; \\[x\\](javascript:y)."]


def test_a_drift_that_wanders_is_not_distinguishable_from_0_and_two_requests_give_no_interval() -> None:
    wander = [0, 3, 1, 4, 0, 2, 5, 1, 3, 0, 2, 4]  # KiB over a level of 30 MiB, no trend to speak of
    reqs = series(range(1, 13), floor=lambda n, refs, a: 30 * MIB + wander[n - 1] * 1024)
    level = flag_soak_lines("default", flag_soak(soak_record(requests=12, stopped="requests"), reqs, None))[1]
    assert level.endswith(", not distinguishable from 0; 11 requests).") and "95 % interval -" in level
    two = series(range(1, 4), floor=lambda n, refs, a: 30 * MIB + n * MIB)  # the first brought its reference
    level = flag_soak_lines("default", flag_soak(soak_record(requests=3, stopped="requests"), two, None))[1]
    assert level.endswith("drift 1.00 MiB per request (no interval: 2 request(s) are too few for one; 2 requests).")


def test_a_soak_no_device_source_read_says_so() -> None:
    f = flag_soak(soak_record(requests=3, stopped="requests"), series(range(1, 4)), None)
    assert flag_soak_lines("default", f)[1:3] == ["No device source read the level after a request.",
                                                  "No device source read a request's peak."]


def test_the_cards_section_says_what_the_soak_mixed_and_each_flag_sets_lines() -> None:
    soak = Soak(requests=12, minutes=5, references=(1, 3), order="shuffle")
    reqs = series(range(1, 5), counts=(1, 3))
    section = soak_lines(card_soak(soak, {"default": (soak_record(requests=12, stopped="interrupted"), reqs)}, None))
    assert section[0] == ("Each soaked flag set got up to 12 requests or 5 min on one fresh server start after the "
                          "card's sessions, one at a time, mixing 1 ref, 3 refs (in a seeded random order per round); "
                          "it stops at its first failure. Its figures are its own records (`soak/requests.jsonl`), "
                          "never a matrix cell's; a drift is a least-squares slope within each server start and "
                          "reference count, over the requests that brought no reference their server had not seen "
                          "(a cache filling once is not creep).")
    assert section[2].startswith("- **default** (named in \\[soak\\] flags): interrupted after 4 of 12 requests")
    none = soak_lines(card_soak(soak, {}, None, "profiles.json lists no flag set for this card at every count"))
    assert none[-1] == "No flag set was soaked: profiles.json lists no flag set for this card at every count."


def test_a_request_above_its_matrix_cell_is_said_with_its_figures_and_the_level_it_started_from() -> None:
    reqs = series(range(1, 9), counts=(1, 4), floor=lambda n, refs, a: 12 * MIB * refs,
                  peak=lambda n, refs, a: (150 + 25 * refs) * MIB + (48 * MIB if refs == 1 and n > 1 else 0))
    cells = {("server", 1): 175 * MIB, ("server", 4): 250 * MIB}
    f = flag_soak(soak_record(requests=8, stopped="requests", references=(1, 4)), reqs, None, cells)
    (above,) = [line for line in flag_soak_lines("default", f) if line.startswith("In service")]
    # request 3 is the first 1-ref one after a 4-ref one (the level before it 48 MiB); 3, 5, 7 tie: the first named
    assert above == ("In service a request peaked above its matrix cell (same source): 1 ref 223.00 MiB at request 3 "
                     "against 175.00 MiB (+48.00 MiB; the level before it 48.00 MiB, what earlier requests left).")
