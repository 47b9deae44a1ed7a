"""The plots read back from matplotlib's own artists (legend texts, patch gids and colours, line data), not
pixels: every flag set is in its card's capacity legend with one style across cards, broken requests are not
shaded as served, the quoted peak is drawn, a session that OOMed at load gets a plot that says so."""

from __future__ import annotations

import matplotlib.colors as mcolors
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection
from matplotlib.patches import Rectangle

from runner.core.records import (
    Failure,
    FailureClass,
    OomReport,
    Peak,
    Sanity,
    Scores,
    ServerStart,
    SessionRecord,
    Status,
    StepRecord,
)
from runner.judge.findings.models import HeldMemory, HeldSite
from runner.judge.verdict import summarise
from runner.plan.matrix import VerdictRules
from runner.present import plots

MIB = 2**20
RULES = VerdictRules(target_references=2, max_latency_ratio=3.0, min_psnr_db=20, offload_roles=("offload",),
                     max_transparent_share=0.5, min_pixel_std=2.0)
GOOD = Sanity(width=64, height=64, mode="RGB", transparent_share=0.0, pixel_std=40.0, nan_or_black=False, broken=False)
BROKEN = Sanity(width=64, height=64, mode="RGBA", transparent_share=0.97, pixel_std=0.5, nan_or_black=False,
                broken=True, reasons=("97% of pixels fully transparent",))
ORDER = ["default", "offload", "int8", "fp8"]


def step(card: str, flags: str, n: int, status: Status = Status.OK, *, t: float = 0.0, mib: float = 5.0,
         sanity: Sanity = GOOD, walls: tuple[float, ...] = (), seed: int = 1) -> StepRecord:
    ok = status == Status.OK
    return StepRecord(key=f"{card}/{flags}/refs-{n}/f-seed-{seed}", card=card, flags=flags, role="other", fixture="f",
                      references=n, seed=seed, status=status, started_at=100.0 + t,
                      wall_s=None if status == Status.SKIPPED else 0.5, wall_samples_s=walls,
                      failure=Failure(kind=FailureClass.OOM, message="HTTP 500") if status == Status.FAILED else None,
                      skip_reason="server did not start" if status == Status.SKIPPED else None,
                      peaks=() if status == Status.SKIPPED else
                      (Peak(source="server-response", metric="device", bytes=int(mib * MIB), samples=1, rate_hz=None,
                            available=True),),
                      scores=Scores(baseline="b", psnr_db=30.0, ssim=0.9, size_match=True, reason=None,
                                    sanity=sanity) if ok else None)


def card_steps(card: str) -> list[StepRecord]:
    """int8 and fp8 have identical memory (fp8's output is broken); default never started (skipped)."""
    out = []
    for n in (1, 2):
        out += [step(card, "default", n, Status.SKIPPED), step(card, "offload", n, mib=3 + n),
                step(card, "int8", n, mib=4 + n), step(card, "fp8", n, mib=4 + n, sanity=BROKEN)]
    return out


def never_started(card: str) -> SessionRecord:
    failure = Failure(kind=FailureClass.OOM_AT_LOAD, message="out of memory at load",
                      evidence=("2026-01-01 00:00:00,000 ERROR refserver: model load failed: CUDA out of memory. "
                                "Tried to allocate 1.06 MiB. GPU 0 has a total capacity of 5.00 MiB of which 891.17 "
                                "KiB is free.",))
    load = (Peak(source="server", metric="device", bytes=None, samples=0, rate_hz=None, available=False,
                 reason="no samples in window (ConnectError)"),)
    return SessionRecord(key=f"{card}/default", card=card, flags="default", role="default", backend="local",
                         starts=(ServerStart(attempt=0, started_at=100.0, ready_s=None, failure=failure,
                                             stopped_at=108.0, load_peaks=load),))


def legend_texts(fig) -> list[str]:
    return [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def test_every_flag_set_is_in_the_capacity_legend_with_one_style_across_cards() -> None:
    styles = plots.flag_styles(ORDER)
    colours = {}
    for card in ("a", "b"):
        cells = summarise(card_steps(card), RULES)
        fig = plots.capacity_figure(card, cells, ORDER, 6 * MIB, styles, {"default": "OOM at load"})
        texts = legend_texts(fig)
        for flags in ORDER:
            assert any(t == flags or t.startswith(f"{flags}:") for t in texts), (flags, texts)
        assert "default: OOM at load" in texts
        handles = fig.axes[0].get_legend().legend_handles
        colours[card] = {t.split(":")[0]: mcolors.to_hex(h.get_color())
                         for t, h in zip(texts, handles, strict=True) if t.split(":")[0] in ORDER}
        # int8 and fp8 have the same figures: drawn side by side, not one on top of the other
        lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
        assert set(lines["int8"].get_xdata()).isdisjoint(lines["fp8"].get_xdata())
        assert list(lines["int8"].get_ydata()) == list(lines["fp8"].get_ydata())
        # the never-started flag set is drawn (stars on the capacity line), in its own colour
        stars = [ln for ln in fig.axes[0].get_lines() if ln.get_marker() == "*"]
        assert stars and all(y == 6.0 for y in stars[0].get_ydata())
        assert mcolors.to_hex(stars[0].get_markerfacecolor()) == mcolors.to_hex(styles["default"].color)
        # "not served" crosses are black: no flag set shares their colour
        crosses = [ln for ln in fig.axes[0].get_lines() if ln.get_marker() == "x"]
        assert crosses and all(mcolors.to_hex(c.get_color()) == "#000000" for c in crosses)
    assert colours["a"] == colours["b"] and len(set(colours["a"].values())) == len(ORDER)
    assert "#000000" not in colours["a"].values() and mcolors.to_hex("tab:red") not in colours["a"].values()


def test_broken_steps_are_not_shaded_as_served() -> None:
    steps = [step("c", "fp8", 1, t=1), step("c", "fp8", 1, t=2, sanity=BROKEN, seed=2),
             step("c", "fp8", 2, Status.FAILED, t=3)]
    session = SessionRecord(key="c/fp8", card="c", flags="fp8", role="quantization", backend="local",
                            starts=(ServerStart(attempt=0, started_at=99.0, ready_s=1.0, failure=None,
                                                stopped_at=105.0),))
    rows = [(100.0 + i / 10, 0, "server", "device", int((4 + (i % 7) / 10) * MIB)) for i in range(40)]
    fig = plots.session_figure(session, steps, rows, 6 * MIB)
    assert fig is not None
    spans = {p.get_gid(): p for p in fig.axes[0].patches if isinstance(p, Rectangle) and p.get_gid()}
    served_colour = mcolors.to_rgb(plots.OUTCOME_COLORS["served"])
    by_outcome = {gid.split("|")[2]: mcolors.to_rgb(p.get_facecolor()) for gid, p in spans.items()
                  if gid.startswith("step|")}
    assert spans["step|c/fp8/refs-1/f-seed-2|broken"] is not None
    assert by_outcome["broken"] != served_colour and by_outcome["failed"] != served_colour
    assert by_outcome["served"] == served_colour
    # the quoted request peak is drawn (a horizontal segment at each step's server-response figure)
    segments = [seg for c in fig.axes[0].collections if isinstance(c, LineCollection) for seg in c.get_segments()]
    assert any(abs(seg[0][1] - 5.0) < 1e-9 for seg in segments)
    # sparse series are steps, not straight ramps
    trace = next(ln for ln in fig.axes[0].get_lines() if ln.get_label() == "server (sampled)")
    assert trace.get_drawstyle() == "steps-post"


def test_oom_at_load_session_gets_a_plot_that_says_so() -> None:
    rows = [(100.0 + i / 10, 0, "host", "host", 300 * MIB) for i in range(60)]
    fig = plots.session_figure(never_started("c"), [], rows, 5 * MIB)
    assert fig is not None
    dev = fig.axes[0]
    assert "OOM at load" in dev.get_title()
    assert any(ln.get_gid() == "never-ready|0" for ln in dev.get_lines())
    note = " ".join(t.get_text() for ax in fig.axes for t in ax.texts)
    assert "no device reading while loading" in note and "CUDA out of memory" in note
    assert "5.00 MiB" in note or note.endswith("…")  # the quoted evidence is never cut mid-number
    # without any memory row at all it still gets its plot
    assert plots.session_figure(never_started("c"), [], [], 5 * MIB) is not None


def test_latency_plot_shows_the_spread_of_repeats() -> None:
    steps = [step("c", "offload", n, walls=(0.4, 0.5, 0.9)) for n in (1, 2)]
    cells = summarise(steps, RULES)
    fig = plots.latency_figure("c", steps, cells, ["offload"], plots.flag_styles(["offload"]))
    assert fig is not None
    container = fig.axes[0].containers[0]
    _, _, (bars,) = container
    (lo, hi) = bars.get_segments()[0][:, 1]
    assert lo == pytest.approx(0.4) and hi == pytest.approx(0.9)
    assert "repeats" in fig.axes[0].get_title()


def test_an_oom_is_drawn_at_the_capacity_line_not_at_the_lower_sampled_reading() -> None:
    steps = [step("c", "default", 1, mib=4.0), step("c", "default", 2, Status.FAILED, mib=4.5)]
    cells = summarise(steps, RULES)
    fig = plots.capacity_figure("c", cells, ["default"], 6 * MIB, plots.flag_styles(["default"]), {})
    line = next(ln for ln in fig.axes[0].get_lines() if ln.get_label() == "default")
    assert list(line.get_ydata()) == [4.0, 6.0]


def test_a_host_memory_oom_is_drawn_at_its_reading_not_at_the_cards_capacity() -> None:
    # the kernel's OOM killer ended the container: host RAM ran out, which says nothing of the card's memory
    killed = step("c", "default", 2, Status.FAILED, mib=4.5)
    killed = killed.model_copy(update={"failure": Failure(
        kind=FailureClass.OOM, message="the kernel's OOM killer ended the server",
        oom=OomReport(message="OOMKilled", source="engine", memory="host"))})
    cells = summarise([step("c", "default", 1, mib=4.0), killed], RULES)
    assert [c.oom_memory for c in cells] == [None, "host"]
    fig = plots.capacity_figure("c", cells, ["default"], 6 * MIB, plots.flag_styles(["default"]), {})
    line = next(ln for ln in fig.axes[0].get_lines() if ln.get_label() == "default")
    assert list(line.get_ydata()) == [4.0, 4.5]
    at_load = Failure(kind=FailureClass.OOM_AT_LOAD, message="killed at load",
                      oom=OomReport(message="OOMKilled", source="engine", memory="host"))
    assert plots.start_failure_label(at_load) == "host-memory OOM at load"
    assert plots.start_failure_label(at_load.model_copy(update={"oom": None})) == "OOM at load"


def _four_steps_and_a_late_first_reading() -> tuple[SessionRecord, list[StepRecord], list]:
    """A server that loads for 10 s (the `server` gauge answers only at readiness: 3.13 MiB), then serves
    refs 1, 1, 2, 2 with a client turnaround between requests."""
    steps = [step("c", "int8", n, t=10 + 3 * i, seed=1 + i % 2, walls=(1.0, 1.2)) for i, n in enumerate((1, 1, 2, 2))]
    load = (Peak(source="server", metric="device", bytes=int(3.13 * MIB), samples=1, rate_hz=None, available=True),
            Peak(source="server-response", metric="device", bytes=None, samples=0, rate_hz=None, available=False,
                 reason="no request during load"))
    session = SessionRecord(key="c/int8", card="c", flags="int8", role="quantization", backend="local",
                            starts=(ServerStart(attempt=0, started_at=100.0, ready_s=10.0, failure=None,
                                                stopped_at=125.0, load_peaks=load),))
    rows = [(110.0 + i / 10, 0, "server", "device", int((3.13 + (i % 9) / 10) * MIB)) for i in range(130)]
    rows += [(100.0 + i / 5, 0, "host", "host", 300 * MIB) for i in range(120)]
    return session, steps, rows


def test_the_load_note_sits_outside_the_data_and_quotes_the_reading_at_readiness() -> None:
    session, steps, rows = _four_steps_and_a_late_first_reading()
    fig = plots.session_figure(session, steps, rows, 6 * MIB)
    assert fig is not None
    canvas = FigureCanvasAgg(fig)  # the renderer savefig would use (the figure is made without pyplot)
    canvas.draw()
    renderer = canvas.get_renderer()
    notes = [t for ax in fig.axes for t in ax.texts if t.get_gid() == "notes"]
    assert len(notes) == 1
    box = notes[0].get_bbox_patch().get_window_extent(renderer)
    for ax in fig.axes:  # neither the device nor the host panel: no trace, peak bar or span under it
        assert not box.overlaps(ax.get_window_extent(renderer)), (ax.get_ylabel(), box, ax.get_window_extent())
    label = fig.axes[1].xaxis.label.get_window_extent(renderer)
    assert not box.overlaps(label)
    text = notes[0].get_text()
    assert "no device reading while loading" in text
    assert "at readiness 3.13 MiB" in text  # what the session table's load-peak column gives
    assert "until load is over" not in text


def test_timeline_separators_fall_where_the_reference_count_changes() -> None:
    session, steps, rows = _four_steps_and_a_late_first_reading()
    fig = plots.session_figure(session, steps, rows, 6 * MIB)
    assert fig is not None
    dev = fig.axes[0]
    t0 = 100.0
    separators = [ln for ln in dev.get_lines() if ln.get_gid() and ln.get_gid().startswith("refs|")]
    assert [ln.get_gid() for ln in separators] == ["refs|1->2"]
    assert separators[0].get_xdata()[0] == pytest.approx(steps[2].started_at - t0)  # the first 2-ref request
    white = [ln for ln in dev.get_lines() if mcolors.to_hex(ln.get_color()) == "#ffffff"]
    assert white == separators  # no other white line
    # within a reference count the shading is closed up to the next request: no white gap there
    spans = {p.get_gid(): p for p in dev.patches
             if isinstance(p, Rectangle) and (p.get_gid() or "").startswith("step|")}
    first, second = (spans[f"step|{s.key}|served"] for s in steps[:2])
    x_end = max(v[0] for v in first.get_path().transformed(first.get_patch_transform()).vertices)
    x_next = min(v[0] for v in second.get_path().transformed(second.get_patch_transform()).vertices)
    assert x_end == pytest.approx(x_next)


def test_latency_plot_draws_the_median_as_the_tables_do() -> None:
    steps = [step("c", "offload", n, walls=(0.4, 0.5, 0.9)) for n in (1, 2)]
    cells = summarise(steps, RULES)
    fig = plots.latency_figure("c", steps, cells, ["offload"], plots.flag_styles(["offload"]))
    assert fig is not None
    line = fig.axes[0].containers[0].lines[0]
    assert list(line.get_ydata()) == pytest.approx([0.5, 0.5])  # the median; the mean would be 0.6
    assert all(c.wall_s == pytest.approx(0.5) for c in cells)  # the tables' figure
    assert "median" in fig.axes[0].get_title()


def _held(resident: float, request_sites: tuple[float, ...]) -> HeldMemory:
    sites = tuple(HeldSite(site=f"diffusers/models/a.py:{i}", function="forward", phase="request", bytes=int(b),
                           blocks=1) for i, b in enumerate(request_sites))
    request = sum(request_sites)
    return HeldMemory(at="oom", source="allocator snapshot", references=3, how="segments at the oom",
                      active_bytes=int(resident + request), resident_bytes=int(resident), request_bytes=int(request),
                      inactive_bytes=0, reserved_bytes=int(resident + request), tried_bytes=int(64 * MIB),
                      by_site=sites)


def test_the_held_plot_zooms_on_the_bars_tops_only_where_the_weights_fill_the_card() -> None:
    """A real model's weights (21.6 of 24 GiB) leave the request's sites a sliver of the bar: a second panel
    shows the tops from just under the resident set; a card whose bars are mostly request keeps one panel."""
    gib = 1024 * MIB
    weights = [("default", _held(21.6 * gib, (384 * MIB, 192 * MIB))), ("cond-host", _held(21.6 * gib, (96 * MIB,)))]
    fig = plots.held_figure("h200-as-3090", weights, 24 * gib)
    assert fig is not None and len(fig.axes) == 2
    whole, zoom = fig.axes
    low, high = zoom.get_ylim()
    assert whole.get_ylim()[0] == 0 and 20 < low < 21.6 and 24 < high < 24.5  # GiB: under the weights to the line
    assert plots.zoom_floor(weights, 24 * gib) == pytest.approx(low * gib)
    labels = {t.get_text() for t in zoom.texts}
    assert {"384.00 MiB", "192.00 MiB", "96.00 MiB"} <= labels  # the sites' sizes are written where they show
    activations = [("cpu-offload", _held(0.0, (2.27 * MIB, 1.0 * MIB)))]
    fig = plots.held_figure("cpu-tiny", activations, 4.8 * MIB)
    assert fig is not None and len(fig.axes) == 1 and plots.zoom_floor(activations, 4.8 * MIB) is None
