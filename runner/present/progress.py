"""Live progress: one rich bar per lane with session, step count, elapsed and live memory, plus one line per
finished step so a scrolled-back terminal or a CI log tells the whole story; `verdict_line` is the one short
console line per card (the full reason is in report.md)."""

from __future__ import annotations

import threading

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Column

from runner.core.records import NOT_RUN, DiagnosisRecord, SoakRequest, Status, StepRecord
from runner.core.units import clip, fmt_bytes, fmt_s, refs_text
from runner.judge.decision import Verdict
from runner.judge.verdict_text import console_line
from runner.observe import quote
from runner.plan.lanes import Step
from runner.run.events import Events
from runner.run.pending import SOAK_ENDS, decided

SESSION_WIDTH = 42  # fixed column widths: the bars do not shift between frames as texts change length
MEMORY_WIDTH = 22
BAR_WIDTH = 40  # rich's default
# What gives way, in order, down to how little: the bar to 12 cells first, then the memory text ("mem –
# (loading)" is 15; the session text says "loading" too), the session text, and last the bar down to 8.
SHRINK = (("bar", 12), ("memory", 15), ("session", 16), ("bar", 8))


def column_widths(console_width: int, lane_width: int, count_width: int) -> tuple[int, int, int]:
    """(session, memory, bar) widths so a row fits the terminal: in 80 columns the bar, the step count, the
    elapsed time and the start of the session text stay readable (SHRINK says what gives way first)."""
    fixed = lane_width + count_width + 7 + 5  # + elapsed (H:MM:SS) + one space between the six columns
    widths = {"session": SESSION_WIDTH, "memory": MEMORY_WIDTH, "bar": BAR_WIDTH}
    over = sum(widths.values()) - (console_width - fixed - 1)
    for name, least in SHRINK:
        cut = max(0, min(over, widths[name] - least))
        widths[name] -= cut
        over -= cut
    return widths["session"], widths["memory"], widths["bar"]


def step_line(r: StepRecord) -> str:
    head = f"{r.key}"
    if r.status == Status.SKIPPED:
        if r.implied_by:  # short, one line at a terminal: the deciding step named within the session (the record
            # keeps the whole reason); an OOM at 2 refs with 4 seeds skips eleven steps, each with this line
            return f"{head}: skipped, implied by the OOM at {r.implied_by.removeprefix(f'{r.card}/{r.flags}/')}"
        return f"{head}: skipped ({r.skip_reason})"
    if r.status == Status.FAILED:
        after = f" after {fmt_s(r.wall_s)} s" if r.wall_s is not None else ""
        return f"{head}: FAILED {r.failure.kind if r.failure else 'without a failure record'}{after}"
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


def soak_line(r: SoakRequest) -> str:
    """One soak request in a line: "rtx3090/default soak 37 (2 refs): ok 3.10 s, peak 20.1 GiB (nvml), floor after
    18.2 GiB (nvml)" — the console's and the live page's."""
    head = f"{r.key} soak {r.number} ({refs_text(r.references)})"
    if r.status == Status.FAILED:
        return f"{head}: FAILED {r.failure.kind if r.failure else 'without a failure record'} after {fmt_s(r.wall_s)} s"
    parts = [f"ok {fmt_s(r.wall_s)} s"]
    if r.peak is not None and r.peak.available and r.peak.bytes is not None:
        parts.append(f"peak {fmt_bytes(r.peak.bytes)} ({r.peak.source})")
    if r.floor_after is not None and r.floor_after.available and r.floor_after.bytes is not None:
        parts.append(f"floor after {fmt_bytes(r.floor_after.bytes)} ({r.floor_after.source})")
    return f"{head}: " + ", ".join(parts)


def soak_end_line(card: str, flags: str, stopped: str | None, line: str | None, sent: int) -> str:
    """How a soak ended, in a line."""
    what = {"requests": "held every request", "minutes": "held until its minutes ran out",
            "failure": "stopped at its first failure", "interrupted": "interrupted (a resume continues it)",
            "not idle": "not started: the GPU is held", "oom at load": "its server ran out of memory at load",
            "start failed": "its server did not start"}.get(stopped or "", stopped or "stopped")
    return f"{card}/{flags}: soak {what}, {sent} request(s) recorded" + (f" — {clip(line, 200)}" if line else "")


def verdict_line(v: Verdict) -> str:
    """One short line per card for the console, in the report's own words (runner.judge.verdict_text.summary);
    report.md carries the whole reason and the evidence."""
    return quote.console(console_line(v))


class ProgressView(Events):
    def __init__(self, console: Console | None = None, enabled: bool = True) -> None:
        self.console = console or Console(stderr=True, soft_wrap=True)
        self.session_column = Column(width=SESSION_WIDTH, no_wrap=True, overflow="ellipsis")
        self.memory_column = Column(width=MEMORY_WIDTH, no_wrap=True, overflow="ellipsis")
        self.bar = BarColumn()
        self.progress = Progress(TextColumn("[bold]{task.fields[lane]}[/]"),
                                 TextColumn("{task.fields[session]}", table_column=self.session_column),
                                 self.bar, MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.fields[memory]}", table_column=self.memory_column),
                                 console=self.console, disable=not enabled)
        self.tasks: dict[str, TaskID] = {}
        self.shared: dict[str, bool] = {}  # card → its lane holds several cards (then labels name the card)
        self.loading: dict[str, bool] = {}
        self.soaks: dict[str, int] = {}  # card → the requests its soak running now plans
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
            self._fit()

    def _fit(self) -> None:
        """Column widths for this terminal and these lanes (called as lanes appear)."""
        tasks = self.progress.tasks
        lane_width = max((len(t.fields.get("lane", "")) for t in tasks), default=8)
        count_width = max((2 * len(str(int(t.total or 0))) + 1 for t in tasks), default=5)
        session, memory, bar = column_widths(self.console.width, lane_width, count_width)
        self.session_column.width, self.memory_column.width, self.bar.bar_width = session, memory, bar

    def _label(self, card: str, flags: str) -> str:
        return f"{card}/{flags}" if self.shared.get(card) else flags

    def session_started(self, card: str, flags: str, attempt: int) -> None:
        # A new server has no reading yet: the previous session's figure must not stay on screen meanwhile.
        self.loading[card] = True
        label = f"{self._label(card, flags)} loading{' (restart ' + str(attempt) + ')' if attempt else ''}"
        self.progress.update(self.tasks[card], session=label, memory="mem – (loading)")

    def waiting(self, card: str, text: str) -> None:
        # On the bar while it lasts, and one line per change so a CI log shows how long the queue held it.
        text = quote.console(text)  # the scheduler's reason is text from outside the runner
        self.progress.update(self.tasks[card], session=text, memory="")
        self.console.print(f"{card}: {text}", highlight=False, markup=False)

    def session_ready(self, card: str, flags: str, ready_s: float | None, why: str | None = None) -> None:
        self.loading[card] = False
        text = (f"{self._label(card, flags)} ready in {fmt_s(ready_s)} s" if ready_s is not None
                else f"{self._label(card, flags)} did not start")
        self.progress.update(self.tasks[card], session=text, memory="" if ready_s is None else "mem –")
        if ready_s is None:
            reason = f" ({clip(why, 200)})" if why else ""
            self.console.print(quote.console(f"{card}/{flags}: server did not start{reason}"), highlight=False,
                               markup=False)

    def served_model(self, card: str, flags: str, line: str) -> None:
        self.console.print(quote.console(line), highlight=False, markup=False)

    def sending(self, step: Step, sends: int) -> None:
        times = f" ×{sends}" if sends > 1 else ""
        self.progress.update(self.tasks[step.card], session=f"{self._label(step.card, step.flags)} "
                                                             f"{refs_text(step.references)} seed {step.seed}{times}")

    def step_done(self, record: StepRecord) -> None:
        # Only decided steps count: one skipped for a passing reason (run interrupted, GPU held, restart budget
        # used) is still to do, and a bar at 40/40 after Ctrl-C would say the opposite.
        if decided(record):
            self.progress.advance(self.tasks[record.card])
        self.console.print(quote.console(step_line(record)), highlight=False, markup=False)

    def diagnosis_started(self, card: str, flags: str, at: str) -> None:
        self.progress.update(self.tasks[card], session=f"{self._label(card, flags)} diagnosis ({at})", memory="")

    def diagnosis_done(self, record: DiagnosisRecord) -> None:
        what = f"allocator snapshot {record.snapshot}" if record.snapshot else (record.why_none or "no snapshot")
        at = f"{record.at}, {refs_text(record.references)}"
        took = "" if record.outcome == NOT_RUN else f" in {fmt_s(record.total_s)} s"
        self.console.print(quote.console(f"{record.key}: diagnosis pass ({at}){took}: {record.outcome}; {what}"),
                           highlight=False, markup=False)

    def soak_started(self, card: str, flags: str, done: int, planned: int) -> None:
        with self.lock:
            task = next(t for t in self.progress.tasks if t.id == self.tasks[card])
            self.soaks[card] = planned
            self.progress.update(self.tasks[card], total=(task.total or 0) + planned - done,
                                 session=f"{self._label(card, flags)} soak {done}/{planned}")
        resumed = f", resuming at request {done + 1}" if done else ""
        self.console.print(quote.console(f"{card}/{flags}: soak: {planned - done} request(s) to send{resumed}"),
                           highlight=False, markup=False)

    def soak_request(self, record: SoakRequest) -> None:
        card, flags = record.key.split("/", 1)
        self.progress.advance(self.tasks[card])
        self.progress.update(self.tasks[card], session=f"{self._label(card, flags)} soak {record.number}/"
                                                       f"{self.soaks.get(card, '?')}")
        self.console.print(quote.console(soak_line(record)), highlight=False, markup=False)

    def soak_finished(self, card: str, flags: str, stopped: str | None, line: str | None, sent: int) -> None:
        if stopped in SOAK_ENDS:  # the requests it will never send are not left to do
            with self.lock:
                task = next(t for t in self.progress.tasks if t.id == self.tasks[card])
                self.progress.update(self.tasks[card], total=(task.total or 0) - (self.soaks.get(card, sent) - sent))
        self.console.print(quote.console(soak_end_line(card, flags, stopped, line, sent)), highlight=False,
                           markup=False)

    def memory(self, card: str, device_bytes: int | None) -> None:
        value = "–" if device_bytes is None else fmt_bytes(device_bytes)
        self.progress.update(self.tasks[card], memory=f"mem {value}{' (loading)' if self.loading.get(card) else ''}")

    def lane_done(self, lane: str) -> None:
        task = next(t for t in self.progress.tasks if t.id == self.tasks[lane])
        left = int((task.total or 0) - task.completed)
        self.progress.update(self.tasks[lane], session="done" if left <= 0 else f"stopped: {left} left to do",
                             memory="")
