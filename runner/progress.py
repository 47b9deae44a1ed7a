"""Live progress: one rich bar per lane with session, step count, elapsed and live memory, plus one line per
finished step so a scrolled-back terminal or a CI log tells the whole story; `verdict_line` is the one short
console line per card (the full reason is in report.md)."""

from __future__ import annotations

import threading

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column

from runner.events import Events
from runner.records import Status, StepRecord
from runner.units import clip, fmt_bytes, fmt_s
from runner.verdict import Verdict

SESSION_WIDTH = 34  # fixed column widths: the bars do not shift between frames as texts change length
MEMORY_WIDTH = 22


def step_line(r: StepRecord) -> str:
    head = f"{r.key}"
    if r.status == Status.SKIPPED:
        return f"{head}: skipped ({r.skip_reason})"
    if r.status == Status.FAILED:
        return f"{head}: FAILED {r.failure.kind if r.failure else ''} after {fmt_s(r.wall_s)} s"
    peak = r.peak("device")
    parts = [f"ok {fmt_s(r.wall_s)} s"]
    if peak and peak.bytes is not None:
        parts.append(f"peak {fmt_bytes(peak.bytes)} ({peak.source})")
    if r.scores and r.scores.psnr_db is not None:
        parts.append(f"PSNR {r.scores.psnr_db:.1f} dB")
    if r.scores and r.scores.sanity.broken:
        parts.append("BROKEN: " + "; ".join(r.scores.sanity.reasons))
    if r.deterministic is not None:
        parts.append("deterministic" if r.deterministic else
                     f"NOT deterministic (repeat PSNR {r.repeat_psnr_db:.1f} dB)" if r.repeat_psnr_db is not None
                     else "NOT deterministic")
    return f"{head}: " + ", ".join(parts)


def verdict_line(v: Verdict, limit: int = 150) -> str:
    """One short line per card for the console; report.md carries the whole reason."""
    head = f"{v.card}: {v.world}" + (f" ({v.flags})" if v.flags else "")
    return f"{head} — {clip(v.reason, max(40, limit - len(head)))}"


class ProgressView(Events):
    def __init__(self, console: Console | None = None, enabled: bool = True) -> None:
        self.console = console or Console(stderr=True, soft_wrap=True)
        self.progress = Progress(TextColumn("[bold]{task.fields[lane]}[/]"),
                                 TextColumn("{task.fields[session]}", table_column=Column(
                                     width=SESSION_WIDTH, no_wrap=True, overflow="ellipsis")),
                                 BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.fields[memory]}", table_column=Column(
                                     width=MEMORY_WIDTH, no_wrap=True, overflow="ellipsis")),
                                 console=self.console, disable=not enabled)
        self.tasks: dict[str, int] = {}
        self.shared: dict[str, bool] = {}  # card → its lane holds several cards (then labels name the card)
        self.loading: dict[str, bool] = {}
        self.lock = threading.Lock()

    def __enter__(self) -> ProgressView:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def lane_started(self, lane: str, cards: tuple[str, ...], total_steps: int) -> None:
        with self.lock:
            task = self.progress.add_task(lane, total=total_steps, lane=lane, session="starting", memory="")
            self.tasks.update({lane: task, **{card: task for card in cards}})
            self.shared.update({card: len(cards) > 1 for card in cards})

    def _label(self, card: str, flags: str) -> str:
        return f"{card}/{flags}" if self.shared.get(card) else flags

    def session_started(self, card: str, flags: str, attempt: int) -> None:
        # A new server has no reading yet: the previous session's figure must not stay on screen meanwhile.
        self.loading[card] = True
        label = f"{self._label(card, flags)} loading{' (restart ' + str(attempt) + ')' if attempt else ''}"
        self.progress.update(self.tasks[card], session=label, memory="mem – (loading)")

    def session_ready(self, card: str, flags: str, ready_s: float | None) -> None:
        self.loading[card] = False
        text = (f"{self._label(card, flags)} ready in {fmt_s(ready_s)} s" if ready_s is not None
                else f"{self._label(card, flags)} did not start")
        self.progress.update(self.tasks[card], session=text, memory="" if ready_s is None else "mem –")
        if ready_s is None:
            self.console.print(f"{card}/{flags}: server did not start")

    def step_done(self, record: StepRecord) -> None:
        self.progress.advance(self.tasks[record.card])
        self.console.print(step_line(record), highlight=False)

    def memory(self, card: str, device_bytes: int | None) -> None:
        value = "–" if device_bytes is None else fmt_bytes(device_bytes)
        self.progress.update(self.tasks[card], memory=f"mem {value}{' (loading)' if self.loading.get(card) else ''}")

    def lane_done(self, lane: str) -> None:
        self.progress.update(self.tasks[lane], session="done", memory="")
