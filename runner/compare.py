"""Compare two runs (a new server commit, driver or flag against the last one): verdict changes and, per
card × flag set × reference count, what moved — served or not, peak memory, latency, PSNR. Pure over the
runs' verdict.json files; `runner compare RUN_A RUN_B` prints it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.errors import UserError
from runner.units import fmt_bytes
from runner.verdict import Cell, World

Key = tuple[str, str, int]  # card, flag set, reference count


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    worlds: dict[str, World]
    cells: dict[Key, Cell]


@dataclass(frozen=True)
class CellChange:
    key: Key
    before: Cell | None
    after: Cell | None

    @property
    def served_changed(self) -> bool:
        return bool(self.before and self.before.served) != bool(self.after and self.after.served)


def load_summary(run_dir: Path) -> RunSummary:
    path = run_dir / "verdict.json"
    try:
        doc: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: cannot read verdicts ({exc}); run `runner report {run_dir}` first") from None
    worlds, cells = {}, {}
    for v in doc["verdicts"]:
        worlds[v["card"]] = World(v["world"])
        for c in v["cells"]:
            cell = Cell(**{**c, "steps": tuple(c["steps"])})
            cells[(v["card"], cell.flags, cell.references)] = cell
    return RunSummary(doc["run_id"], worlds, cells)


def changes(a: RunSummary, b: RunSummary) -> list[CellChange]:
    return [CellChange(k, a.cells.get(k), b.cells.get(k)) for k in sorted(a.cells.keys() | b.cells.keys())]


def _delta(before: float | None, after: float | None, fmt: str, *, relative: bool = True) -> str:
    if before is None or after is None:
        return "–"
    pct = f" ({(after / before - 1) * 100:+.0f}%)" if before and relative else ""
    return f"{after - before:{fmt}}{pct}"


def _state(cell: Cell | None) -> str:
    if cell is None:
        return "not in run"
    if cell.served:
        return "served"
    return "not served"


def render(a: RunSummary, b: RunSummary) -> str:
    lines = [f"# {a.run_id} → {b.run_id}", "", "| card | verdict before | verdict after |", "|---|---|---|"]
    for card in sorted(a.worlds.keys() | b.worlds.keys()):
        before, after = a.worlds.get(card), b.worlds.get(card)
        mark = "" if before == after else " ⚠️ changed"
        lines.append(f"| {card} | {before or '–'} | {after or '–'}{mark} |")
    lines += ["", "| card | flag set | refs | before | after | Δ peak | Δ wall s | Δ PSNR dB |",
              "|---|---|---|---|---|---|---|---|"]
    for ch in changes(a, b):
        x, y = ch.before, ch.after
        peak = "–" if not (x and y) or x.peak_bytes is None or y.peak_bytes is None else (
            ("+" if y.peak_bytes >= x.peak_bytes else "-") + fmt_bytes(abs(y.peak_bytes - x.peak_bytes)))
        lines.append(
            f"| {ch.key[0]} | {ch.key[1]} | {ch.key[2]} | {_state(x)} | {_state(y)}"
            f"{' ⚠️' if ch.served_changed else ''} | {peak} | "
            f"{_delta(x.wall_s if x else None, y.wall_s if y else None, '+.3f')} | "
            f"{_delta(x.psnr_db if x else None, y.psnr_db if y else None, '+.2f', relative=False)} |")
    return "\n".join(lines) + "\n"
