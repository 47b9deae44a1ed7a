"""report.md + plots from a run directory (and verdict.json). Reads records only: rerunnable any time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from runner.records import SessionRecord, Status, StepRecord
from runner.store import RunStore, load_memory, write_json
from runner.verdict import Cell, Verdict

GIB = 2**30


def _gib(value: int | None) -> str:
    return "–" if value is None else f"{value / GIB:.2f}"


def _cell_text(cell: Cell | None) -> str:
    if cell is None:
        return "·"
    if cell.served:
        psnr = f", {cell.psnr_db:g} dB" if cell.psnr_db is not None else ""
        return f"✅ {_gib(cell.peak_bytes)} GiB, {cell.wall_s:g} s{psnr}"
    why = (cell.why_not or "").split(": ", 1)[-1]
    label = why.split(":")[0]
    if label.startswith("skipped"):
        return "⏭ " + why.replace("skipped: ", "")[:60]
    if label == "oom":
        return f"❌ OOM ({_gib(cell.peak_bytes)} GiB seen)"
    if why.startswith("broken output"):
        return "⚠️ " + why[:60]
    return "❌ " + why[:60]


def plot_session_memory(store: RunStore, session: SessionRecord, steps: list[StepRecord], capacity_gib: float,
                        out: Path) -> Path | None:
    rows = load_memory(store.session_dir(session.key) / "memory.csv")
    if not rows:
        return None
    t0 = min(r[0] for r in rows)
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for (source, metric) in sorted({(r[2], r[3]) for r in rows}):
        pts = [(r[0] - t0, r[4] / GIB) for r in rows if r[2] == source and r[3] == metric]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1, label=f"{source} ({metric})",
                ls="-" if metric == "device" else "--")
    for s in steps:
        if s.started_at is None:
            continue
        x = s.started_at - t0
        color = "tab:green" if s.status == Status.OK else "tab:red"
        ax.axvspan(x, x + (s.wall_s or 0), color=color, alpha=0.12)
        ax.text(x, ax.get_ylim()[1] * 0.98, f"{s.references}r", fontsize=6, va="top")
    ax.axhline(capacity_gib, color="black", ls=":", lw=1, label=f"capacity {capacity_gib:g} GiB")
    for start in session.starts:
        ax.axvline(start.started_at - t0, color="grey", lw=0.8)
    ax.set_xlabel("seconds since session start")
    ax.set_ylabel("GiB")
    ax.set_title(f"{session.key}: memory (green = request served, red = failed)")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_capacity(card: str, cells: tuple[Cell, ...], capacity_gib: float, out: Path) -> Path | None:
    if not cells:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for flags in sorted({c.flags for c in cells}):
        pts = sorted((c.references, c.peak_bytes / GIB, c.served) for c in cells
                     if c.flags == flags and c.peak_bytes is not None)
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=flags)
        for x, y, served in pts:
            if not served:
                ax.plot(x, y, marker="x", color="red", ms=10)
    ax.axhline(capacity_gib, color="black", ls=":", lw=1, label=f"capacity {capacity_gib:g} GiB")
    ax.set_xlabel("reference images")
    ax.set_ylabel("peak device memory (GiB)")
    ax.set_title(f"{card}: peak vs reference count (x = not served)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_report(store: RunStore, verdicts: list[Verdict]) -> Path:
    run = store.load_run()
    steps, sessions = store.load_steps(), store.load_sessions()
    write_json(store.root / "verdict.json", {"run_id": run["run_id"], "verdicts": [v.to_json() for v in verdicts]})
    plots = store.root / "plots"
    plots.mkdir(exist_ok=True)
    cards: dict[str, Any] = run.get("cards", {})
    lines = [f"# Run {run['run_id']}", "",
             f"Matrix `{run['matrix']['path']}` (sha256 `{run['matrix']['sha256'][:12]}`), runner "
             f"{run['runner']['version']}, started {run.get('started_at_iso', '?')}, "
             f"finished {run.get('finished_at_iso', 'not finished')}.", "",
             "| card | verdict | deciding flag set | why |", "|---|---|---|---|"]
    for v in verdicts:
        lines.append(f"| {v.card} | **{v.world}** | {v.flags or '–'} | {v.reason.replace('|', '/')} |")
    counts = {s: sum(r.status == s for r in steps) for s in Status}
    lines += ["", f"Steps: {counts[Status.OK]} ok, {counts[Status.FAILED]} failed, "
                  f"{counts[Status.SKIPPED]} skipped.", ""]
    for v in verdicts:
        capacity = float(cards.get(v.card, {}).get("vram_gib", 0))
        lines += [f"## {v.card} — {v.world}", "", v.reason, ""]
        lines += [f"- note: {n}" for n in v.notes]
        refs = sorted({c.references for c in v.cells})
        flags = list(dict.fromkeys(c.flags for c in v.cells))
        by = {(c.flags, c.references): c for c in v.cells}
        lines += ["", "| flag set | role | " + " | ".join(f"{n} ref" for n in refs) + " |",
                  "|---|---|" + "---|" * len(refs)]
        for f in flags:
            role = next(c.role for c in v.cells if c.flags == f)
            lines.append(f"| {f} | {role} | " + " | ".join(_cell_text(by.get((f, n))) for n in refs) + " |")
        lines += ["", "Cells: peak device GiB (source), mean wall s per request, mean PSNR vs baseline.", ""]
        card_sessions = [s for s in sessions if s.card == v.card]
        lines += ["| session | starts | ready s | load peak GiB | session peaks by source | deterministic | failure |",
                  "|---|---|---|---|---|---|---|"]
        for s in card_sessions:
            first = s.starts[0] if s.starts else None
            load = next((p for p in (first.load_peaks if first else ()) if p.available and p.metric == "device"),
                        None)
            peaks = ", ".join(f"{p.source}/{p.metric} {_gib(p.bytes)}" if p.available
                              else f"{p.source}/{p.metric} n/a ({p.reason})" for p in s.session_peaks)
            det = next((st.deterministic for st in steps if st.card == s.card and st.flags == s.flags
                        and st.deterministic is not None), None)
            fail = s.start_failure
            lines.append(f"| {s.flags} | {len(s.starts)} | {first.ready_s if first else '–'} | "
                         f"{_gib(load.bytes) if load else '–'} | {peaks} | {det if det is not None else '–'} | "
                         f"{(fail.kind + ': ' + fail.message) if fail else '; '.join(s.notes) or '–'} |")
            image = plot_session_memory(store, s, [st for st in steps if st.card == s.card and
                                                   st.flags == s.flags], capacity,
                                        plots / f"{s.card}--{s.flags}-memory.png")
            if image:
                lines.append(f"\n![{s.key} memory](plots/{image.name})\n")
        cap = plot_capacity(v.card, v.cells, capacity, plots / f"{v.card}-capacity.png")
        if cap:
            lines += ["", f"![{v.card} capacity](plots/{cap.name})", ""]
        failures = [st for st in steps if st.card == v.card and st.status == Status.FAILED and st.failure]
        if failures:
            lines += ["", "Failures with evidence:", ""]
            for st in failures:
                ev = " / ".join(st.failure.evidence[:2]) if st.failure else ""
                lines.append(f"- `{st.key}`: {st.failure.kind} — {st.failure.message}"
                             + (f" — `{ev[:200]}`" if ev else ""))
        lines.append("")
    path = store.root / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
