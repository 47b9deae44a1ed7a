"""The soak's words: report.md's Soak section per card, every sentence from the card's soak findings
(runner.judge.findings.soak), which are a pure function of the soak records. Pure."""

from __future__ import annotations

from runner.core.units import clip, fmt_s, refs_text
from runner.judge.findings.models import CardSoak, Drift, SoakFindings
from runner.judge.findings.soak import failure_words
from runner.judge.verdict_text import BOUND_WORDS, size
from runner.observe import quote

md, code = quote.markdown, quote.code


def _interval(d: Drift, unit: str) -> str:
    if d.low is None or d.high is None:
        return f"no interval: {d.points} request(s) are too few for one"
    held = "" if d.distinguishable else ", not distinguishable from 0"
    return f"95 % interval {unit_text(d.low, unit)} to {unit_text(d.high, unit)}{held}"


def unit_text(value: float, unit: str) -> str:
    """A drift's figure: bytes as the report writes them (B, KiB, MiB, GiB), seconds to 3 significant digits."""
    return size(round(value)) if unit == "bytes" else f"{value:.3g} s"


def drift_text(d: Drift, unit: str) -> str:
    """"2.00 MiB per request (95 % interval 1.90 MiB to 2.10 MiB, 21 requests)"."""
    return f"{unit_text(d.per_request, unit)} per request ({_interval(d, unit)}; {d.points} requests)"


def _outcome(f: SoakFindings) -> str:
    if f.outcome == "failed":
        served = f"; {f.served} request(s) served before it" if f.failure is not None else ""
        return (failure_words(f) or "failed") + served
    if f.outcome == "incomplete":
        return (f"interrupted after {f.sent} of {f.planned} requests, none failed: a resume continues it (an "
                "interrupted soak is no failure)")
    if f.outcome == "not run":
        return f"not run: {md(f.why or f.stopped or 'no request was sent')}"
    if f.stopped == "minutes":
        return f"held {f.served} requests in its {f.minutes:g} min ({f.planned} asked), none failed"
    return f"held all {f.served} requests, none failed"


def _memory(f: SoakFindings) -> list[str]:
    out = []
    if f.floor_source is not None and f.first_floor_bytes is not None:
        bound = BOUND_WORDS.get(f.floor_bound or "", f.floor_bound or "")
        text = (f"The level after each request ({md(f.floor_source)}, {bound}) went from "
                f"{size(f.first_floor_bytes)} after the first served request to {size(f.last_floor_bytes)} after "
                f"the last")
        out.append(text + (f"; drift {drift_text(f.floor_drift, 'bytes')}." if f.floor_drift else "."))
    elif f.served:
        out.append("No device source read the level after a request.")
    if f.peak_source is not None and f.highest_peak_bytes is not None:
        text = f"Request peaks ({md(f.peak_source)}) reached {size(f.highest_peak_bytes)}"
        text += f"; drift {drift_text(f.peak_drift, 'bytes')}" if f.peak_drift else ""
        if f.to_capacity is not None and f.capacity_bytes is not None:
            text += (f"; at that drift a peak reaches the card's {size(f.capacity_bytes)} within "
                     f"{f.to_capacity} more request(s)" if f.to_capacity else
                     f"; the last peaks were at the card's {size(f.capacity_bytes)} already")
        out.append(text + ".")
    elif f.served:
        out.append("No device source read a request's peak.")
    if f.above_cells:
        out.append("In service a request peaked above its matrix cell (same source): " + "; ".join(
            f"{refs_text(a.references)} {size(a.peak_bytes)} at request {a.number} against "
            f"{size(a.cell_peak_bytes)} (+{size(a.peak_bytes - a.cell_peak_bytes)}"
            + (f"; the level before it {size(a.level_before_bytes)}, what earlier requests left)"
               if a.level_before_bytes is not None else ")") for a in f.above_cells) + ".")
    return out


def _latency(f: SoakFindings) -> str | None:
    if f.latency_p50_s is None:
        return None
    text = (f"Latency over {f.served} served request(s): p50 {fmt_s(f.latency_p50_s)} s, p95 "
            f"{fmt_s(f.latency_p95_s)} s, max {fmt_s(f.latency_max_s)} s")
    return text + (f"; drift {drift_text(f.latency_drift, 'seconds')}." if f.latency_drift else ".")


def flag_soak_lines(flags: str, f: SoakFindings) -> list[str]:
    """One soaked flag set: its outcome, then its level, peak and latency figures."""
    restarts = f" over {f.starts} server starts (a resume starts a fresh one)" if f.starts > 1 else ""
    head = f"**{md(flags)}** ({md(f.chosen)}): {_outcome(f)}{restarts}."
    if f.failure is not None and f.failure.server_says:
        head += f" The server said: {code(clip(f.failure.server_says, 240))}."
    return [head, *_memory(f), *[x for x in (_latency(f),) if x]]


def soak_lines(card: CardSoak) -> list[str]:
    """report.md's Soak section for one card."""
    counts = ", ".join(refs_text(n) for n in card.references)
    order = "ascending, repeated" if card.order == "cycle" else "in a seeded random order per round"
    bound = f" or {card.minutes:g} min" if card.minutes is not None else ""
    lines = [f"Each soaked flag set got up to {card.requests} requests{bound} on one fresh server start after the "
             f"card's sessions, one at a time, mixing {counts} ({order}); it stops at its first failure. Its "
             "figures are its own records (`soak/requests.jsonl`), never a matrix cell's; a drift is a least-squares "
             "slope within each server start and reference count, over the requests that brought no reference "
             "their server had not seen (a cache filling once is not creep).", ""]
    if card.not_soaked:
        return [*lines, f"No flag set was soaked: {md(card.not_soaked)}."]
    for flags, f in card.flag_sets.items():
        lines += [f"- {' '.join(flag_soak_lines(flags, f))}"]
    return lines
