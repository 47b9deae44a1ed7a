"""Live progress: one rich bar per card (lane) with session, step count, elapsed and live memory, plus one
line per finished step so a scrolled-back terminal or a CI log tells the whole story."""

from __future__ import annotations

import threading

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from runner.events import Events
from runner.records import Status, StepRecord
from runner.units import fmt_bytes


def step_line(r: StepRecord) -> str:
    head = f"{r.key}"
    if r.status == Status.SKIPPED:
        return f"{head}: skipped ({r.skip_reason})"
    if r.status == Status.FAILED:
        return f"{head}: FAILED {r.failure.kind if r.failure else ''} after {r.wall_s} s"
    peak = r.peak("device")
    parts = [f"ok {r.wall_s:.2f} s"]
    if peak and peak.bytes is not None:
        parts.append(f"peak {fmt_bytes(peak.bytes)} ({peak.source})")
    if r.scores and r.scores.psnr_db is not None:
        parts.append(f"PSNR {r.scores.psnr_db:.1f} dB")
    if r.scores and r.scores.sanity.broken:
        parts.append("BROKEN: " + "; ".join(r.scores.sanity.reasons))
    if r.deterministic is not None:
        parts.append("deterministic" if r.deterministic else
                     f"NOT deterministic (repeat PSNR {r.repeat_psnr_db} dB)")
    return f"{head}: " + ", ".join(parts)


class ProgressView(Events):
    def __init__(self, console: Console | None = None, enabled: bool = True) -> None:
        self.console = console or Console(stderr=True, soft_wrap=True)
        self.progress = Progress(TextColumn("[bold]{task.fields[card]}[/] {task.fields[session]}"),
                                 BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.fields[memory]}"), console=self.console,
                                 disable=not enabled)
        self.tasks: dict[str, int] = {}
        self.lock = threading.Lock()

    def __enter__(self) -> ProgressView:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def lane_started(self, lane: str, cards: tuple[str, ...], total_steps: int) -> None:
        with self.lock:
            task = self.progress.add_task(lane, total=total_steps, card=lane, session="starting", memory="")
            self.tasks.update({lane: task, **{card: task for card in cards}})

    def session_started(self, card: str, flags: str, attempt: int) -> None:
        label = f"{flags} (loading{', restart ' + str(attempt) if attempt else ''})"
        self.progress.update(self.tasks[card], session=f"{card}/{label}")

    def session_ready(self, card: str, flags: str, ready_s: float | None) -> None:
        text = f"{card}/{flags} (ready in {ready_s:.1f} s)" if ready_s is not None else f"{flags} (did not start)"
        self.progress.update(self.tasks[card], session=text)
        if ready_s is None:
            self.console.print(f"{card}/{flags}: server did not start")

    def step_done(self, record: StepRecord) -> None:
        self.progress.advance(self.tasks[record.card])
        self.console.print(step_line(record), highlight=False)

    def memory(self, card: str, device_bytes: int | None) -> None:
        text = "" if device_bytes is None else f"mem {fmt_bytes(device_bytes)}"
        self.progress.update(self.tasks[card], memory=text)

    def lane_done(self, lane: str) -> None:
        self.progress.update(self.tasks[lane], session="done", memory="")
