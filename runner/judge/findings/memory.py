"""The memory model of one card × flag set, a pure function of its records: the load peak; the peak per
served reference count and a least-squares line through them (fixed working set + marginal bytes per
reference, with the number of points and the worst residual); the peak predicted at the target and the
shortfall (or headroom, negative) against the capacity that binds.

The capacity that binds: the deciding OOM's own figure where its message has one — the per-process cap
("… allowed") or else the GPU's total capacity — and otherwise the card's `vram_gib`. A per-process cap is
PyTorch's allocator limit; when the peaks come from a whole-device source (NVML, dcgm, …), which counts the
CUDA context too, the memory the OOM saw in use outside PyTorch's allocator is added to the cap, so peak and
capacity measure the same thing.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from operator import attrgetter

from runner.core.records import Failure, FailureClass, OomReport, Peak, SessionRecord, Status, StepRecord
from runner.core.registry import METERS
from runner.core.units import clip, fmt_bytes
from runner.judge.findings.models import CountPeak, MemoryModel, OomFacts

# Sources that read the whole device (runner.meters.reconcile.WHOLE_DEVICE; pure modules do not import meters).
WHOLE_DEVICE = frozenset({"nvml", "sidecar", "dcgm", "prometheus"})
UNLISTED = frozenset(e.name for e in METERS.entries() if not e.listed)  # a figure the response carries


def _reported(reason: str) -> str:
    """A response peak's reason, what was said first: "the server reported 0.0 (not measured) at
    choices[0].message.content[0].peak_memory_mb"."""
    place, sep, said = reason.removeprefix("unavailable: ").partition(": ")
    return f"{said} at {place}" if sep and said.startswith("the server reported") else reason.removeprefix(
        "unavailable: ")


def no_device_figure(steps: Iterable[StepRecord]) -> str | None:
    """Why the steps that came back with an image have no device-memory figure, in words from their records:
    what the server reported in its responses (vLLM-Omni's 0.0 or null: "not measured"), what each device
    source of the card said, and that none of them reads the whole device when none does. None when every
    such step has a figure (or none came back)."""
    bare = [s for s in steps if s.status == Status.OK and _device(s.peaks) is None]
    if not bare:
        return None
    device = [p for s in bare for p in s.peaks if p.metric == "device"]
    reported = [p.reason for p in device if p.source in UNLISTED and p.reason]
    said = {p.source: p.reason or "no reading" for p in device if p.source not in UNLISTED}
    parts = [" / ".join(dict.fromkeys(_reported(r) for r in reported))] if reported else \
        ["the responses carried no peak of their own"]
    if said:
        parts.append("no meter read the device (" + "; ".join(
            f"{src}: {clip(why.removeprefix('unavailable: '), 240)}" for src, why in said.items()) + ")")
    listed = {p.source for s in bare for p in s.peaks}
    if not listed & WHOLE_DEVICE:
        parts.append("none of the card's meters reads the whole device (nvml, sidecar, dcgm, prometheus)")
    return "; ".join(parts)


def _device(peaks: tuple[Peak, ...], source: str | None = None) -> tuple[int, str] | None:
    for p in peaks:
        if p.metric == "device" and p.available and p.bytes is not None and source in (None, p.source):
            return p.bytes, p.source
    return None


def load_peak(session: SessionRecord | None) -> int | None:
    """The highest device reading while the last start loaded (first available source in meter order)."""
    if session is None or not session.starts:
        return None
    found = _device(session.starts[-1].load_peaks)
    return found[0] if found else None


def deciding_oom(steps: Sequence[StepRecord], session: SessionRecord | None, target: int) -> OomFacts | None:
    """The OOM that decided a flag set, by the verdict's rule: an OOM at load, else the OOM a skip at the
    target names (implied_by), else the first OOM at or below the target."""
    if session is not None and (f := session.start_failure) is not None:
        return _facts(session.key, None, f) if f.kind == FailureClass.OOM_AT_LOAD else None
    mine = sorted(steps, key=attrgetter("references", "fixture", "seed"))
    by_key = {s.key: s for s in mine}
    named = [by_key[s.implied_by] for s in mine if s.references == target and s.implied_by in by_key]
    oom = next((s for s in named + mine if s.references <= target and s.failure
                and s.failure.kind == FailureClass.OOM), None)
    return _facts(oom.key, oom.references, oom.failure) if oom is not None and oom.failure else None


def _facts(record: str, references: int | None, failure: Failure) -> OomFacts:
    o = failure.oom
    if o is None:  # a record of an earlier runner, or an OOM kind without PyTorch's text (the kernel's killer)
        return OomFacts(record=record, references=references, no_site="the failure record carries no OOM message "
                                                                      "taken apart")
    return OomFacts(record=record, references=references, memory=o.memory, site=o.site, function=o.function,
                    tried_bytes=o.tried_bytes, allocated_bytes=o.allocated_bytes,
                    reserved_unallocated_bytes=o.reserved_unallocated_bytes, in_use_bytes=o.in_use_bytes,
                    free_bytes=o.free_bytes, capacity_bytes=o.binding_bytes, no_site=o.no_site)


def fit(points: list[tuple[int, int]]) -> tuple[float, float, float]:
    """Least squares peak = fixed + slope × references → (fixed, slope, worst |residual|)."""
    xs, ys = [float(x) for x, _ in points], [float(y) for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    fixed = my - slope * mx
    return fixed, slope, max(abs(y - (fixed + slope * x)) for x, y in zip(xs, ys, strict=True))


def capacity(o: OomReport | None, source: str | None, card_bytes: int | None) -> tuple[int | None, str | None]:
    if o is not None:
        if o.allowed_bytes is not None:
            in_use, allocated, unallocated = o.in_use_bytes, o.allocated_bytes, o.reserved_unallocated_bytes
            if source in WHOLE_DEVICE and in_use is not None and allocated is not None and unallocated is not None:
                outside = max(in_use - allocated - unallocated, 0)
                return o.allowed_bytes + outside, "oom-allowed"
            return o.allowed_bytes, "oom-allowed"
        if o.capacity_bytes is not None:
            return o.capacity_bytes, "oom-total"
    return (card_bytes, "card") if card_bytes else (None, None)


def memory_model(steps: Sequence[StepRecord], session: SessionRecord | None, target: int,
                 card_bytes: int | None) -> MemoryModel:
    """The model of one flag set's records on one card (steps of that flag set only)."""
    oom = deciding_oom(steps, session, target)
    failure_oom = _oom_report(steps, session, oom)
    served = [s for s in steps if s.status == Status.OK]  # an image came back: its memory is real either way
    sources = Counter(found[1] for s in served if (found := _device(s.peaks)))
    source = sources.most_common(1)[0][0] if sources else None
    by_count: dict[int, list[int]] = {}
    for s in served:
        if (found := _device(s.peaks, source)) is not None:
            by_count.setdefault(s.references, []).append(found[0])
    peaks = tuple(CountPeak(references=n, bytes=max(v), steps=len(v)) for n, v in sorted(by_count.items()))
    cap, cap_source = capacity(failure_oom, source, card_bytes)
    fixed = slope = worst = None
    no_line = None
    if len(peaks) >= 2:
        fixed, slope, worst = (round(v) for v in fit([(p.references, p.bytes) for p in peaks]))
        if slope < 0 or fixed < 0:  # memory that shrinks with more references, or a negative working set
            no_line = (f"peaks that fall as references rise (a least-squares {'slope' if slope < 0 else 'fixed size'}"
                       f" of {fmt_bytes(slope if slope < 0 else fixed)}): a line that does not describe the data, "
                       "not used to predict")
            fixed = slope = worst = None
    else:
        no_line = f"{'one served reference count' if peaks else 'no served step'} with a device peak: no slope"
    at_target = next((p.bytes for p in peaks if p.references == target), None)
    predicted, how = (at_target, "measured") if at_target is not None else \
        (fixed + slope * target, "line") if fixed is not None and slope is not None else (None, None)
    return MemoryModel(source=source, load_peak_bytes=load_peak(session), peaks=peaks,
                       answered=tuple(sorted({s.references for s in served})), no_peak=no_device_figure(served),
                       target_references=target,
                       predicted_peak_bytes=predicted, predicted_from=how, capacity_bytes=cap,
                       capacity_source=cap_source,
                       shortfall_bytes=None if predicted is None or cap is None else predicted - cap,
                       oom=oom, fixed_bytes=fixed, per_reference_bytes=slope, points=len(peaks),
                       worst_residual_bytes=worst, no_line=no_line)


def _oom_report(steps: Sequence[StepRecord], session: SessionRecord | None, oom: OomFacts | None) -> OomReport | None:
    if oom is None:
        return None
    if session is not None and oom.record == session.key and session.start_failure is not None:
        return session.start_failure.oom
    step = next((s for s in steps if s.key == oom.record), None)
    return step.failure.oom if step is not None and step.failure is not None else None
