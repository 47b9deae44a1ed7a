"""The verdict's words, rendered in one place from the typed decision (runner.judge.verdict) and its findings:
the full reason (verdict.json, report), each flag set's stop in a few words, the one-line summary the
report's first table and the console share, and the Findings sentences of report.md.

Pure; reads the typed records only, so console, report and compare say a flag set's stop the same way."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from runner.core.units import clip, fmt_bytes, fmt_s, refs_text
from runner.judge.decision import fmt_ratio
from runner.judge.findings.models import MIN_PAIRS
from runner.observe import quote
from runner.observe.failures import without_stamp

if TYPE_CHECKING:
    from runner.judge.decision import Blocked, Cell, Decision, Verdict
    from runner.judge.findings.models import AlsoKind, CachedSpeed, Functional, MemoryModel, OomFacts, Retention
    from runner.plan.matrix import VerdictRules

SUMMARY_LIMIT = 300


def label(b: Blocked) -> str:
    return f"default '{b.flags}'" if b.role == "default" else f"offload '{b.flags}'"


def wall(cell: Cell) -> str:
    if cell.wall_s is None:
        return "no timed send"
    spread = (f" [{fmt_s(cell.wall_min_s)}–{fmt_s(cell.wall_max_s)}]" if cell.wall_samples > 1 else "")
    return f"{fmt_s(cell.wall_s)} s/request{spread} (median of {cell.wall_samples})"


def psnr(cell: Cell) -> str:
    if cell.baseline:
        return "the baseline cell (its images are the reference)"
    return f"PSNR {cell.psnr_db} dB" if cell.psnr_db is not None else "no PSNR (no baseline image)"


def peak(peak_bytes: int | None, source: str | None) -> str:
    """A cell's device peak for a sentence, or that there is none: never a figure it does not have."""
    return f"peak {fmt_bytes(peak_bytes)} ({source})" if peak_bytes is not None else "no device-memory figure"


def host_peak(host_bytes: int | None) -> str:
    return f"host peak {fmt_bytes(host_bytes)}" if host_bytes is not None else "no host-memory figure"


def reason(d: Decision, roles: dict[str, str], rules: VerdictRules) -> str:
    """The whole reason: what decided the card and why each default and offload flag set did or did not."""
    target = rules.target_references
    counted = [b for b in d.stops if rules.decides_world(b.role)]
    if d.world == "fits-resident" and d.cell is not None:
        c = d.cell
        return (f"default flag set '{d.flags}' serves {target} reference(s): {peak(c.peak_bytes, c.peak_source)}, "
                f"{wall(c)}, {psnr(c)}")
    if d.world == "offload-works" and d.cell is not None:
        c = d.cell
        defaults = [b for b in d.stops if b.role == "default"]
        vs = ("; ".join(f"default '{b.flags}' does not serve it: {b.text()}" for b in defaults)
              or "no default flag set in the matrix")
        judged = d.latency.text() if d.latency is not None else \
            "latency not judged (no reference: default served nothing, no baseline wall time)"
        return (f"offload flag set '{d.flags}' serves {target} reference(s): {peak(c.peak_bytes, c.peak_source)}, "
                f"{host_peak(c.host_peak_bytes)}, {wall(c)}, {judged}, {psnr(c)}; {vs}")
    if d.world == "undecided":
        unknown = [b for b in counted if b.stop == "unknown"]
        decided = [f"{label(b)} stopped by {b.stop}: {b.text()}" for b in counted if b.stop not in ("unknown",
                                                                                                  "served")]
        return "cannot tell — " + "; ".join(f"{label(b)}: {b.text()}" for b in unknown) + "".join(
            f"; {x}" for x in decided)
    parts = [f"{label(b)}: {b.text()}" for b in counted]
    if "default" not in roles.values():
        parts.insert(0, "no default flag set")
    if not any(r in rules.offload_roles for r in roles.values()):
        parts.append("no offload flag set")
    return "; ".join(parts)


def stop_words(b: Blocked, brief: bool = False) -> str:
    """A flag set's stop in a few words — the same on the console and in the report. `brief` keeps a served
    latency to its ratio ("latency 0.97×"): the summary's form when the full words would not fit."""
    n = b.references
    oom = "host-memory OOM" if b.memory == "host" else "OOM"  # the kernel's OOM killer: not the card's memory
    return {
        "oom-at-load": f"{oom} at load",
        "oom": f"{oom} at {refs_text(n)}" + (f" ({b.detail})" if b.detail else ""),
        "start": f"did not start ({b.detail})",
        "broken": f"broken output from {refs_text(n)}",
        "low-psnr": f"{b.detail} from {refs_text(n)}",
        "slow": f"latency {b.detail}",
        "straddles": f"latency {b.detail}",
        "failure": f"{b.detail} at {refs_text(n)}",
        "skipped": f"skipped at {refs_text(n)}",
        "absent": (f"{b.detail}; " if b.detail else "") + f"{refs_text(n)} not in the run",
        "served": f"serves {refs_text(n)}",
        "measured": f"serves {refs_text(n)}, latency "
                    + (str(b.detail).split(" ", 1)[0] if brief else str(b.detail)),
        "unmetered": f"serves {refs_text(n)}, no device-memory figure",
    }.get(b.cause, b.stop.value)


def summary(v: Verdict) -> str:
    """The report table's "why" and the console line's body: the deciding flag set, then every other flag
    set's stop in a few words ("default OOM at 3 refs; cpu-offload OOM at 3 refs; layerwise latency 2.71× >
    2.5"). The evidence is below the table, in the card's section."""
    head = []
    ev = v.evidence
    if v.flags:  # the deciding flag set first, with its figure or the words that it has none
        lat = v.latency
        vs = ""
        if lat is not None:
            whose = "the baseline's recorded" if lat.reference.startswith("the baseline") else "the default's"
            vs = f", {fmt_ratio(lat.ratio)} {whose} latency at {refs_text(lat.references)} ({lat.measure})"
        at = f"at peak {fmt_bytes(ev.peak_bytes)}" if ev.peak_bytes is not None else "with no device-memory figure"
        wall_s = f", {fmt_s(ev.wall_s)} s/request at {v.target_references}" if ev.wall_s is not None else ""
        head.append(f"{v.flags} serves {refs_text(v.target_references)} {at}{wall_s}{vs}{_headroom(v) or ''}"
                    + (f"; its soak {v.soak}" if v.soak else ""))
    unknown = [b for b in v.stops if b.stop == "unknown"] if v.world == "undecided" else []
    if unknown:  # what blocked it, its record and the server's own line first: the part a reader needs
        head.append("cannot tell — " + "; ".join(
            f"{b.flags} {stop_words(b)}" + (f" [{b.record}]" if b.record else "")
            + (f": {clip(without_stamp(b.server_says[0]), 160)}" if b.server_says else "") for b in unknown))
    others = [b for b in v.stops if b not in unknown]
    if not head and not others:  # a verdict without typed stops (hand-built, or of an earlier runner)
        return clip(v.reason, SUMMARY_LIMIT)
    full = "; ".join(head + [f"{b.flags} {stop_words(b)}" for b in others])
    if len(full) <= SUMMARY_LIMIT:
        return full
    # too long to read at a glance: every flag set still named, the others' figures kept to their ratio
    return clip("; ".join(head + [f"{b.flags} {stop_words(b, brief=True)}" for b in others]), SUMMARY_LIMIT)


def _headroom(v: Verdict) -> str | None:
    if v.findings is None or v.flags is None or v.flags not in v.findings.flag_sets:
        return None
    m = v.findings.flag_sets[v.flags].memory
    if m.shortfall_bytes is None or m.shortfall_bytes > 0:
        return None
    return f", headroom {fmt_bytes(-m.shortfall_bytes)}"


def console_line(v: Verdict) -> str:
    head = f"{v.card}: {v.world}" + (f" ({v.flags})" if v.flags else "")
    return f"{head} — {summary(v)}"


def stops_text(stops: Sequence[Blocked]) -> str:
    return "; ".join(f"{b.flags} {stop_words(b)}" for b in stops)


# --- Findings: the seed's analysis, as sentences over the records --------------------------------------

code, md = quote.code, quote.markdown  # report.md: what came from a record or a server renders as itself

CAPACITY_WORDS = {"oom-allowed": "the per-process cap its OOM message states",
                  "oom-total": "the GPU capacity its OOM message states", "card": "the card's vram"}


def size(value: int | None) -> str:
    """Bytes for a sentence: whole bytes and KiB below a MiB (an OOM's "193.00 KiB", a residual of 0 B), else
    units.fmt_bytes (MiB, GiB) as the tables print them."""
    if value is None:  # callers say a figure only where they have one: never a "?" in a sentence
        return "an unknown amount"
    if abs(value) < 1024:
        return f"{value} B"
    if abs(value) < 2**20:
        return f"{value / 1024:.2f} KiB"
    return fmt_bytes(value)


def _where(oom: OomFacts) -> str:
    return f"at {refs_text(oom.references)}"  # "at load" when the OOM came at load


def _load_need(oom: OomFacts, capacity_source: str | None) -> tuple[int, str] | None:
    """What a load OOM already held, on the capacity's own basis: under a per-process cap PyTorch's reserved
    memory (allocated + reserved but unallocated) counts against it; against the GPU's total, the process's
    whole use (non-PyTorch memory included)."""
    if oom.tried_bytes is None or oom.capacity_bytes is None:
        return None
    if capacity_source == "oom-allowed":
        if oom.allocated_bytes is None or oom.reserved_unallocated_bytes is None:
            return None
        return oom.allocated_bytes + oom.reserved_unallocated_bytes, "reserved by PyTorch"
    return (oom.in_use_bytes, "in use") if oom.in_use_bytes is not None else None


def _oom_sentence(flags: str, m: MemoryModel) -> str | None:
    oom = m.oom
    if oom is None:
        return None
    if oom.memory == "host":  # no allocator figures, and the card's memory line says nothing of it
        return (f"It ran out of host memory {_where(oom)}: the kernel's OOM killer ended the server (the "
                "container's memory limit or the machine's RAM), not device memory.")
    parts = [f"tried to allocate {size(oom.tried_bytes)}"] if oom.tried_bytes is not None else []
    if oom.allocated_bytes is not None:
        parts.append(f"{size(oom.allocated_bytes)} allocated by PyTorch")
    if oom.reserved_unallocated_bytes is not None:
        parts.append(f"{size(oom.reserved_unallocated_bytes)} reserved but unallocated")
    site = f" in {code(oom.site)} ({code(oom.function)})" if oom.site else \
        f" (no site: {md(oom.no_site or 'none recorded')})"
    text = f"It ran out of memory {_where(oom)}{site}" + (": " + ", ".join(parts) if parts else "") + "."
    if oom.references is None and (need := _load_need(oom, m.capacity_source)) is not None:
        held, cap = need[0], oom.capacity_bytes or 0
        total = held + (oom.tried_bytes or 0)
        text += f" Loading needs at least {size(total)} ({size(held)} {need[1]} + {size(oom.tried_bytes)})"
        if total > cap:
            text += f" against {size(cap)} usable: short by at least {size(total - cap)}."
        else:  # within the capacity: what ran out was held outside this process (other processes on the GPU)
            free = f" and {size(oom.free_bytes)} free" if oom.free_bytes is not None else ""
            text += (f", within the {size(cap)} the message states{free}: the rest was held outside this "
                     "process (other processes on the GPU), not by this load.")
    fixed, slope = m.fixed_bytes, m.per_reference_bytes
    if oom.references is not None and fixed is not None and slope is not None and m.capacity_bytes is not None:
        at_oom = fixed + slope * oom.references
        if at_oom <= m.capacity_bytes:
            margin = m.capacity_bytes - at_oom
            text += (f" The line does not explain that OOM: it gives {size(at_oom)} at {refs_text(oom.references)}, "
                     f"{size(margin)} within {size(m.capacity_bytes)}")
            ru = oom.reserved_unallocated_bytes
            text += (f"; the {size(ru)} reserved but unallocated at the OOM is more than that margin: "
                     f"fragmentation decided it." if ru is not None and ru > margin else
                     "; the OOM's own figures are the evidence there.")
    return text


def flag_set_sentence(flags: str, role: str, m: MemoryModel) -> str:
    """One flag set's memory in plain sentences: load, what one more reference costs, the target against
    the capacity that binds, and the OOM that stopped it."""
    out = [f"**{md(flags)}** ({md(role)}):"]
    if m.load_peak_bytes is not None:
        out.append(f"loads at {size(m.load_peak_bytes)};")
    bare = [n for n in m.answered if n not in {p.references for p in m.peaks}]  # an image, no device figure
    if m.peaks:
        first, last = m.peaks[0], m.peaks[-1]
        span = (f"peaks at {size(first.bytes)} with {refs_text(first.references)}" if first is last else
                f"peaks at {size(first.bytes)} with {refs_text(first.references)} up to {size(last.bytes)} "
                f"with {refs_text(last.references)}")
        out.append(f"{span} ({md(m.source)}).")
        if bare:
            out.append(f"No device-memory figure at {counts(bare)}" + (f": {md(m.no_peak)}." if m.no_peak else "."))
    elif bare:  # images came back: what is missing is the memory figure, said from the records
        out.append(f"requests came back with images at {counts(bare)}, but with no device-memory figure"
                   + (f": {md(m.no_peak)}." if m.no_peak else "."))
    else:
        out.append("no request came back with an image, so no peak per reference count.")
    if m.per_reference_bytes is not None:
        out.append(f"One more reference costs {size(m.per_reference_bytes)} (least squares over "
                   f"{m.points} counts: fixed {size(m.fixed_bytes)}, worst residual "
                   f"{size(m.worst_residual_bytes)}).")
    elif m.peaks:
        out.append(f"With {m.no_line}.")
    if m.predicted_peak_bytes is not None and m.capacity_bytes is not None and m.shortfall_bytes is not None:
        t = m.target_references
        if m.predicted_from == "measured":
            need = f"At {refs_text(t)} it peaks at {size(m.predicted_peak_bytes)}"
        else:
            need = (f"At {refs_text(t)} the line gives {size(m.predicted_peak_bytes)} "  # the line's own sum
                    f"({size(m.fixed_bytes)} fixed + {t} × {size(m.per_reference_bytes)})")
        gap = (f"short by {size(m.shortfall_bytes)}" if m.shortfall_bytes > 0
               else f"{size(-m.shortfall_bytes)} of headroom")
        out.append(f"{need} against {size(m.capacity_bytes)} usable "
                   f"({CAPACITY_WORDS.get(m.capacity_source or '', m.capacity_source)}): {gap}.")
    if (said := _oom_sentence(flags, m)) is not None:
        out.append(said)
    return " ".join(out)


def counts(ns: Sequence[int]) -> str:
    """Reference counts in words: "2 refs", "1 ref and 2 refs", "1 ref, 2 refs and 4 refs"."""
    said = [refs_text(n) for n in ns]
    return said[0] if len(said) == 1 else ", ".join(said[:-1]) + " and " + said[-1]


def _functional(f: Functional) -> str:
    if f.works:
        return (f"The reference path works: {code(f.record)} ({md(f.flags)}, {refs_text(f.references)}) was the first "
                f"request with references to come back with a usable image.")
    if f.works is False and f.server_says is None:
        return (f"No request with references came back with a usable image: {code(f.record)} ({md(f.flags)}, "
                f"{refs_text(f.references)}) was the first to come back, {md(f.why)}.")
    if f.works is False:
        return (f"Requests with references fail before memory is the question: {code(f.record)} ({md(f.flags)}, "
                f"{refs_text(f.references)}); the server says {code(clip(f.server_says or '', 200))}.")
    return ("No request with references came back with an image, and every failure was out of memory: "
            "whether the reference path works is not known on this card.")


def _sites(v: Verdict) -> list[str]:
    assert v.findings is not None
    out = []
    for c in v.findings.contribution_sites:
        who = ", ".join(f"{md(f)} at {refs_text(n)}"
                        + (f" (tried {size(t)})" if t is not None else "")
                        for f, n, t in zip(c.flag_sets, c.references, c.tried_bytes, strict=True))
        out.append(f"- {code(c.site)} in {code(c.function)} stopped {who}.")
    return out


def findings_lines(v: Verdict) -> list[str]:
    """report.md's Findings for one card: plain sentences with the numbers, every one from the records."""
    f = v.findings
    if f is None:
        return []
    lines = [_functional(f.functional), ""]
    order = [x for x in [v.flags, *(b.flags for b in v.stops)] if x and x in f.flag_sets]
    lines += [f"- {flag_set_sentence(x, f.flag_sets[x].role, f.flag_sets[x].memory)}" for x in order]
    sites = _sites(v)
    if v.world == "not-built":
        lines += ["", "Where a fix would go (the distinct OOM sites that stopped its default and offload flag "
                      "sets):" if sites else "No contribution site: no default or offload flag set was stopped "
                      "by an OOM whose traceback has a server frame" + (f" ({md(', '.join(f.no_site_ooms))})"
                                                                        if f.no_site_ooms else "") + "."]
        lines += sites
    elif sites:
        lines += ["", "OOM sites that stopped its other default and offload flag sets:", *sites]
    kept = [line for x, m in f.flag_sets.items() if (line := retention_sentence(x, m.retention, m.speed))]
    if kept:
        lines += ["", "What a request leaves behind (the level after each request against the level after the "
                      "load) and whether cached references are faster:", *(f"- {line}" for line in kept)]
    held = [(x, f.flag_sets[x].memory) for x in order if f.flag_sets[x].memory.held or f.flag_sets[x].memory.no_held]
    if held:
        lines += ["", "What held the memory (allocator snapshots of the diagnosis pass, not a measurement):"
                  if any(m.held for _, m in held) else "What held the memory (the diagnosis pass read no allocator "
                  "snapshot):"]
        lines += [f"- {line}" for line in held_lines(held)]
    if f.fragmentation:
        lines.append("")
    for fr in f.fragmentation:
        a_ru, b_ru = fr.a_reserved_unallocated_bytes, fr.b_reserved_unallocated_bytes
        tail = (f"; still short with {size(fr.b_allocated_bytes)} allocated" if fr.b_still_short
                and fr.b_allocated_bytes is not None else "; still short" if fr.b_still_short
                else f"; '{md(fr.b)}' did not run out at or below the target")
        moved = (f"took reserved-but-unallocated memory at the OOM from {size(a_ru)} to {size(b_ru)}" if a_ru != b_ru
                 else f"left reserved-but-unallocated memory at the OOM at {size(a_ru)}")
        verdict = "fragmentation was part of the problem" if a_ru > b_ru else "fragmentation was not the problem"
        lines.append(f"- Allocator settings only: '{md(fr.b)}' against '{md(fr.a)}' {moved} ({verdict}){tail}.")
    return lines


BOUND_WORDS = {"exact": "exact: the server's own live-tensor figure",
               "upper-bound": "an upper bound: a whole-device figure, the allocator's cache included"}


ALSO_WORDS = {"per-reference": "{} kept per distinct reference sent",
              "until-next-request": "the last request's references ({} each) kept until the next one",
              "per-request": "{} kept per request sent, whatever it carries (a leak)"}


def alternatives(also: Mapping[AlsoKind, int]) -> str:
    """What else the same levels read as, and why the records cannot say which."""
    said = " or ".join(ALSO_WORDS[k].format(size(v)) for k, v in also.items())
    return (f"the same levels read as well as {said}: in this order of requests the readings predict the same "
            "levels, and no retention probe's level told them apart")


def retention_sentence(flags: str, r: Retention | None, speed: CachedSpeed | None) -> str | None:
    """One flag set's retention and cached-vs-cold speed in a sentence; None when neither was read."""
    if r is None and (speed is None or not speed.pairs):
        return None
    parts = []
    if r is not None:
        src = f"{md(r.source)}, {BOUND_WORDS[r.bound]}; {r.points} request(s), {r.quiet_s:.2f} s quiet window"
        if r.kind == "freed":
            parts.append(f"freed at request end: the level after each request is within {size(r.tolerance_bytes)} "
                         f"of the load level {size(r.load_bytes)} ({src})")
        elif r.kind == "until-next-request" and r.also:
            parts.append(f"keeps {size(r.per_bytes)} per reference of the last request until the next one ({src}; "
                         f"worst residual {size(r.residual_bytes)}, load level {size(r.load_bytes)}, "
                         f"{size(r.last_floor_bytes)} after the last); {alternatives(r.also)}")
        elif r.kind == "until-next-request":
            parts.append(f"keeps {size(r.per_bytes)} per reference of the last request until the next one ({src}; "
                         f"worst residual {size(r.residual_bytes)}, load level {size(r.load_bytes)}, "
                         f"{size(r.last_floor_bytes)} after the last): sent again after the last, the "
                         f"{refs_text(r.probe_references)} request left {size(r.probe_floor_bytes)}")
        elif r.kind in ("per-reference", "per-request"):
            what = "distinct reference sent" if r.kind == "per-reference" else "request sent, whatever it carries"
            fills = "" if r.fills_card_at is None else (
                f"; what it keeps alone would fill the card at {r.fills_card_at} "
                + ("distinct references" if r.kind == "per-reference" else "requests"))
            tie = (f"; {alternatives(r.also)}" if r.also else
                   f"; sent again after the last, the {refs_text(r.probe_references)} request left "
                   f"{size(r.probe_floor_bytes)}: " + ("every distinct reference stays" if r.kind == "per-reference"
                                                       else "one request more, one leak more")
                   if r.probe_floor_bytes is not None else "")
            parts.append(f"keeps {size(r.per_bytes)} per {what} ({src}; worst residual {size(r.residual_bytes)}, "
                         f"load level {size(r.load_bytes)}, {size(r.last_floor_bytes)} after the last){fills}{tie}")
        else:
            above = "" if r.last_floor_bytes is None or r.load_bytes is None else \
                f"; {size(r.last_floor_bytes - r.load_bytes)} above the load level after the last request"
            parts.append(f"cannot tell what stays after a request: {md(r.why or 'no reading')} ({src}{above})")
    if r is not None and r.kept_bytes is not None:
        where = ", ".join(f"{size(x.bytes)} at {code(x.site)}" + (f" in {code(x.function)}" if x.function else "")
                          for x in r.kept_sites[:3])
        each = "" if not r.kept_references else f" ({size(r.kept_bytes // r.kept_references)} per reference)"
        parts.append(f"its {refs_text(r.kept_references)} request, under the allocator's history (the diagnosis "
                     f"pass), left {size(r.kept_bytes)} it allocated live at its end{each}"
                     + (f": {where}" if where else ""))
    elif r is not None and r.kept_why is not None:
        parts.append(f"what stays live after its {refs_text(r.kept_references)} request is not known by site: "
                     f"{md(clip(r.kept_why, 300))}")
    if speed is not None and speed.pairs and speed.ratio is not None:
        # the ratio is the median of the per-count ratios, not the ratio of the two medians beside it: say which
        medians = f"cold {fmt_s(speed.cold_s)} s, cached {fmt_s(speed.cached_s)} s"
        over = f"the median over {speed.pairs} reference count(s); medians {medians}"
        if speed.pairs < MIN_PAIRS:
            parts.append(f"whether a request whose references were all sent before is faster is not told by one "
                         f"reference count ({medians})")
        elif speed.faster:
            parts.append(f"a request whose references were all sent before runs {speed.ratio:.2f}× faster (cold / "
                         f"cached, {over})")
        elif speed.slower:
            parts.append(f"a request whose references were all sent before runs slower (cold / cached "
                         f"{speed.ratio:.2f}, {over})")
        else:
            reuse = ": nothing is reused across requests" if r is not None and r.kind == "freed" else ""
            parts.append(f"a request whose references were all sent before is no faster (cold / cached "
                         f"{speed.ratio:.2f}, {over}){reuse}")
    return f"'{md(flags)}': " + "; ".join(parts) + "."


def _at_site(site: str, function: str | None) -> str:
    return f"`{md(site)}" + (f" in {md(function)}`" if function else "`")


def held_lines(held: list[tuple[str, MemoryModel]]) -> list[str]:
    """One sentence per distinct reading, each naming its flag sets and snapshot files: flag sets whose
    snapshots say the same (the 16 GiB card's load OOM under every flag set) share one."""
    groups: dict[str, list[tuple[str, str | None]]] = {}
    for flags, m in held:
        groups.setdefault(_held_reading(m), []).append((flags, m.held.file if m.held is not None else None))
    out = []
    for reading, members in groups.items():
        names = ", ".join(f"'{md(f)}'" for f, _ in members)
        same = " (the same reading)" if len(members) > 1 else ""
        files = [f for _, f in members if f]
        snap = ("" if not files else f" Snapshot: `{md(files[0])}` (opens in pytorch.org/memory_viz)."
                if len(files) == 1 else " Snapshots (open in pytorch.org/memory_viz): "
                + ", ".join(f"`{md(f)}`" for f in files) + ".")
        out.append(f"{names}{same}: {reading}{snap}")
    return out


def held_sentence(flags: str, m: MemoryModel) -> str:
    """One flag set's held memory at its OOM (or peak), as report.md says it."""
    return held_lines([(flags, m)])[0]


def _held_reading(m: MemoryModel) -> str:
    """A flag set's held memory at its OOM (or peak) in plain words, with what each move would buy (no name,
    no snapshot file: held_lines adds them)."""
    if m.held is None:
        why = m.no_held.why if m.no_held is not None else "no snapshot"
        return f"{md(why)}."
    h = m.held
    moment = ("at load" if h.references is None else f"at the {h.references}-reference OOM") if h.at == "oom" \
        else f"at the {h.references}-reference peak"
    if h.resident_bytes is not None and h.request_bytes is not None:
        text = (f"{moment}, {size(h.resident_bytes)} of the {size(h.active_bytes)} held were resident "
                f"before the request")
        top = next((s for s in h.by_site if s.phase == "request" and s.site != "other sites" and s.part is None),
                   None)
        if h.references is None:
            text = f"{moment}, the load held {size(h.active_bytes)}"
        elif top is not None:
            text += (f"; the request's largest live allocation was {size(top.bytes)} at "
                     f"{_at_site(top.site, top.function)} ({size(h.request_bytes)} allocated by the request in all)")
        else:
            text += f"; the request held {size(h.request_bytes)}"
        if h.references is not None:
            text += "".join(f"; {size(n.bytes)} of the request's bytes were the server's {md(n.name)}"
                            for n in h.named if n.phase == "request")
    else:
        text = f"{moment}, {size(h.active_bytes)} were held (resident and request not told apart)"
    if h.tried_bytes is not None and h.at == "oom":
        text += f"; the failed allocation tried {size(h.tried_bytes)}"
    if h.inactive_bytes:
        text += f"; {size(h.inactive_bytes)} sat in segments unallocated (fragmentation)"
    if h.outside_pytorch_bytes:
        text += f"; {size(h.outside_pytorch_bytes)} was outside PyTorch's allocator (CUDA context, libraries)"
    text += "."
    if not any(s.site != "no frames recorded" for s in h.by_site):
        text += " No frames recorded: no sites."
    moves = list(h.counterfactuals)
    if moves and moves[0].shortfall_bytes is not None:
        short = moves[0].shortfall_bytes
        if short <= 0:
            text += f" Under the cap it was {size(-short)} from fitting the failed allocation (fragmentation aside)."
        else:
            said = "; ".join(f"moving {md(c.move)} frees {size(c.frees_bytes)}: "
                             f"{'enough for the failed allocation' if c.enough else 'not enough on its own'}"
                             for c in moves)
            text += f" Against a shortfall of at least {size(short)}: {said}."
    if h.growth:
        g = h.growth[0]
        others = "".join(f", {_at_site(o.site, o.function)} {size(o.per_reference_bytes)}" for o in h.growth[1:3])
        text += (f" What one more reference adds ({g.from_references} → {g.to_references} references, two "
                 f"snapshots): {_at_site(g.site, g.function)} grows most, {size(g.per_reference_bytes)} per "
                 f"reference{others}.")
    if h.at == "oom" and (o := m.oom) is not None and h.tried_bytes is not None and o.tried_bytes is not None \
            and h.tried_bytes != o.tried_bytes:
        # A fresh server (the diagnosis pass) need not fail where the measured send did, after other requests.
        where = f" at {_at_site(o.site, o.function)}" if o.site else ""
        text += (f" The diagnosis pass (a fresh start, this request alone) failed at another allocation than the "
                 f"measured send, which asked {size(o.tried_bytes)}{where}.")
    return text

