"""report.md + plots from a run directory (and verdict.json). Reads records only: rerunnable any time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from runner.meters.reconcile import reconcile, render
from runner.records import SessionRecord, Status, StepRecord
from runner.store import RunStore, load_memory
from runner.units import GIB, fmt_bytes, unit_for
from runner.verdict import Cell, Verdict


def _cell_text(cell: Cell | None) -> str:
    if cell is None:
        return "·"
    if cell.served:
        psnr = f", {cell.psnr_db:g} dB" if cell.psnr_db is not None else ""
        return f"✅ {fmt_bytes(cell.peak_bytes)}, {cell.wall_s:g} s{psnr}"
    why = (cell.why_not or "").split(": ", 1)[-1]
    if cell.blocker == "skipped":
        return "⏭ " + why.removeprefix("skipped: ")[:70]
    if cell.blocker == "oom":
        return f"❌ OOM (peak seen {fmt_bytes(cell.peak_bytes)})"
    if cell.blocker == "broken":
        return "⚠️ " + why[:70]
    return "❌ " + why[:70]


def plot_session_memory(store: RunStore, session: SessionRecord, steps: list[StepRecord], capacity_bytes: float,
                        out: Path) -> Path | None:
    """Device memory (with the card's capacity and request windows) above host RAM, one time axis."""
    rows = load_memory(store.session_dir(session.key) / "memory.csv")
    if not rows:
        return None
    t0 = min(r[0] for r in rows)
    fig, (dev, host) = plt.subplots(2, 1, figsize=(9, 5), sharex=True, height_ratios=(3, 1.4))
    for ax, metric in ((dev, "device"), (host, "host")):
        series = [r for r in rows if r[3] == metric]
        top = max([r[4] for r in series] + ([capacity_bytes] if metric == "device" else [0]), default=0)
        div, unit = unit_for(top)
        for source in sorted({r[2] for r in series}):
            pts = [(r[0] - t0, r[4] / div) for r in series if r[2] == source]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1, label=source, marker="." if len(pts) < 50 else None)
        if metric == "device" and capacity_bytes:
            ax.axhline(capacity_bytes / div, color="black", ls=":", lw=1,
                       label=f"capacity {fmt_bytes(capacity_bytes)}")
        ax.set_ylabel(f"{metric} ({unit})")
        if series or metric == "device":
            ax.legend(fontsize=7, loc="lower right")
    for s in steps:
        if s.started_at is None:
            continue
        x = s.started_at - t0
        for ax in (dev, host):
            ax.axvspan(x, x + (s.wall_s or 0), color="tab:green" if s.status == Status.OK else "tab:red",
                       alpha=0.15, lw=0)
        dev.annotate(f"{s.references}r", (x, 1.0), xycoords=("data", "axes fraction"), fontsize=6, va="bottom")
    for start in session.starts:
        for ax in (dev, host):
            ax.axvline(start.started_at - t0, color="grey", lw=0.8, ls="--")
    host.set_xlabel("seconds since session start (dashed: server start; green/red: request served/failed)")
    dev.set_title(f"{session.key}: memory", pad=14)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _oom(cell: Cell) -> bool:
    return cell.blocker == "oom"


def plot_capacity(card: str, cells: tuple[Cell, ...], order: list[str], capacity_bytes: float,
                  out: Path) -> Path | None:
    measured = [c for c in cells if c.peak_bytes is not None]
    if not measured:
        return None
    div, unit = unit_for(max([c.peak_bytes or 0 for c in measured] + [capacity_bytes]))
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for flags in order:
        # An OOM means the demand exceeded the capacity, whatever a sampled meter caught before the failure:
        # such a point is drawn at least at the capacity line, not at a reading that would look like a drop.
        pts = sorted((c.references, max(c.peak_bytes or 0, capacity_bytes if _oom(c) else 0) / div, c.served)
                     for c in measured if c.flags == flags)
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=flags)
        for x, y, served in pts:
            if not served:
                ax.plot(x, y, marker="x", color="red", ms=10, mew=2)
    ax.axhline(capacity_bytes / div, color="black", ls=":", lw=1, label=f"capacity {fmt_bytes(capacity_bytes)}")
    ax.set_xlabel("reference images")
    ax.set_ylabel(f"peak device memory ({unit})")
    ax.set_xticks(sorted({c.references for c in cells}))
    ax.set_title(f"{card}: peak vs references (x: not served; OOM at ≥ capacity)", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _session_rows(card_sessions: list[SessionRecord], steps: list[StepRecord]) -> list[str]:
    rows = ["| session | role | starts | ready s | load peak | session peaks by source | deterministic "
            "| failure / notes |", "|---|---|---|---|---|---|---|---|"]
    for s in card_sessions:
        first = s.starts[0] if s.starts else None
        load = next((p for p in (first.load_peaks if first else ()) if p.available and p.metric == "device"), None)
        peaks = ", ".join(f"{p.source}/{p.metric} {fmt_bytes(p.bytes)} ({p.samples} samples)" if p.available
                          else f"{p.source}/{p.metric} n/a: {p.reason}" for p in s.session_peaks)
        check = next((st for st in steps if st.flags == s.flags and st.deterministic is not None), None)
        det = None if check is None else check.deterministic
        fail = s.start_failure
        what = (f"{fail.kind}: {fail.message}" if fail else "; ".join(s.notes)) or "–"
        rows.append(f"| {s.flags} | {s.role} | {len(s.starts)} | {first.ready_s if first else '–'} | "
                    f"{fmt_bytes(load.bytes) if load else '–'} | {peaks} | "
                    f"{'–' if det is None else 'yes' if det else f'**no** ({check.repeat_psnr_db} dB)'} | "
                    f"{what.replace('|', '/')} |")
    return rows


def write_report(store: RunStore, verdicts: list[Verdict]) -> Path:
    run = store.load_run()
    steps, sessions = store.load_steps(), store.load_sessions()
    planned = {key: i for i, key in enumerate(run.get("plan", {}).get("sessions", []))}
    sessions.sort(key=lambda s: planned.get(s.key, len(planned)))
    plots = store.root / "plots"
    plots.mkdir(exist_ok=True)
    cards: dict[str, Any] = run.get("cards", {})
    counts = {s: sum(r.status == s for r in steps) for s in Status}
    lines = [f"# Run {run['run_id']}", "",
             f"Matrix `{run['matrix']['path']}` (sha256 `{run['matrix']['sha256'][:12]}`), runner "
             f"{run['runner']['version']}, started {run.get('started_at_iso', '?')}, "
             f"finished {run.get('finished_at_iso', 'not finished')}"
             f"{' (interrupted)' if run.get('interrupted') else ''}. "
             f"Steps: {counts[Status.OK]} ok, {counts[Status.FAILED]} failed, {counts[Status.SKIPPED]} skipped.", "",
             "| card | verdict | deciding flag set | why |", "|---|---|---|---|"]
    for v in verdicts:
        lines.append(f"| {v.card} | **{v.world}** | {v.flags or '–'} | {v.reason.replace('|', '/')} |")
    for v in verdicts:
        capacity = float(cards.get(v.card, {}).get("vram_gib", 0)) * GIB
        card_sessions = [s for s in sessions if s.card == v.card]
        card_steps = [st for st in steps if st.card == v.card]
        order = list(dict.fromkeys([s.flags for s in card_sessions] + [c.flags for c in v.cells]))
        lines += ["", f"## {v.card} — {v.world}", "", v.reason, ""]
        lines += [f"- note: {n}" for n in v.notes]
        refs = sorted({c.references for c in v.cells})
        by = {(c.flags, c.references): c for c in v.cells}
        lines += ["", f"Capacity {fmt_bytes(capacity)}. Cells: peak device memory, mean wall time per request, "
                      "mean PSNR vs the baseline.", "",
                  "| flag set | role | " + " | ".join(f"{n} ref" for n in refs) + " |",
                  "|---|---|" + "---|" * len(refs)]
        for f in order:
            role = next((c.role for c in v.cells if c.flags == f), "?")
            lines.append(f"| {f} | {role} | " + " | ".join(_cell_text(by.get((f, n))) for n in refs) + " |")
        lines += ["", *_session_rows(card_sessions, card_steps), ""]
        for s in card_sessions:  # the sources side by side, where a session had more than one
            if len([p for p in s.session_peaks if p.metric == "device"]) > 1:
                lines += [f"Device-memory peaks of session {s.flags} by source:", "",
                          render(reconcile(s.session_peaks)), ""]
        cap = plot_capacity(v.card, v.cells, order, capacity, plots / f"{v.card}-capacity.png")
        if cap:
            lines += [f"![{v.card} capacity](plots/{cap.name})", ""]
        for s in card_sessions:
            image = plot_session_memory(store, s, [st for st in card_steps if st.flags == s.flags], capacity,
                                        plots / f"{s.card}--{s.flags}-memory.png")
            if image:
                lines += [f"![{s.key} memory](plots/{image.name})", ""]
        failures = [st for st in card_steps if st.status == Status.FAILED and st.failure]
        if failures:
            lines += ["Failures with evidence:", ""]
            for st in failures:
                ev = " / ".join(st.failure.evidence[:2]) if st.failure else ""
                lines.append(f"- `{st.key}`: {st.failure.kind} — {st.failure.message}"
                             + (f" — `{ev[:200]}`" if ev else ""))
            lines.append("")
    path = store.root / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
