"""Compare two runs (a new server commit, driver or flag against the last one): verdict changes and, per
card × flag set × reference count, what moved — served or not, peak memory, latency, PSNR. Pure over the
runs' verdict.json files; `runner compare RUN_A RUN_B` prints it.

Noise is told from change. Wall time has two noises: within a run (the spread of a cell's timed sends) and
between runs (a shared machine's load moves every cell, either way). A cell's wall time moved only when the
95% bootstrap interval of its after/before medians (runner.judge.verdict.ratio_interval; ≥ 2 timed sends in each
run, else the spread is unknown and no change is claimed) lies wholly outside the run-to-run band (stated on
the output's first line, with why it is that wide): ±3
robust SDs (1.4826 × MAD) of log(after/before) over all cells both runs timed, when there are at least
MIN_CELLS_FOR_BAND of them (else the band is 1: the within-run spread alone). A peak moved by more than
PEAK_NOISE on a cell served in both runs (meters sample; an OOM cell's peak is whatever was seen before the
failure); PSNR by more than PSNR_NOISE_DB. A served/not served or blocker change is always a change. Only
changes are listed unless every cell is asked for."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from runner.core.errors import UserError
from runner.core.records import problem
from runner.core.units import fmt_bytes, fmt_s
from runner.judge.decision import Blocked, Cell, World
from runner.judge.verdict import ratio_interval
from runner.judge.verdict_text import stops_text
from runner.plan.sequential import exp

Key = tuple[str, str, int]  # card, flag set, reference count
PEAK_NOISE = 0.02  # relative
PSNR_NOISE_DB = 0.5
MIN_CELLS_FOR_BAND = 5
BAND_SAID_MAX = 1000.0  # a band wider than this says nothing (the latency words' rule: no bound past 1000×)


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    worlds: dict[str, World]
    cells: dict[Key, Cell]
    stops: dict[str, tuple[Blocked, ...]] = field(default_factory=dict)  # per card, from evidence.flag_sets


@dataclass(frozen=True)
class CellChange:
    key: Key
    before: Cell | None
    after: Cell | None
    band: float = 1.0  # run-to-run noise: wall ratios within [1/band, band] are not a change

    @property
    def served_changed(self) -> bool:
        return bool(self.before and self.before.served) != bool(self.after and self.after.served)

    def what_changed(self) -> tuple[str, ...]:
        """The measures that moved beyond their noise: "cell", "served", "blocker", "wall", "peak", "psnr"."""
        x, y = self.before, self.after
        if x is None or y is None:
            return ("cell",)
        out = []
        if self.served_changed:
            out.append("served")
        if x.blocker != y.blocker:
            out.append("blocker")
        if wall_moved(x, y, self.band):
            out.append("wall")
        if x.served and y.served and x.peak_bytes and y.peak_bytes \
                and abs(y.peak_bytes - x.peak_bytes) > PEAK_NOISE * max(x.peak_bytes, y.peak_bytes):
            out.append("peak")
        if x.psnr_db is not None and y.psnr_db is not None and abs(y.psnr_db - x.psnr_db) > PSNR_NOISE_DB:
            out.append("psnr")
        return tuple(out)


def _spread(c: Cell) -> tuple[float, float] | None:
    if c.wall_samples < 2 or c.wall_min_s is None or c.wall_max_s is None:
        return None
    return c.wall_min_s, c.wall_max_s


def wall_moved(x: Cell, y: Cell, band: float = 1.0) -> bool:
    """True when both cells measured a spread and the interval of after/before medians lies wholly outside
    [1/band, band]."""
    if _spread(x) is None or _spread(y) is None or not (x.walls_s and y.walls_s):
        return False
    low, high = ratio_interval(y.walls_s, x.walls_s)
    return high < 1 / band or low > band


def run_band(pairs: list[tuple[Cell, Cell]]) -> tuple[float, int]:
    """The run-to-run noise band (a factor ≥ 1) from the cells both runs timed, and how many there were."""
    logs = [math.log(y.wall_s) - math.log(x.wall_s) for x, y in pairs if x.wall_s and y.wall_s]
    if len(logs) < MIN_CELLS_FOR_BAND:
        return 1.0, len(logs)
    mid = statistics.median(logs)
    sd = 1.4826 * statistics.median(abs(v - mid) for v in logs)
    return exp(3 * sd), len(logs)  # inf, never an OverflowError, for walls a hand edit spread over 600 decades


def load_summary(run_dir: Path) -> RunSummary:
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run folder" + ("" if run_dir.exists() else " (it does not exist)"))
    path = run_dir / "verdict.json"
    if not path.exists() and not (run_dir / "run.json").is_file():
        raise UserError(f"{run_dir}: not a run directory (no verdict.json, no run.json)")
    try:
        doc = json.loads(path.read_bytes())
    except OSError as exc:
        raise UserError(f"{path}: cannot read verdicts ({exc.strerror or exc}); run `runner report {run_dir}` "
                        "first") from None
    except RecursionError:
        raise UserError(f"{path}: not a verdict.json (nested too deep)") from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise UserError(f"{path}: cannot read verdicts ({getattr(exc, 'msg', exc)}); run `runner report "
                        f"{run_dir}` first") from None
    try:
        return _summary(doc)
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
        what = f"missing {exc}" if isinstance(exc, KeyError) else problem(exc) if isinstance(exc, ValidationError) \
            else str(exc) or type(exc).__name__
        raise UserError(f"{path}: not a verdict.json this runner reads: {what[:200]}") from None


def _summary(doc: Any) -> RunSummary:
    """verdict.json → RunSummary; a shape of another version raises KeyError, TypeError or ValueError."""
    if not isinstance(doc, dict) or not isinstance(doc.get("verdicts"), list):
        raise ValueError("no list of verdicts")
    worlds, cells, stops = {}, {}, {}
    for v in doc["verdicts"]:
        worlds[v["card"]] = World(v["world"])
        stories = (v.get("evidence") or {}).get("flag_sets", {})
        stops[v["card"]] = tuple(Blocked.from_json(f, b) for f, b in stories.items() if isinstance(b, dict))
        for c in v["cells"]:
            cell = Cell(**{**c, "steps": tuple(c["steps"]), "walls_s": tuple(c.get("walls_s", ()))})
            walls = [w for w in (cell.wall_s, cell.wall_min_s, cell.wall_max_s, *cell.walls_s) if w is not None]
            if not all(isinstance(w, (int, float)) and math.isfinite(w) and w > 0 for w in walls):
                raise ValueError(f"{v['card']}/{cell.flags} at {cell.references}: a wall time that is not a "
                                 "positive number")
            cells[(v["card"], cell.flags, cell.references)] = cell
    return RunSummary(str(doc["run_id"]), worlds, cells, stops)


def changes(a: RunSummary, b: RunSummary) -> tuple[list[CellChange], float, int]:
    """Every cell's change, with the run-to-run band and how many cells it was measured over."""
    keys = sorted(a.cells.keys() | b.cells.keys())
    band, cells = run_band([(a.cells[k], b.cells[k]) for k in keys if k in a.cells and k in b.cells])
    return [CellChange(k, a.cells.get(k), b.cells.get(k), band) for k in keys], band, cells


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


def _wall(c: Cell | None) -> str:
    if c is None or c.wall_s is None:
        return "–"
    spread = _spread(c)
    return f"{fmt_s(c.wall_s)} [{fmt_s(spread[0])}–{fmt_s(spread[1])}]" if spread else f"{fmt_s(c.wall_s)} (1 send)"


def band_line(band: float, timed: int) -> str:
    """The noise band a wall-time change must clear, and why it is that wide: said first, since a wide band
    (a loaded machine) hides large changes behind "No changed cells"."""
    if band > BAND_SAID_MAX:
        return (f"wall time: the run-to-run noise over the {timed} cells both runs timed is beyond ×/÷ "
                f"{BAND_SAID_MAX:g}: no change of wall time can be told from it")
    if band > 1:
        return (f"wall time: a change must clear ×/÷ {band:.2f}, the run-to-run noise measured over the {timed} "
                f"cells both runs timed (3 robust SDs of after/before: a shared machine's load moves every cell)")
    return (f"wall time: no run-to-run band ({timed} cells timed in both, {MIN_CELLS_FOR_BAND} needed): "
            f"the within-run spread of each cell alone decides")


def render(a: RunSummary, b: RunSummary, *, show_all: bool = False) -> str:
    every, band, timed = changes(a, b)
    lines = [f"# {a.run_id} → {b.run_id} — {band_line(band, timed)}", "",
             "| card | verdict before | verdict after | flag sets after (the report's words) |", "|---|---|---|---|"]
    for card in sorted(a.worlds.keys() | b.worlds.keys()):
        before, after = a.worlds.get(card), b.worlds.get(card)
        mark = "" if before == after else " ⚠️ changed"
        words = stops_text(b.stops.get(card, ())).replace("|", "/") or "–"
        lines.append(f"| {card} | {before or '–'} | {after or '–'}{mark} | {words} |")
    moved = [ch for ch in every if ch.what_changed()]
    noise = (f"band (beyond ×/÷ {BAND_SAID_MAX:g})" if band > BAND_SAID_MAX else f"×/÷ {band:.2f} band" if band > 1
             else "within-run spread (no run-to-run band)")
    lines += ["", f"{len(moved)} of {len(every)} cell(s) changed beyond noise"
              + ("" if show_all else f"; {len(every) - len(moved)} within noise not listed (--all lists them)")
              + f". Wall: median [min–max] s over timed sends; a change needs the 95% interval of after/before "
                f"to lie outside the {noise}."]
    shown = every if show_all else moved
    if not shown:
        return "\n".join([*lines, "", "No changed cells."]) + "\n"
    lines += ["", "| card | flag set | refs | before | after | changed | Δ peak | wall s before → after | Δ wall s "
                  "| Δ PSNR dB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for ch in shown:
        x, y = ch.before, ch.after
        peak = "–" if not (x and y) or x.peak_bytes is None or y.peak_bytes is None else (
            ("+" if y.peak_bytes >= x.peak_bytes else "-") + fmt_bytes(abs(y.peak_bytes - x.peak_bytes)))
        lines.append(
            f"| {ch.key[0]} | {ch.key[1]} | {ch.key[2]} | {_state(x)} | {_state(y)}"
            f"{' ⚠️' if ch.served_changed else ''} | {', '.join(ch.what_changed()) or 'noise'} | {peak} | "
            f"{_wall(x)} → {_wall(y)} | {_delta(x.wall_s if x else None, y.wall_s if y else None, '+.2f')} | "
            f"{_delta(x.psnr_db if x else None, y.psnr_db if y else None, '+.2f', relative=False)} |")
    return "\n".join(lines) + "\n"
