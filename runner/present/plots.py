"""The report's plots, drawn from records only. Each `*_figure` returns the matplotlib Figure (tests read its
artists back); `save` writes and closes it.

Conventions shared by every plot of a run, so a reader learns them once:
- one colour + marker per flag set, the same on every card (`flag_styles` over the run's flag-set order);
  red and black are never a flag set's colour: black marks "not served" (x) and "never ready" (*),
  red marks failures in the timelines;
- points of different flag sets at the same reference count are drawn side by side (a small x offset),
  so flag sets with identical figures stay visible instead of hiding one another.
"""

from __future__ import annotations

import io
import itertools
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypedDict

# Figures made directly, not through pyplot: no GUI backend or global figure registry to set up, a tenth of a
# CPU-second less in every run that writes a report.
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from runner.core.records import Failure, FailureClass, Level, Peak, SessionRecord, SoakRequest, Status, StepRecord
from runner.core.registry import METERS
from runner.core.units import clip, fmt_bytes, fmt_s, refs_text, unit_for
from runner.judge.decision import Cell
from runner.judge.findings.models import HeldMemory, HeldSite
from runner.present.redraw import KEY
from runner.run.store import atomic_write

COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")
MARKERS = ("o", "s", "^", "D", "v", "P", "h", "<", ">", "p")
DASHES = ("-", "--", "-.", ":")
OUTCOME_COLORS = {"served": "tab:green", "broken": "tab:orange", "failed": "tab:red"}
OUTCOME_HATCH = {"served": None, "broken": "///", "failed": "x"}


class _Mark(TypedDict, total=False):
    """Keyword arguments of a marker-only Line2D, typed so the plot calls that unpack them are checked."""
    marker: str
    color: str
    mec: str
    ms: float
    mew: float
    ls: Literal["none"]


NOT_SERVED: _Mark = {"marker": "x", "color": "black", "ms": 5, "mew": 1.3, "ls": "none"}
NEVER_READY: _Mark = {"marker": "*", "mec": "black", "ms": 15, "mew": 1.0, "ls": "none"}

@dataclass(frozen=True)
class FlagStyle:
    color: str
    marker: str
    dash: str
    width: float  # earlier flag sets are drawn wider, so a later line on top of one leaves it visible
    offset: float  # x offset in reference-count units, so equal points of two flag sets sit side by side


def flag_styles(order: Sequence[str]) -> dict[str, FlagStyle]:
    """One style per flag set for the whole run (every card uses the same mapping)."""
    n = len(order)
    spread = min(0.36, 0.09 * max(n - 1, 0))
    return {f: FlagStyle(COLORS[i % len(COLORS)], MARKERS[i % len(MARKERS)], DASHES[i % len(DASHES)],
                         max(1.0, 3.0 - 0.45 * i), (i / (n - 1) - 0.5) * spread if n > 1 else 0.0)
            for i, f in enumerate(order)}


def step_outcome(step: StepRecord) -> str | None:
    """served / broken / failed for a step that was sent; None for a skipped one."""
    if step.status == Status.SKIPPED:
        return None
    if step.status == Status.FAILED:
        return "failed"
    return "broken" if step.scores and step.scores.sanity.broken else "served"


def start_failure_label(failure: Failure) -> str:
    if failure.kind == FailureClass.OOM_AT_LOAD and failure.oom is not None and failure.oom.memory == "host":
        return "host-memory OOM at load"  # the kernel's OOM killer: host RAM, not the card's memory
    return {"oom_at_load": "OOM at load", "load_exit": "exited while loading", "ready_timeout": "never ready (timeout)",
            "refused": "refused by the scheduler"}.get(str(failure.kind), f"never ready ({failure.kind})")


def subplots(nrows: int = 1, ncols: int = 1, *, figsize: tuple[float, float], **kwargs: Any) -> tuple[Figure, Any]:
    """pyplot.subplots without pyplot: a figure and its axes (one, or an array)."""
    fig = Figure(figsize=figsize)
    return fig, fig.subplots(nrows, ncols, **kwargs)


def save(fig: Figure, out: Path, inputs: str | None = None) -> Path:
    """Written whole or not at all (a kill while the report is written leaves the previous plot). `inputs`: the
    digest of what it draws (runner.present.redraw), kept in the PNG itself."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight",
                metadata={KEY: inputs} if inputs is not None else None)
    atomic_write(out, buf.getvalue())
    return out


def _ref_ticks(ax: Axes, refs: Sequence[int]) -> None:
    ax.set_xticks(list(refs))
    if refs:
        ax.set_xlim(min(refs) - 0.5, max(refs) + 0.5)
    ax.set_xlabel("reference images")


def capacity_figure(card: str, cells: Sequence[Cell], order: Sequence[str], capacity_bytes: float,
                    styles: dict[str, FlagStyle], never_ready: dict[str, str]) -> Figure:
    """Peak device memory vs references, one line per flag set. `never_ready` maps a flag set whose server
    never became ready to why (e.g. "OOM at load"): drawn as stars on the capacity line."""
    refs = sorted({c.references for c in cells})
    top = max([c.peak_bytes or 0 for c in cells] + [capacity_bytes, 1])
    div, unit = unit_for(top)
    fig, ax = subplots(figsize=(7.8, 4.2))
    crossed = starred = False
    for flags in order:
        style = styles[flags]
        mine = sorted((c for c in cells if c.flags == flags), key=lambda c: c.references)
        label = flags
        if flags in never_ready:
            label = f"{flags}: {never_ready[flags]}"
            xs = [n + style.offset for n in (refs or [0])]
            ax.plot(xs, [capacity_bytes / div] * len(xs), mfc=style.color, **NEVER_READY, zorder=4)
            starred = True
        # A device OOM means the demand exceeded the capacity, whatever a sampled meter caught before the
        # failure: such a point is drawn at the capacity line, not at a reading that would look like a drop. A
        # host-memory OOM says nothing of the card's memory: drawn at what was measured, if anything.
        at_capacity = [c.blocker == "oom" and c.oom_memory != "host" for c in mine]
        pts = [(c.references + style.offset, max(c.peak_bytes or 0, capacity_bytes if cap else 0) / div, c.served)
               for c, cap in zip(mine, at_capacity, strict=True) if c.peak_bytes is not None or cap]
        if not pts and flags not in never_ready:
            label += " (no peak measured)"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=style.color, marker=style.marker, ls=style.dash,
                lw=style.width, ms=8, alpha=0.9, label=label)
        bad = [(x, y) for x, y, served in pts if not served]
        if bad:  # hollow in the flag set's colour with a black x: whose point it is stays visible
            ax.plot([b[0] for b in bad], [b[1] for b in bad], marker=style.marker, mfc="white", mec=style.color,
                    ms=8, mew=1.5, ls="none", zorder=4)
            ax.plot([b[0] for b in bad], [b[1] for b in bad], **NOT_SERVED, zorder=5)
            crossed = True
    ax.axhline(capacity_bytes / div, color="black", ls=":", lw=1)
    handles, labels = ax.get_legend_handles_labels()
    handles.append(Line2D([], [], color="black", ls=":", lw=1))
    labels.append(f"capacity {fmt_bytes(capacity_bytes)}")
    if crossed:
        handles.append(Line2D([], [], **NOT_SERVED))
        labels.append("not served (failed, broken or low PSNR): hollow + x; a device OOM is drawn at capacity")
    if starred:
        handles.append(Line2D([], [], mfc="white", **NEVER_READY))
        labels.append("server never ready: no request sent (drawn at capacity)")
    ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    _ref_ticks(ax, refs)
    ax.margins(y=0.08)
    ax.set_ylabel(f"peak device memory ({unit})")
    ax.set_title(f"{card}: peak device memory per request vs references", fontsize=10)
    ax.grid(alpha=0.25)
    return fig


def latency_figure(card: str, steps: Sequence[StepRecord], cells: Sequence[Cell], order: Sequence[str],
                   styles: dict[str, FlagStyle]) -> Figure | None:
    """Seconds per request vs references, one line per flag set: the median of every timed send of the steps
    that returned an image (as the tables and the verdict), with a min–max bar wherever there was more than one
    send."""
    served = {(c.flags, c.references): c.served for c in cells}
    times: dict[tuple[str, int], list[float]] = {}
    for s in steps:
        if s.status == Status.OK:
            sends = list(s.wall_samples_s) or ([s.wall_s] if s.wall_s is not None else [])
            times.setdefault((s.flags, s.references), []).extend(sends)
    if not times:
        return None
    fig, ax = subplots(figsize=(7.8, 4.2))
    crossed = False
    repeats = max(len(s.wall_samples_s) for s in steps)
    for flags in order:
        style = styles[flags]
        pts = sorted((n, v) for (f, n), v in times.items() if f == flags and v)
        if not pts:
            ax.plot([], [], color=style.color, marker=style.marker, label=f"{flags} (no image returned)")
            continue
        xs = [n + style.offset for n, _ in pts]
        ys = [statistics.median(v) for _, v in pts]
        err = [[y - min(v) for y, (_, v) in zip(ys, pts, strict=True)],
               [max(v) - y for y, (_, v) in zip(ys, pts, strict=True)]]
        ax.errorbar(xs, ys, yerr=err, color=style.color, marker=style.marker, ls=style.dash, lw=style.width, ms=8,
                    capsize=3, alpha=0.9, label=flags)
        bad = [(x, y) for x, y, (n, _) in zip(xs, ys, pts, strict=True) if not served.get((flags, n), True)]
        if bad:
            ax.plot([b[0] for b in bad], [b[1] for b in bad], marker=style.marker, mfc="white", mec=style.color,
                    ms=8, mew=1.5, ls="none", zorder=4)
            ax.plot([b[0] for b in bad], [b[1] for b in bad], **NOT_SERVED, zorder=5)
            crossed = True
    handles, labels = ax.get_legend_handles_labels()
    if crossed:
        handles.append(Line2D([], [], **NOT_SERVED))
        labels.append("image returned but not served (broken or low PSNR)")
    ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    _ref_ticks(ax, sorted({c.references for c in cells}))
    ax.set_ylim(bottom=0)
    ax.set_ylabel("seconds per request")
    over = "seeds × repeats" if repeats > 1 else "seeds"
    ax.set_title(f"{card}: latency vs references (median; bar: min–max over all sends, {over})", fontsize=10)
    ax.grid(alpha=0.25)
    return fig


def step_span(step: StepRecord) -> float:
    """Seconds a step's window lasted: every timed send of the request back to back (its peaks cover them all;
    the gaps between sends are only the client's turnaround), else the first send."""
    return sum(step.wall_samples_s) if len(step.wall_samples_s) > 1 else (step.wall_s or 0.0)


def _shaded(sent: Sequence[StepRecord], t0: float) -> list[tuple[StepRecord, float]]:
    """Each sent step with the end of its shading: its own window, closed up to the next step's start when
    that step has the same reference count (the client's turnaround between two requests is not a boundary
    worth a white gap; a change of count is, and gets the separator)."""
    out = []
    for s, nxt in zip(sent, [*sent[1:], None], strict=False):  # the last step has no next one
        end = (s.started_at or t0) - t0 + step_span(s)
        if nxt is not None and nxt.references == s.references and nxt.started_at is not None:
            end = max(end, nxt.started_at - t0)
        out.append((s, end))
    return out


def _ref_groups(steps: Sequence[StepRecord], t0: float) -> list[tuple[float, float, int]]:
    """Consecutive sent steps with the same reference count: one label per group keeps labels readable."""
    groups: list[list[float]] = []
    last = None
    for s in steps:
        if s.started_at is None:
            continue
        x0, x1 = s.started_at - t0, s.started_at - t0 + step_span(s)
        if last == s.references:
            groups[-1][1] = x1
        else:
            groups.append([x0, x1, s.references])
        last = s.references
    return [(g[0], g[1], int(g[2])) for g in groups]


def session_figure(session: SessionRecord, steps: Sequence[StepRecord],
                   rows: Sequence[tuple[float, int, str, str, int]], capacity_bytes: float) -> Figure | None:
    """Device memory (capacity, request windows shaded by outcome, the peak each table quotes) above host RAM,
    one time axis. Series are drawn as steps: a sample holds until the next one, nothing between is invented."""
    failure = session.start_failure
    if not rows and failure is None:
        return None
    sent = sorted((s for s in steps if s.started_at is not None), key=lambda s: s.started_at or 0)
    starts = [st.started_at for st in session.starts]
    t0 = min([r[0] for r in rows] + starts)
    fig, (dev, host) = subplots(2, 1, figsize=(10, 5.6), sharex=True, height_ratios=(3, 1.4))
    tops = {"device": max([r[4] for r in rows if r[3] == "device"] + [capacity_bytes, 1]),
            "host": max([r[4] for r in rows if r[3] == "host"] + [1])}
    quoted = [(s, p) for s in sent if (p := s.peak("device")) and p.bytes is not None]
    tops["device"] = max([tops["device"]] + [p.bytes for _, p in quoted if p.bytes])
    scale = {m: unit_for(v) for m, v in tops.items()}
    for ax, metric in ((dev, "device"), (host, "host")):
        div = scale[metric][0]
        for source in sorted({r[2] for r in rows if r[3] == metric}):
            pts = [(r[0] - t0, r[4] / div) for r in rows if r[2] == source and r[3] == metric]
            ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", lw=1,
                    marker="." if len(pts) < 50 else None, ms=3, label=f"{source} (sampled)")
        ax.set_ylim(0, tops[metric] / div * 1.1)
        ax.set_ylabel(f"{metric} ({scale[metric][1]})")
    ddiv = scale["device"][0]
    if capacity_bytes:
        dev.axhline(capacity_bytes / ddiv, color="black", ls=":", lw=1, label=f"capacity {fmt_bytes(capacity_bytes)}")
    sources = sorted({p.source for _, p in quoted})
    for i, (s, p) in enumerate(quoted):
        x = (s.started_at or t0) - t0
        dev.hlines(p.bytes / ddiv, x, x + step_span(s), color="black", lw=2.2, zorder=4,  # type: ignore[operator]
                   label=f"request peak quoted in the tables ({', '.join(sources)})" if i == 0 else None)
    outcomes_seen = set()
    for s, end in _shaded(sent, t0):
        outcome = step_outcome(s)
        if outcome is None:
            continue
        outcomes_seen.add(outcome)
        x = (s.started_at or t0) - t0
        for ax in (dev, host):
            span = ax.axvspan(x, end, facecolor=OUTCOME_COLORS[outcome],
                              edgecolor=OUTCOME_COLORS[outcome], alpha=0.25, lw=0, hatch=OUTCOME_HATCH[outcome])
            span.set_gid(f"step|{s.key}|{outcome}")
    groups = _ref_groups(sent, t0)
    for (_, _, before), (x0, _, after) in itertools.pairwise(groups):
        for ax in (dev, host):  # the only white lines: where the reference count changes
            ax.axvline(x0, color="white", lw=2.0, zorder=3).set_gid(f"refs|{before}->{after}")
    first = next((s for s in sent if s.deterministic is not None), None)
    if first is not None and len(first.wall_samples_s) <= 1:  # then its untimed re-send follows, unshaded
        x = (first.started_at or t0) - t0 + (first.wall_s or 0)
        dev.annotate("determinism\nrepeat", (x, 0.9), xycoords=("data", "axes fraction"), fontsize=6.5,
                     color="dimgrey", ha="left", va="top")
    for x0, x1, n in _ref_groups(sent, t0):
        dev.annotate(refs_text(n), ((x0 + x1) / 2, 1.01), xycoords=("data", "axes fraction"),
                     fontsize=8, ha="center", va="bottom")
    notes = []
    for st in session.starts:
        x_start = st.started_at - t0
        ready = x_start + st.ready_s if st.ready_s is not None else ((st.stopped_at or t0) - t0)
        for ax in (dev, host):
            ax.axvline(x_start, color="grey", lw=0.8, ls="--")
            ax.axvspan(x_start, ready, facecolor="grey", alpha=0.08, lw=0).set_gid(f"load|{st.attempt}")
        first_at = min((r[0] for r in rows if r[3] == "device" and r[0] >= st.started_at), default=None)
        if first_at is None or first_at - st.started_at > 0.5 * (ready - x_start):  # most of the load unseen
            why = "; ".join(load_reading(p) for p in st.load_peaks if p.metric == "device") or "no device meter"
            if first_at is not None and first_at - t0 <= ready:
                why = f"first reading at {fmt_s(first_at - t0)} s, at readiness; " + why
            notes.append(f"no device reading while loading (start {st.attempt}) — {why}")
        if st.failure is not None and st.ready_s is None:
            for ax in (dev, host):
                ax.axvline(ready, color="tab:red", lw=1.5).set_gid(f"never-ready|{st.attempt}")
            evidence = clip(strip_log_prefix(st.failure.evidence[0]), 150) if st.failure.evidence else ""
            notes.append(f"server never ready: {start_failure_label(st.failure)}, stopped at {fmt_s(ready)} s"
                         + (f" — {evidence}" if evidence else ""))
    if notes:  # under the time axis, never on the data it explains
        host.annotate("\n".join(_wrap(n, 150) for n in notes), (0, 0), xycoords="axes fraction",
                      xytext=(0, -40), textcoords="offset points", fontsize=7.5, va="top", ha="left",
                      bbox={"facecolor": "white", "edgecolor": "grey", "alpha": 0.9}).set_gid("notes")
    handles, labels = dev.get_legend_handles_labels()
    handles.append(Line2D([], [], color="grey", ls="--", lw=0.8))
    labels.append("server (re)start; grey: loading")
    if failure is not None:
        handles.append(Line2D([], [], color="tab:red", lw=1.5))
        labels.append("server stopped, never ready")
    for outcome in ("served", "broken", "failed"):
        if outcome in outcomes_seen:
            handles.append(Patch(facecolor=OUTCOME_COLORS[outcome], edgecolor=OUTCOME_COLORS[outcome], alpha=0.3,
                                 hatch=OUTCOME_HATCH[outcome]))
            labels.append({"served": "request served", "broken": "image returned, broken output",
                           "failed": "request failed"}[outcome])
    dev.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    hh, hl = host.get_legend_handles_labels()
    if hh:
        host.legend(hh, hl, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    host.set_xlabel("seconds since the server started")
    state = f" — {start_failure_label(failure)}" if failure else ""
    dev.set_title(f"{session.key}: memory{state}", pad=16)
    return fig


def load_reading(peak: Peak) -> str:
    """What a device source saw of a load, as the session table's load-peak column says it: a figure where
    there is one (the `server` gauge's only reading comes at readiness), else why there is none."""
    if peak.available and peak.bytes is not None:
        when = ": no reading before its port opens; at readiness" if _after_ready(peak.source) else ""
        return f"{peak.source}{when} {fmt_bytes(peak.bytes)}"
    return f"{peak.source} {short_reason(peak.source, peak.reason)}"


def _after_ready(source: str) -> bool:
    return source in METERS and METERS.get(source).after_ready


def short_reason(source: str, reason: str | None) -> str:
    if _after_ready(source):
        return "has no reading before its port opens, i.e. until load is over"
    return "had no reading: " + clip(reason or "unavailable", 80)


_LOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d[ T][\d:,.]+\s+\w+\s+[\w.-]+:\s*")


def strip_log_prefix(line: str) -> str:
    return _LOG_PREFIX.sub("", line)


def _wrap(text: str, width: int) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width)) or text


HELD_SHOWN = 4  # request-time sites drawn apart; the rest of the request is one segment


def held_figure(card: str, held: Sequence[tuple[str, HeldMemory]], capacity_bytes: float) -> Figure | None:
    """What held the memory at each flag set's OOM (allocator snapshot): one stacked bar per flag set —
    resident before the request, the request's largest sites, the rest of the request, inactive bytes in
    segments (fragmentation), what the process held outside PyTorch's allocator (the CUDA context; from the OOM
    message), the failed allocation on top (hatched) — against the card's capacity line. Where the resident
    set is most of every bar (a real model's weights: 21.6 of 24 GiB), a second panel shows the bars' tops
    zoomed, so the request's sites can be read."""
    if not held:
        return None
    tops = [h.reserved_bytes + (h.outside_pytorch_bytes or 0) + (h.tried_bytes or 0) for _, h in held]
    ceiling = max([*tops, capacity_bytes, 1])
    div, unit = unit_for(ceiling)
    floor = zoom_floor(held, ceiling)
    width = max(5.5, 2.0 + 1.9 * len(held))
    if floor is None:
        fig, ax = subplots(figsize=(width, 4.6))
        axes = [(ax, 0.0, ceiling)]
    else:
        fig, (ax, zoom) = subplots(1, 2, figsize=(2 * width - 1.5, 4.6))
        axes = [(ax, 0.0, ceiling), (zoom, floor, ceiling)]
    colours = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#ccb974", "#64b5cd",
               "#1b9e77", "#e7298a", "#66a61e"]
    colour: dict[str, str] = {}  # one colour per site across the card's bars: a legend entry means one site
    for _, h in held:
        for s in _shown_sites(h):
            colour.setdefault(_site_name(s), colours[len(colour) % len(colours)])
    legend: dict[str, Patch] = {}
    for a, lo, hi in axes:
        _held_bars(a, held, div, lo, hi, colour, legend)
        a.axhline(capacity_bytes / div, color="black", ls=":", lw=1)
        a.set_xticks(range(len(held)))
        a.set_xticklabels([f"{f}\n{refs_text(h.references)} {h.at}"
                           for f, h in held], fontsize=8)
        a.set_xlim(-0.6, len(held) - 0.4)
        a.grid(alpha=0.25, axis="y")
    ax.set_ylabel(f"device memory at the OOM ({unit})")
    title = f"{card}: what held the memory at each OOM (allocator snapshot)"
    if floor is None:
        ax.set_title(title, fontsize=10)
    else:
        fig.suptitle(title, fontsize=10)
        ax.set_title("the whole card", fontsize=9)
        zoom = axes[1][0]
        zoom.set_ylim(floor / div, ceiling * 1.04 / div - floor * 0.04 / div)
        zoom.set_title(f"the top of the same bars, from {fmt_bytes(floor)} up", fontsize=9)
    legend[f"capacity {fmt_bytes(capacity_bytes)}"] = Line2D([], [], color="black", ls=":", lw=1)  # type: ignore[assignment]
    parts = ("resident", "held", "request: ", "request: every other site", "inactive", "outside", "the allocation",
             "capacity")

    def rank(label: str) -> int:  # the legend in the bars' order, bottom to top (sites in first-seen order)
        return 3 if label == parts[3] else next((i for i, p in enumerate(parts) if label.startswith(p)), len(parts))

    names = sorted(legend, key=rank)
    axes[-1][0].legend([legend[k] for k in names], names, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                       borderaxespad=0)
    return fig


ZOOM_WHEN_RESIDENT_ABOVE = 0.6  # of the chart's height: below it the request's part is already readable


def zoom_floor(held: Sequence[tuple[str, HeldMemory]], ceiling: float) -> float | None:
    """Where a zoomed panel starts: a little under the smallest resident set, when every bar's resident set is
    most of the chart; else None (one panel says it all)."""
    bases = [h.resident_bytes if h.resident_bytes is not None and h.request_bytes is not None else h.active_bytes
             for _, h in held]
    base = min(bases)
    if base < ZOOM_WHEN_RESIDENT_ABOVE * ceiling:
        return None
    return max(0.0, base - 0.1 * (ceiling - base))


def _shown_sites(h: HeldMemory) -> list[HeldSite]:
    """The request's largest sites, drawn apart (the rest of the request is one segment)."""
    return [s for s in h.by_site if s.phase == "request" and s.site != "other sites"][:HELD_SHOWN]


def _site_name(s: HeldSite) -> str:
    """A part the server named (weights onloaded for the request, its conditioning cache) says so first. A
    snapshot's text: its `$` escaped, or matplotlib reads `$…$` as mathtext (a malformed one fails the plot)."""
    where = f"{s.site} in {s.function}" if s.function else s.site
    return (f"{s.part}: {where}" if s.part else where).replace("$", r"\$")


def _held_bars(ax: Axes, held: Sequence[tuple[str, HeldMemory]], div: float, lo: float, hi: float,
               colour: dict[str, str], legend: dict[str, Patch]) -> None:
    """The stacked bars on one panel whose visible range is lo..hi bytes (a part's size is written beside it
    where it is at least 2 % of that range)."""

    def put(x: int, bottom: float, value: float, color: str, label: str, hatch: str | None = None) -> float:
        if value <= 0:
            return bottom
        ax.bar(x, value / div, bottom=bottom / div, width=0.55, color=color, edgecolor="black", lw=0.5, hatch=hatch)
        legend.setdefault(label, Patch(facecolor=color, edgecolor="black", hatch=hatch, label=label))
        return bottom + value

    for x, (_flags, h) in enumerate(held):
        y = 0.0
        if h.resident_bytes is not None and h.request_bytes is not None:
            y = put(x, y, h.resident_bytes, "#9aa5b1", "resident before the request (weights, caches)")
            shown = _shown_sites(h)
            for s in shown:
                key = _site_name(s)
                mid = y + s.bytes / 2
                y = put(x, y, s.bytes, colour[key], f"request: {clip(key, 70)}")
                if s.bytes > 0.02 * (hi - lo) and lo <= mid <= hi:
                    ax.text(x + 0.3, mid / div, fmt_bytes(s.bytes), fontsize=6, va="center")
            y = put(x, y, h.request_bytes - sum(s.bytes for s in shown), "#d9d9d9", "request: every other site")
        else:
            y = put(x, y, h.active_bytes, "#9aa5b1", "held (resident / request not told apart)")
        y = put(x, y, h.inactive_bytes or 0, "white", "inactive in segments (fragmentation)", hatch="..")
        if h.outside_pytorch_bytes:  # what the capacity holds that no snapshot sees
            y = put(x, y, h.outside_pytorch_bytes, "#eeeeee", "outside PyTorch's allocator (CUDA context, libraries)",
                    hatch="xx")
        if h.at == "oom" and h.tried_bytes:
            put(x, y, h.tried_bytes, "#ffffff00", "the allocation that failed", hatch="///")
        ax.text(x, (y + (h.tried_bytes or 0)) / div, f"{fmt_bytes(h.active_bytes)} held", ha="center",
                va="bottom", fontsize=7)


def soak_figure(card: str, soaks: Mapping[str, Sequence[SoakRequest]], capacity_bytes: float,
                styles: dict[str, FlagStyle], planned: int) -> Figure | None:
    """A card's soak over its requests: the level after each request, each request's peak and its latency, one
    line per soaked flag set (its style as on every plot), the capacity drawn on both memory panels. A failure is
    a black x at its request (a device OOM at the capacity line: the demand exceeded it, whatever was read); a
    new server start (a resume) is a grey dashed line."""
    if not any(soaks.values()):
        return None
    tops = [capacity_bytes, 1.0] + [float(b) for rs in soaks.values() for r in rs
                                    for b in (_figure(r.peak), _figure(r.floor_after)) if b is not None]
    div, unit = unit_for(max(tops))
    fig, (floor_ax, peak_ax, lat_ax) = subplots(3, 1, figsize=(9.5, 7.6), sharex=True, height_ratios=(1, 1, 0.8))
    failed = False
    for flags, requests in soaks.items():
        style = styles[flags]
        served = [r for r in requests if r.status == Status.OK]
        line = {"color": style.color, "ls": style.dash, "lw": min(style.width, 1.6),
                "marker": style.marker if len(served) <= 60 else None, "ms": 3.5}
        for ax, read in ((floor_ax, _level_after), (peak_ax, _request_peak)):
            pts = [(r.number, b / div) for r in served if (b := _figure(read(r))) is not None]
            source = next((x.source for r in served if (x := read(r)) is not None and x.available), None)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"{flags} ({source or 'no device figure'})",
                    **line)
        lat_ax.plot([r.number for r in served], [r.wall_s for r in served], label=flags, **line)
        failed = _soak_failures(flags, requests, (floor_ax, peak_ax, lat_ax), capacity_bytes / div, div) or failed
        for before, after in itertools.pairwise(requests):
            if after.attempt != before.attempt:
                for ax in (floor_ax, peak_ax, lat_ax):
                    mark = ax.axvline(after.number - 0.5, color="grey", ls="--", lw=0.8)
                    mark.set_gid(f"restart|{flags}|{after.number}")
    for ax, title in ((floor_ax, f"level after each request ({unit})"), (peak_ax, f"request peak ({unit})")):
        ax.axhline(capacity_bytes / div, color="black", ls=":", lw=1)
        ax.set_ylim(0, max(tops) / div * 1.08)
        ax.set_ylabel(title, fontsize=8)
        ax.grid(alpha=0.25)
    lat_ax.set_ylim(bottom=0)
    lat_ax.set_ylabel("seconds per request", fontsize=8)
    lat_ax.grid(alpha=0.25)
    lat_ax.set_xlabel(f"soak request (of {planned} asked)")
    lat_ax.set_xlim(0.5, max([planned] + [r.number for rs in soaks.values() for r in rs]) + 0.5)
    handles, labels = floor_ax.get_legend_handles_labels()
    handles.append(Line2D([], [], color="black", ls=":", lw=1))
    labels.append(f"capacity {fmt_bytes(capacity_bytes)}")
    if failed:
        handles.append(Line2D([], [], **NOT_SERVED))
        labels.append("the request that failed (a device OOM at the capacity)")
    floor_ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    peak_ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    floor_ax.set_title(f"{card}: the soak — level after each request, request peak and latency, per soaked flag set",
                       fontsize=10)
    return fig


def _figure(reading: Peak | Level | None) -> int | None:
    return reading.bytes if reading is not None and reading.available else None


def _level_after(r: SoakRequest) -> Level | None:
    return r.floor_after


def _request_peak(r: SoakRequest) -> Peak | None:
    return r.peak


def _soak_failures(flags: str, requests: Sequence[SoakRequest], axes: tuple[Axes, Axes, Axes], capacity: float,
                   div: float) -> bool:
    """A soak's failed request as a black x on each panel (a device OOM at the capacity line); whether it had one."""
    floor_ax, peak_ax, lat_ax = axes
    failed = [r for r in requests if r.status == Status.FAILED]
    for r in failed:
        oom = r.failure is not None and r.failure.kind == FailureClass.OOM and \
            (r.failure.oom is None or r.failure.oom.memory == "device")
        y = capacity if oom else (_figure(r.peak) or 0) / div
        for ax in (floor_ax, peak_ax):
            (mark,) = ax.plot([r.number], [y], zorder=5, **NOT_SERVED)
            mark.set_gid(f"failed|{flags}|{r.number}")
        lat_ax.plot([r.number], [r.wall_s], zorder=5, **NOT_SERVED)
        peak_ax.annotate(f"{flags}: {r.failure.kind if r.failure else 'failed'} at request {r.number}", (r.number, y),
                         xytext=(8, -12), textcoords="offset points", ha="left", fontsize=7)
    return bool(failed)
