"""report.md + plots from a run directory. Reads records only: rerunnable any time.
The plots themselves are drawn in runner/present/plots.py; this module decides what goes where and writes the text."""

from __future__ import annotations

import re
import statistics
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.core.records import Failure, SessionRecord, Status, StepRecord
from runner.core.registry import METERS
from runner.core.units import GIB, clip, fmt_bytes, fmt_s, refs_text
from runner.judge.decision import Cell, StopEvidence, Verdict
from runner.judge.findings.models import HeldMemory
from runner.judge.reconcile import reconcile, render
from runner.judge.soak_text import soak_lines
from runner.judge.verdict import IdenticalPair, identical_pairs
from runner.judge.verdict_text import findings_lines, summary
from runner.observe import quote
from runner.observe.failures import without_stamp
from runner.observe.server_file import NotRead
from runner.present import plots, redraw
from runner.run.store import RunStore, StoreError, atomic_write, inside, read_memory

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TERMS = [
    "**request peak** — one request's device-memory peak, from the first available source in the card's meter "
    "order (a `peak_memory_mb` in the response counts as source `server-response`). A cell's figure is the "
    "highest request peak over its steps (fixtures × seeds).",
    "**session peak** — the highest sample of each sampled source over the whole session, load included. It can "
    "read *below* the cells' figure (a sampled source misses spikes shorter than its interval, which "
    "`server-response` catches) or *above* it (it includes loading and the time between requests).",
    "**load peak** — the highest device reading from server start to ready. A source that cannot answer "
    "during load (the `server` gauge: the port opens only after load) has at most the reading at readiness; "
    "when no device source could read during load the column says so instead of a figure.",
]


def _story(b: StopEvidence) -> str:
    """A flag set's stop from verdict.json: what stopped it, the deciding record, the server's own line."""
    says = "".join(f" — server: {quote.code(clip(without_stamp(line), 200))}" for line in b.server_says
                   if without_stamp(line) not in b.why)  # the why quotes it already (an HTTP error's body message)
    stop = "serves it, but nothing measured its memory" if b.cause == "unmetered" else {
        "capacity": "stopped by capacity", "quality": "stopped by quality", "latency": "stopped by latency",
        "served": "serves it"}.get(b.stop, "stopped by neither memory nor quality")
    return f"**{stop}** — {quote.markdown(b.why)}" + (f" ({quote.code(b.record)})" if b.record else "") + says


def _plot_path(out: Path, name: str) -> Path:
    """plots/<name> with the name made a plain file name: card and flag names come from the records, and a
    crafted record (card = "../../elsewhere") must not make the report write outside the run folder."""
    return inside(out, re.sub(r"[^A-Za-z0-9_.-]+", "-", name).lstrip("."))


def _ssim(steps: Sequence[StepRecord]) -> dict[tuple[str, int], float]:
    vals: dict[tuple[str, int], list[float]] = {}
    for s in steps:
        if s.status == Status.OK and s.scores and s.scores.ssim is not None:
            vals.setdefault((s.flags, s.references), []).append(s.scores.ssim)
    return {k: statistics.fmean(v) for k, v in vals.items()}


def _psnr(db: float | None) -> str:
    return "" if db is None else f", {db:.1f} dB"


def _figure(peak_bytes: int | None) -> str:
    """A cell's device peak, or that it has none (the response said 0.0, no meter read the device)."""
    return fmt_bytes(peak_bytes) if peak_bytes is not None else "no device figure"


def _cell_text(cell: Cell | None, ssim: float | None) -> str:
    if cell is None:
        return "·"
    quality = _psnr(cell.psnr_db) + (f", SSIM {ssim:.3f}" if ssim is not None else "")
    if cell.served:
        spread = (f" [{fmt_s(cell.wall_min_s)}–{fmt_s(cell.wall_max_s)}]" if cell.wall_samples > 1 else "")
        return (f"✅ {_figure(cell.peak_bytes)}, {fmt_s(cell.wall_s)} s{spread}"
                + (", baseline" if cell.baseline else quality))
    why = (cell.why_not or "").split(": ", 1)[-1]
    if cell.blocker == "skipped":
        return "⏭ " + quote.markdown(clip(why.removeprefix("skipped: "), 80))
    if cell.blocker == "oom":
        return "❌ OOM" + (f" (peak seen {fmt_bytes(cell.peak_bytes)})" if cell.peak_bytes is not None else "")
    if cell.blocker in ("broken", "low-psnr"):
        seen = f" ({fmt_bytes(cell.peak_bytes)}, {fmt_s(cell.wall_s)} s{quality})" if cell.peak_bytes else ""
        return "⚠️ " + quote.markdown(clip(why, 80)) + seen
    return "❌ " + quote.markdown(clip(why, 80))


def _load_peak(session: SessionRecord) -> str:
    """The first start's device reading(s) from start to ready, or why there is none — never a bare dash."""
    first = session.starts[0] if session.starts else None
    if first is None:
        return "n/a: not started"
    device = [p for p in first.load_peaks if p.metric == "device"]
    if not device:
        return "n/a: no device meter"
    shown = []
    for p in device:
        if p.available and p.bytes is not None:
            at_ready = " at readiness" if p.source in METERS and METERS.get(p.source).after_ready else ""
            shown.append(f"{fmt_bytes(p.bytes)} ({p.source}{at_ready})")
        else:
            shown.append(f"n/a: {p.source} {quote.markdown(plots.short_reason(p.source, p.reason))}")
    return "; ".join(shown)


def _ready(session: SessionRecord) -> str:
    first = session.starts[0] if session.starts else None
    if first is None:
        return "not started"
    if first.ready_s is not None:
        return fmt_s(first.ready_s)
    return f"never ({first.failure.kind})" if first.failure else "never"


def _start_failure(fail: Failure) -> str:
    """The failure class in words and the server's own line that decided it (not the class restated)."""
    line = clip(plots.strip_log_prefix(fail.evidence[0]), 160) if fail.evidence else fail.message
    return f"{plots.start_failure_label(fail)} — {quote.markdown(line)}"


def _session_rows(card_sessions: list[SessionRecord], steps: list[StepRecord], cells: Sequence[Cell]) -> list[str]:
    rows = ["| session | role | starts | ready s | load peak | highest request peak | session peaks by sampled source "
            "| deterministic | failure / notes |", "|---|---|---|---|---|---|---|---|---|"]
    for s in card_sessions:
        peaks = ", ".join(f"{p.source}/{p.metric} {fmt_bytes(p.bytes)} ({p.samples} samples)" if p.available
                          else f"{p.source}/{p.metric} n/a: {quote.markdown(clip(p.reason or '', 90))}"
                          for p in s.session_peaks) or "none"
        mine = [c for c in cells if c.flags == s.flags and c.peak_bytes is not None]
        top = max(mine, key=lambda c: c.peak_bytes or 0, default=None)
        request = f"{fmt_bytes(top.peak_bytes)} ({top.peak_source}, {refs_text(top.references)})" if top else "none"
        check = next((st for st in steps if st.flags == s.flags and st.deterministic is not None), None)
        det = ("–" if check is None else "yes" if check.deterministic else "**no**" + (
            f" (repeat PSNR {check.repeat_psnr_db:.1f} dB)" if check.repeat_psnr_db is not None else ""))
        fail = s.start_failure
        what = (_start_failure(fail) if fail else quote.markdown("; ".join(s.notes))) or "–"
        rows.append(f"| {s.flags} | {s.role} | {len(s.starts)} | {_ready(s)} | {_load_peak(s)} | {request} | "
                    f"{peaks} | {det} | {what.replace('|', '/')} |")
    return rows


def identical_groups(pairs: Sequence[IdenticalPair]) -> list[tuple[list[str], list[IdenticalPair]]]:
    """Flag sets whose images were byte-identical, grouped: a group is reported as one line only when every
    pair in it is identical (otherwise its pairs stay separate lines)."""
    linked: dict[str, set[str]] = {}
    for p in pairs:
        linked.setdefault(p.a, set()).add(p.b)
        linked.setdefault(p.b, set()).add(p.a)
    groups, seen = [], set()
    for start in sorted(linked):
        if start in seen:
            continue
        comp, todo = set(), [start]
        while todo:
            f = todo.pop()
            if f not in comp:
                comp.add(f)
                todo.extend(linked[f] - comp)
        seen |= comp
        mine = [p for p in pairs if p.a in comp]
        n = len(comp)
        if len(mine) == n * (n - 1) // 2:
            groups.append((sorted(comp), mine))
        else:
            groups += [([p.a, p.b], [p]) for p in mine]
    return groups


def _group_line(names: list[str], pairs: list[IdenticalPair]) -> str:
    steps = sorted({p.steps for p in pairs})
    shared = f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}–{steps[-1]}"
    kinds = {p.memory for p in pairs}
    on = pairs[0].compared_on() if len(pairs) == 1 else "" if all(p.compared == p.steps for p in pairs) else \
        " (where both sides have a device figure)"
    memory = ("and no device-memory figure compares them: whether the flags reached memory was not measured"
              if kinds == {"unmeasured"} else
              f"with the same memory peaks{on}: the flags reached nothing measured (inert flag?)" if kinds == {"same"}
              else f"with different memory peaks{on}: the flags changed memory, not the output"
              if kinds == {"different"} else
              "memory peaks " + ", ".join(w for k, w in (("same", "the same for some pairs"),
                                                        ("different", "different for some"),
                                                        ("unmeasured", "not measured for others")) if k in kinds))
    return f"byte-identical images from {' = '.join(repr(n) for n in names)} on every step they share " \
           f"({shared} shared steps per pair), {memory}"


def _refserver_arch(run: dict[str, Any], sessions: Sequence[SessionRecord]) -> str | None:
    """Which denoiser our reference server ran ("dit" or "qwen-image"), when a server command or image names
    the reference server or a start ran it; None when the target is another server."""
    try:
        servers = tomllib.loads(run["matrix"]["text"]).get("servers", {})
    except (KeyError, tomllib.TOMLDecodeError):
        servers = {}
    commands = [[str(a) for a in s.get("command", [])] + [str(s.get("image") or "")]
                for s in servers.values() if isinstance(s, dict)]
    commands = [c for c in commands if "refserver" in " ".join(c)]
    commands += [[str(a) for a in st.info.get("argv", [])] for s in sessions for st in s.starts
                 if "runner.refserver" in " ".join(map(str, st.info.get("argv", [])))]
    if not commands:
        return None
    qwen = any(c[i:i + 2] == ["--arch", "qwen-image"] or a == "--arch=qwen-image"
               for c in commands for i, a in enumerate(c))
    return "qwen-image" if qwen else "dit"


REFSERVER_BANNERS = {
    "dit": "> **Target: the reference server** (`runner refserver`), a small stand-in diffusion transformer, "
           "not vLLM-Omni or Qwen-Image. Its messages imitate vLLM-Omni's (\"CUDA out of memory … GPU 0\") "
           "even on a CPU, where the \"GPU\" is the accounted budget set by `--vram-gib`; its figures test "
           "the runner and say nothing about a real model's memory or speed.",
    "qwen-image": "> **Target: the reference server** (`runner refserver --arch qwen-image`): the real Qwen-Image "
                  "transformer architecture (diffusers' `QwenImageTransformer2DModel`) with random weights, "
                  "behind vLLM-Omni's API — not vLLM-Omni, and not the trained model. No text encoder and no "
                  "trained VAE (fixed random stand-ins in host memory), so the images mean nothing and PSNR is "
                  "against the baseline run of the same weights; memory and OOM sites are the architecture's. On "
                  "a CPU the \"GPU\" is the budget set by `--vram-gib`, counted from the model's own tensors.",
}


def _step_counts(steps: Sequence[StepRecord]) -> str:
    outcomes = [plots.step_outcome(s) for s in steps]
    served, broken, failed = (outcomes.count(o) for o in ("served", "broken", "failed"))
    skipped = outcomes.count(None)
    return (f"Steps: {len(steps)} — {served} ok (image passes the sanity checks), {broken} broken output "
            f"(image returned but unusable), {failed} failed, {skipped} skipped (not sent).")


def write_report(store: RunStore, verdicts: list[Verdict], cost: Sequence[str] = ()) -> Path:
    """report.md; `cost`: its closing section (runner.present.cost.cost_lines), when the caller has the rules."""
    run = store.load_run()
    steps, sessions = store.load_steps(), store.load_sessions()
    planned = {key: i for i, key in enumerate(run.get("plan", {}).get("sessions", []))}
    sessions.sort(key=lambda s: planned.get(s.key, len(planned)))
    out = store.root / "plots"
    try:
        out.mkdir(exist_ok=True)
    except OSError as exc:  # a file named plots where the folder goes, a read-only folder
        raise StoreError(f"{out}: cannot hold the plots ({exc.strerror or exc})") from None
    cards: dict[str, Any] = run.get("cards", {})
    all_flags = list(dict.fromkeys([s.flags for s in sessions] + [c.flags for v in verdicts for c in v.cells]))
    styles = plots.flag_styles(all_flags)
    lines = [f"# Run {run['run_id']}", "",
             f"Matrix `{run['matrix']['path']}` (sha256 `{run['matrix']['sha256'][:12]}`), runner "
             f"{run['runner']['version']}, started {run.get('started_at_iso', '?')}, "
             f"finished {run.get('finished_at_iso', 'not finished')}"
             f"{' (interrupted)' if run.get('interrupted') else ''}. {_step_counts(steps)}", ""]
    if (arch := _refserver_arch(run, sessions)) is not None:
        lines += [REFSERVER_BANNERS[arch], ""]
    lines += ["| card | verdict | deciding flag set | why (each card's section has the evidence) |",
              "|---|---|---|---|"]
    for v in verdicts:  # the same words as the console line (verdict_text.summary)
        lines.append(f"| {quote.markdown(v.card)} | **{v.world}** | {quote.markdown(v.flags or '–')} | "
                     f"{quote.markdown(summary(v))} |")
    for v in verdicts:
        lines += _card_section(store, v, cards, sessions, steps, styles, out)
    lines += ["## Terms and memory sources", "", *[f"- {t}" for t in TERMS], "",
              "| source | what it reads | in this run |", "|---|---|---|"]
    peaks = [p for s in steps for p in s.peaks] + [p for s in sessions for p in s.session_peaks]
    read = {p.source for p in peaks if p.available}
    tried = {p.source for p in peaks} - read
    for name, what in ((e.name, e.glossary) for e in METERS.entries()):
        state = "yes" if name in read else "configured, never available" if name in tried else "–"
        lines.append(f"| `{name}` | {what} | {state} |")
    lines += ["", "docs/meters.md has each source's rate, what it catches and what it misses.", ""]
    lines += cost
    path = store.root / "report.md"
    atomic_write(path, ("\n".join(lines) + "\n").encode())  # whole or the previous one, never half
    return path


def _drawn(image: Path, figure: Callable[..., Figure | None], *inputs: Any) -> bool:
    """Whether `image` shows figure(*inputs): kept when the plot on disk was drawn from the same inputs (its
    digest, runner.present.redraw), else drawn now; False when the figure has nothing to draw. A resume that
    sent one step of a 100-session run redraws that card's plots and that session's, not all 137."""
    key = redraw.digest(figure.__name__, *inputs)
    if redraw.drawn_digest(image) == key:
        return True
    fig = figure(*inputs)
    if fig is None:
        return False
    plots.save(fig, image, key)
    return True


def _held(v: Verdict) -> list[tuple[str, HeldMemory]]:
    """The flag sets whose diagnosis pass read what held the memory (at an OOM first)."""
    if v.findings is None:
        return []
    found = [(f, m.memory.held) for f, m in v.findings.flag_sets.items() if m.memory.held is not None]
    return sorted(found, key=lambda fh: fh[1].at != "oom")


def _soak_section(store: RunStore, v: Verdict, capacity: float, styles: dict[str, plots.FlagStyle],
                  out: Path) -> list[str]:
    """### Soak: the card's soak findings in sentences (runner.judge.soak_text) and its plot, from the soak records."""
    soak = v.findings.soak if v.findings is not None else None
    if soak is None:
        return []
    lines = ["### Soak", "", *soak_lines(soak), ""]
    series = {f: store.load_soak_requests(f"{v.card}/{f}") for f in soak.flag_sets}
    fig = plots.soak_figure(v.card, series, capacity, {f: styles.get(f) or plots.flag_styles([f])[f] for f in series},
                            soak.requests)
    if fig is not None:
        image = plots.save(fig, _plot_path(out, f"{v.card}-soak.png"))
        lines += [f"![{quote.markdown(v.card)} soak](plots/{image.name})", ""]
    return lines


def _card_section(store: RunStore, v: Verdict, cards: dict[str, Any], sessions: list[SessionRecord],
                  steps: list[StepRecord], styles: dict[str, plots.FlagStyle], out: Path) -> list[str]:
    capacity = float(cards.get(v.card, {}).get("vram_gib", 0)) * GIB
    card_sessions = [s for s in sessions if s.card == v.card]
    card_steps = [st for st in steps if st.card == v.card]
    order = list(dict.fromkeys([s.flags for s in card_sessions] + [c.flags for c in v.cells]))
    roles = {c.flags: c.role for c in v.cells} | {s.flags: s.role for s in card_sessions}
    lines = ["", f"## {quote.markdown(v.card)} — {v.world}", ""]
    if v.findings is not None:  # findings_lines quotes what came from the server itself
        lines += ["### Findings", "", *findings_lines(v), ""]
        lines += _soak_section(store, v, capacity, styles, out)
        lines += ["### Evidence", ""]
    lines += [quote.markdown(v.reason), ""]
    if v.evidence.flag_sets:
        lines += [f"Every flag set at {v.target_references} reference(s):", ""]
        stories = v.evidence.flag_sets
        lines += [f"- `{f}` [{roles.get(f, '?')}]: {_story(stories[f])}" for f in dict.fromkeys([*order, *stories])
                  if f in stories]
        lines.append("")
    pairs = identical_pairs(card_steps)
    pair_notes = {p.note() for p in pairs}
    lines += [f"- note: {quote.markdown(n)}" for n in v.notes if n not in pair_notes]
    lines += [f"- note: {_group_line(names, group)}" for names, group in identical_groups(pairs)]
    refs = sorted({c.references for c in v.cells})
    by = {(c.flags, c.references): c for c in v.cells}
    ssim = _ssim(card_steps)
    lines += ["", f"Capacity {fmt_bytes(capacity)}. Cells: highest request peak (device), median seconds per "
                  "request [min–max over every timed send: repeats × seeds], mean PSNR and SSIM vs the baseline "
                  "(100 dB / 1.000: identical; \"baseline\": the baseline cell itself). A latency ratio names what it "
                  "divides: geometric means (repeats = auto, the verdict's) or medians (profiles.json's, and a fixed "
                  "`repeats`).", "",
              "| flag set | role | " + " | ".join(refs_text(n) for n in refs) + " |",
              "|---|---|" + "---|" * len(refs)]
    for f in order:
        lines.append(f"| {f} | {roles.get(f, '?')} | "
                     + " | ".join(_cell_text(by.get((f, n)), ssim.get((f, n))) for n in refs) + " |")
    lines += ["", *_session_rows(card_sessions, card_steps, v.cells), "",
              "A session peak and a cell figure measure different windows and sources (see Terms below): "
              "they need not agree.", ""]
    for s in card_sessions:  # the sources side by side, where a session had more than one
        if len([p for p in s.session_peaks if p.metric == "device"]) > 1:
            lines += [f"Device-memory peaks of session {s.flags} by source:", "",
                      render(reconcile(s.session_peaks)), ""]
    never_ready = {s.flags: plots.start_failure_label(s.start_failure) for s in card_sessions
                   if s.start_failure}
    figs: list[tuple[str, Callable[..., Figure | None], tuple[Any, ...]]] = [
        ("latency", plots.latency_figure, (v.card, card_steps, v.cells, order, styles)),
        ("held", plots.held_figure, (v.card, _held(v), capacity))]
    if v.cells:
        figs.insert(0, ("capacity", plots.capacity_figure, (v.card, v.cells, order, capacity, styles, never_ready)))
    for name, figure, inputs in figs:
        image = _plot_path(out, f"{v.card}-{name}.png")
        if _drawn(image, figure, *inputs):
            lines += [f"![{quote.markdown(v.card)} {name}](plots/{image.name})", ""]
    for s in card_sessions:
        image = _plot_path(out, f"{s.card}--{s.flags}-memory.png")
        folder = store.session_dir(s.key)
        try:
            rows, unreadable = read_memory(folder / "memory.csv")
            left_out = (f"memory.csv of {quote.code(s.key)}: {unreadable} line(s) are not samples and were left "
                        "out" if unreadable else None)
        except NotRead as exc:  # a FIFO where memory.csv goes is said, never waited on
            rows, left_out = [], f"memory.csv of {quote.code(s.key)} was not read: {exc}"
        if not _drawn(image, plots.session_figure, s, [st for st in card_steps if st.flags == s.flags], rows,
                      capacity):
            image.unlink(missing_ok=True)
            if left_out:  # a plot missing for garbage in the file is said, not silent
                lines += [f"No memory plot: {left_out}, and no sample was left.", ""]
            continue
        lines += [f"![{quote.markdown(s.key)} memory](plots/{image.name})", ""]
        if left_out:
            lines += [f"{left_out}.", ""]
    failures = [st for st in card_steps if st.status == Status.FAILED and st.failure]
    if failures:
        lines += ["Failures with evidence:", ""]
        for st in failures:
            assert st.failure is not None
            ev = clip(" / ".join(st.failure.evidence[:2]), 320)
            lines.append(f"- {quote.code(st.key)}: {st.failure.kind} — {quote.markdown(st.failure.message)}"
                         + (f" — {quote.code(ev)}" if ev else ""))
        lines.append("")
    return lines
