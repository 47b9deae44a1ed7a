"""What held the memory at a deciding OOM, and what moving each part off the device would buy (pure): an
allocator snapshot's reading (runner.observe.snapshot.Held) + the OOM's own figures → HeldMemory.

The shortfall is what the failed allocation lacked: the bytes it tried minus what was free under the cap that
bound — for a per-process cap (`… allowed`), the cap minus what PyTorch had reserved (allocated + reserved but
unallocated); for the GPU's total, the total minus what the process had in use; without the OOM's figures,
the snapshot's reserved bytes against the card's capacity. It is a lower bound for the request: past the
failed allocation it would have needed more. A counterfactual is `enough` when what it frees covers it.
"""

from __future__ import annotations

from dataclasses import dataclass

from runner.judge.findings.models import (
    Counterfactual,
    HeldMemory,
    HeldSite,
    MemoryModel,
    NamedPart,
    NoHeld,
    OomFacts,
    SiteGrowth,
)
from runner.observe.snapshot import Held, Site

TOP_SITES = 12
TOP_GROWTH = 5


def shortfall(held: Held, oom: OomFacts | None, capacity_bytes: int | None) -> int | None:
    tried = (oom.tried_bytes if oom is not None else None) or held.tried_bytes
    if tried is None:
        return None
    if oom is not None and oom.capacity_bytes is not None:
        cap = oom.capacity_bytes
        reserved = (oom.allocated_bytes + oom.reserved_unallocated_bytes
                    if oom.allocated_bytes is not None and oom.reserved_unallocated_bytes is not None else None)
        in_use = oom.in_use_bytes
        # Under a per-process cap the process's in-use figure (CUDA context included) exceeds the cap; against
        # the GPU's total it does not, and it counts what PyTorch's allocator does not see.
        base = reserved if in_use is None or in_use > cap else max(reserved or 0, in_use)
        if base is not None:
            return base + tried - cap
    if capacity_bytes is None:
        return None
    return held.reserved_bytes + tried - capacity_bytes


def outside_pytorch(oom: OomFacts | None) -> int | None:
    """The OOM message's "this process has X in use" beyond what PyTorch reserved (allocated + reserved but
    unallocated): the CUDA context and libraries' memory. None when a figure is missing or it would be negative
    (the CPU ledger's message counts PyTorch's bytes alone)."""
    if oom is None or None in (oom.in_use_bytes, oom.allocated_bytes, oom.reserved_unallocated_bytes):
        return None
    assert oom.in_use_bytes is not None and oom.allocated_bytes is not None \
        and oom.reserved_unallocated_bytes is not None
    gap = oom.in_use_bytes - oom.allocated_bytes - oom.reserved_unallocated_bytes
    return gap if gap > 0 else None


def _sites(held: Held) -> tuple[HeldSite, ...]:
    """The largest TOP_SITES sites of each phase (so 21 GiB of weights never hide the request's activations),
    the rest summed per phase."""
    kept: list[Site] = []
    rest: dict[str, list[int]] = {}
    seen: dict[str, int] = {}
    for s in held.by_site:  # largest first
        seen[s.phase] = seen.get(s.phase, 0) + 1
        if seen[s.phase] <= TOP_SITES:
            kept.append(s)
        else:
            acc = rest.setdefault(s.phase, [0, 0])
            acc[0] += s.bytes
            acc[1] += s.blocks
    top = [HeldSite(site=s.site, function=s.function, phase=s.phase, bytes=s.bytes, blocks=s.blocks,  # type: ignore[arg-type]
                    part=s.part) for s in kept]
    top += [HeldSite(site="other sites", function=None, phase=p, bytes=b, blocks=n)  # type: ignore[arg-type]
            for p, (b, n) in rest.items()]
    return tuple(top)


def largest_request_site(held: Held) -> HeldSite | None:
    """The largest request-time allocation the server did not name: a named part (weights onloaded for the
    request, a cache) has its own move, and chunking cannot shrink it."""
    return next((HeldSite(site=s.site, function=s.function, phase="request", bytes=s.bytes, blocks=s.blocks)
                 for s in held.by_site
                 if s.phase == "request" and s.part is None and s.site not in ("no frames recorded",)), None)


def counterfactuals(held: Held, short: int | None) -> tuple[Counterfactual, ...]:
    """The resident set, each part the server named, the largest request-time allocation, the fragmentation."""
    moves: list[tuple[str, int]] = []
    if held.resident_bytes:
        moves.append(("the resident set (weights and what lived before the request) to the host", held.resident_bytes))
    for n in held.named:
        moves.append((f"the {n.name} off the device", n.bytes))
    if (big := largest_request_site(held)) is not None:
        where = f"{big.site} in {big.function}" if big.function else big.site
        moves.append((f"the largest request-time allocation ({where}) off the device (chunked or offloaded)",
                      big.bytes))
    if held.inactive_bytes:
        moves.append(("the fragmentation (inactive bytes in segments; expandable_segments:True)", held.inactive_bytes))
    return tuple(Counterfactual(move=m, frees_bytes=b, shortfall_bytes=short,
                                enough=None if short is None else b >= short) for m, b in moves)


def held_memory(held: Held, oom: OomFacts | None, capacity_bytes: int | None, *, file: str | None,
                record: str | None, references: int | None) -> HeldMemory:
    short = shortfall(held, oom, capacity_bytes) if held.at == "oom" else None
    return HeldMemory(at="oom" if held.at == "oom" else "peak", source="allocator snapshot", file=file,
                      record=record, references=references, how=held.exact, active_bytes=held.active_bytes,
                      resident_bytes=held.resident_bytes, request_bytes=held.request_bytes,
                      inactive_bytes=held.inactive_bytes, reserved_bytes=held.reserved_bytes,
                      tried_bytes=held.tried_bytes,
                      oom_reserved_unallocated_bytes=oom.reserved_unallocated_bytes if oom is not None else None,
                      outside_pytorch_bytes=outside_pytorch(oom),
                      by_site=_sites(held),
                      named=tuple(NamedPart(name=n.name, phase=n.phase, bytes=n.bytes, blocks=n.blocks)  # type: ignore[arg-type]
                                  for n in held.named),
                      counterfactuals=counterfactuals(held, short), notes=held.notes)


@dataclass(frozen=True)
class Reading:
    """A diagnosis pass's snapshot as read (runner.run.diagnose.readings): what held the memory, or why not."""

    record: str  # the diagnosis record's session key
    at: str  # "oom" | "peak" | "kept"
    references: int | None
    file: str | None
    held: Held | None
    why: str | None


def growth(readings: tuple[Reading, ...]) -> tuple[SiteGrowth, ...]:
    """Per site, what one more reference adds: the flag set's snapshots at its lowest and highest reference
    counts (a peak and a peak, or a peak and the OOM), request-time sites only (the resident set does not
    depend on the request), largest growth first."""
    read = sorted((r for r in readings if r.held is not None and r.references is not None and r.at != "kept"),
                  key=lambda r: r.references or 0)
    if len(read) < 2 or read[0].references == read[-1].references:
        return ()
    low, high = read[0], read[-1]
    assert low.held is not None and high.held is not None and low.references is not None \
        and high.references is not None

    def by_site(held: Held) -> dict[tuple[str, str | None], int]:
        out: dict[tuple[str, str | None], int] = {}
        for s in held.by_site:
            if s.phase == "request":
                out[(s.site, s.function)] = out.get((s.site, s.function), 0) + s.bytes
        return out

    before, after = by_site(low.held), by_site(high.held)
    gap = high.references - low.references
    grown = sorted(((after.get(k, 0) - before.get(k, 0)) // gap, k) for k in after.keys() | before.keys())
    return tuple(SiteGrowth(site=k[0], function=k[1], per_reference_bytes=b, from_references=low.references,
                            to_references=high.references) for b, k in reversed(grown) if b > 0)[:TOP_GROWTH]


def with_held(model: MemoryModel, readings: tuple[Reading, ...], capacity_bytes: int | None) -> MemoryModel:
    """The memory model with what held the memory at its deciding OOM (else at the peak), or why not."""
    oom_reading = next((r for r in readings if r.at == "oom"), None)
    peaks = sorted((r for r in readings if r.at == "peak"), key=lambda r: -(r.references or 0))
    reading = oom_reading or next(iter(peaks), None)  # else the highest served count's peak
    if reading is None:
        return model
    if reading.held is None:
        return model.model_copy(update={"no_held": NoHeld(record=reading.record, why=reading.why or "no snapshot")})
    held = held_memory(reading.held, model.oom if reading.at == "oom" else None,
                       model.capacity_bytes or capacity_bytes, file=reading.file, record=reading.record,
                       references=reading.references)
    return model.model_copy(update={"held": held.model_copy(update={"growth": growth(readings)})})

