"""What a latency ratio says to a reader (issue 31; issue 30 A-1, A-2, A-3), through the verdict as the
runner calls it: never an OverflowError, never an interval that says nothing or a bound outside
[0.001×, 1000×] in the words, never "rerun with more repeats" once auto is at max_repeats, each ratio named,
and a straddling ratio on a card that reached a world is a measured figure. verdict.json keeps the numbers
and never holds NaN or Infinity."""

from __future__ import annotations

import json
import re

from runner.core.records import FailureClass, Status
from runner.judge import verdict_text
from runner.judge.decision import SHOWN, WIDEST, World
from runner.judge.verdict import decide, open_latencies
from runner.plan import sequential
from runner.run import policy
from tests.core.test_verdict import session, step

AUTO = __import__("tests.core.test_verdict", fromlist=["RULES"]).RULES.model_copy(
    update={"latency_looks": sequential.looks(100), "latency_max_repeats": 100})
SESSIONS = [session("default", "default"), session("host", "offload")]
NUMBER = r"(\d+(?:\.\d+)?(?:e[+-]?\d+)?)"
RANGE = re.compile(NUMBER + r"\s*[–-]\s*" + NUMBER)
TIMES = re.compile(NUMBER + "×")


def _case(offload: dict[int, tuple[float, ...]], default: dict[int, tuple[float, ...]]) -> list:
    """default serves 1 ref (seeds as keys) and OOMs at 2; the offload serves 1 and 2 with the same walls."""
    steps = [step("default", "default", 1, seed=sd, wall=w[0], samples=w) for sd, w in default.items()]
    steps.append(step("default", "default", 2, Status.FAILED, kind=FailureClass.OOM))
    steps += [step("host", "offload", n, seed=sd, wall=w[0], samples=w) for n in (1, 2) for sd, w in offload.items()]
    return steps


def words(v) -> str:  # type: ignore[no-untyped-def]
    return "\n".join([v.reason, verdict_text.summary(v), verdict_text.console_line(v)])


def latency_phrases(text: str) -> list[str]:
    """Each stretch of text from "latency" to the end of its clause (";", a table cell's "|", a line's end)."""
    return [m.group(0) for m in re.finditer(r"latency[^;|\n]*", text)]


def unreadable(text: str) -> list[str]:
    """Every latency phrase with an interval wider than WIDEST or a figure outside SHOWN."""
    bad = []
    for phrase in latency_phrases(text):
        for low, high in RANGE.findall(phrase):
            lo, hi = float(low), float(high)
            if lo < SHOWN[0] or hi > SHOWN[1] or hi / lo > WIDEST:
                bad.append(phrase)
        bad += [phrase for x in TIMES.findall(phrase) if not SHOWN[0] <= float(x) <= SHOWN[1]]
    return bad


def assert_readable(text: str) -> None:
    assert unreadable(text) == [], text


def test_an_800x_slower_top_up_send_is_no_overflow_and_everything_after_it_works() -> None:
    # Issue 30, A-1: one step's top-up sends 0.0101 s then 8.0051 s (~800×) at max_repeats = 100.
    steps = _case({1: (0.0101, 8.0051)}, {1: (0.0101, 0.0102)})
    v = decide("c", steps, SESSIONS, AUTO)  # main: OverflowError: math range error
    assert v.world == World.UNDECIDED
    doc = json.dumps(v.to_json(), allow_nan=False)  # no NaN / Infinity tokens
    assert "Infinity" not in doc and "NaN" not in doc
    assert_readable(words(v))
    assert "not yet bounded" in words(v)
    opened = open_latencies("c", steps, SESSIONS, AUTO)  # the top-up pass and --resume ask this
    assert [lat.sides for lat in opened] == [(("host", 1), ("default", 1))]
    more = policy.topups([lat.sides for lat in opened if lat.sides], steps, "c", "host", 100)
    assert more and all(t.sends > 0 for t in more)


def test_no_absurd_interval_reaches_the_words_and_each_ratio_is_named() -> None:
    # Issue 30, A-2 / issue 31: main printed "offl latency 0.00–1262…×" (one send a step, wide spread).
    steps = _case({1: (0.3,), 2: (4.0,)}, {1: (0.2,), 2: (1.1,)})
    v = decide("c", steps, SESSIONS, AUTO)
    text = words(v)
    assert_readable(text)
    assert "(geometric means)" in v.reason or "(geometric means, paired by seed)" in v.reason
    lo, hi = v.to_json()["evidence"]["flag_sets"]["host"]["why"], None  # verdict.json keeps the words too
    assert "not yet bounded" in lo and hi is None
    assert "(medians)" in decide("c", steps, SESSIONS, AUTO.model_copy(update={"latency_looks": 1})).reason


def test_no_rerun_with_more_repeats_once_auto_reached_max_repeats() -> None:
    # Issue 30, A-2: both sides at max_repeats (8 here), the ratio still straddles: nothing more is planned.
    rules = AUTO.model_copy(update={"latency_looks": sequential.looks(8), "latency_max_repeats": 8})
    off = tuple(2.5 * f for f in (0.5, 1.6, 0.7, 1.4, 0.6, 1.5, 0.8, 1.3))
    steps = _case({1: off, 2: off[::-1]}, {1: (1.0, 1.01) * 4, 2: (1.01, 1.0) * 4})
    v = decide("c", steps, SESSIONS, rules)
    assert v.world == World.UNDECIDED, v.reason
    assert "rerun with more repeats" not in v.reason and "max_repeats" in v.reason
    assert open_latencies("c", steps, SESSIONS, rules) and not policy.topups(
        [lat.sides for lat in open_latencies("c", steps, SESSIONS, rules) if lat.sides], steps, "c", "host", 8)


def test_identical_wall_times_do_not_decide_at_the_limit() -> None:
    # Issue 30, A-3: 2.5 s against 1.0 s, identical twice a side, limit 2.5: main said [2.50–2.50], offload-works.
    steps = _case({1: (2.5, 2.5)}, {1: (1.0, 1.0)})
    v = decide("c", steps, SESSIONS, AUTO)
    assert v.world == World.UNDECIDED, v.reason
    low, high = v.to_json()["evidence"]["flag_sets"]["host"]["why"], None
    assert "straddles 2.5" in low and high is None


def test_a_straddling_ratio_on_a_card_that_fits_is_a_measured_figure() -> None:
    # Issue 31: "cpu-roomy: fits-resident — … cond-host latency 0.00–3607…× straddles 3": decides nothing.
    steps = [step("default", "default", n, seed=sd, wall=w, samples=(w,)) for n in (1, 2)
             for sd, w in ((1, 0.2), (2, 0.25))]
    steps += [step("host", "offload", n, seed=sd, wall=w, samples=(w,)) for n in (1, 2)
              for sd, w in ((1, 0.3), (2, 0.9))]
    v = decide("c", steps, SESSIONS, AUTO)
    assert v.world == World.FITS_RESIDENT
    text = words(v)
    assert "straddles" not in verdict_text.summary(v) and "rerun" not in text
    assert "host serves 2 refs, latency" in verdict_text.summary(v)
    assert open_latencies("c", steps, SESSIONS, AUTO) == []


def test_the_report_of_an_800x_slower_top_up_is_written(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Issue 30, A-1: `runner report` crashed as the run did; report.md and verdict.json come out readable.
    from runner.judge.verdict import decide_all
    from runner.present.report import write_report
    from runner.run.store import RunStore

    store = RunStore(tmp_path)
    for s in _case({1: (0.0101, 8.0051)}, {1: (0.0101, 0.0102)}):
        store.write_step(s)
    for s in SESSIONS:
        store.write_session(s)
    store.write_run({"run_id": "r1", "matrix": {"path": "/x/m.toml", "sha256": "0" * 64,
                                                "text": '[servers.r]\ncommand = ["x", "{port}"]\n'},
                     "runner": {"version": "0.1.0"}, "cards": {"c": {"vram_gib": 6 / 1024}},
                     "plan": {"sessions": ["c/default", "c/host"]}})
    verdicts = decide_all(store.load_steps(), store.load_sessions(), AUTO, ["c"])
    report = write_report(store, verdicts).read_text()
    assert_readable(report)
    assert "not yet bounded" in report and "OverflowError" not in report
    json.dumps([v.to_json() for v in verdicts], allow_nan=False)


def test_a_card_of_many_measured_flag_sets_still_names_each_one_within_the_glance() -> None:
    # CI on fbcd495: cpu-roomy's six flag sets ran past 300 characters ("…; fp8-collapse …"): the table's
    # "why" must name every flag set, so the others' latencies shrink to their ratio before anything is cut.
    offloads = [f"host-{i}" for i in range(5)]
    steps = [step("default", "default", n, seed=sd, wall=w, samples=(w,)) for n in (1, 2)
             for sd, w in ((1, 0.2), (2, 0.25))]
    steps += [step(f, "offload", n, seed=sd, wall=w, samples=(w,)) for f in offloads for n in (1, 2)
              for sd, w in ((1, 0.3), (2, 0.9))]
    v = decide("c", steps, [session("default", "default"), *(session(f, "offload") for f in offloads)], AUTO)
    full = "; ".join(f"{b.flags} {verdict_text.stop_words(b)}" for b in v.stops)
    assert len(full) > verdict_text.SUMMARY_LIMIT  # the case this guards: the full words would not fit
    text = verdict_text.summary(v)
    assert len(text) <= verdict_text.SUMMARY_LIMIT and "…" not in text, text
    assert all(f"{f} serves 2 refs, latency " in text for f in offloads), text
