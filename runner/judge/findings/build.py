"""One card's findings from its records (pure): is the reference path functional at all, the memory model of
each flag set, the distinct OOM sites that stopped its default and offload flag sets (where a fix would go),
and, for flag sets that differ only in allocator settings, whether fragmentation was the problem."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from runner.core.records import FailureClass, SessionRecord, Status, StepRecord
from runner.judge.findings.held import Reading, with_held
from runner.judge.findings.memory import memory_model
from runner.judge.findings.models import ContributionSite, Findings, FlagSetFindings, Fragmentation, Functional
from runner.judge.findings.retention import cached_speed, retention, with_kept
from runner.observe.failures import server_lines, without_stamp

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
OOM_KINDS = (FailureClass.OOM, FailureClass.OOM_AT_LOAD)


def _unusable(s: StepRecord, min_psnr_db: float) -> str | None:
    if s.scores is None:
        return None
    if s.scores.sanity.broken:
        return "broken output: " + "; ".join(s.scores.sanity.reasons)
    if s.scores.psnr_db is not None and s.scores.psnr_db < min_psnr_db:
        return f"PSNR {s.scores.psnr_db:.1f} dB < {min_psnr_db:g} dB"
    return None


def functional(steps: Sequence[StepRecord], min_psnr_db: float) -> Functional:
    """The first request with references (by send time) that came back with a usable image, else the first
    request with references that failed for a reason that is not memory (or came back broken), else:
    every failure was out of memory."""
    with_refs = sorted((s for s in steps if s.references > 0 and s.status != Status.SKIPPED),
                       key=lambda s: (s.started_at or 0.0, s.key))
    ok = next((s for s in with_refs if s.status == Status.OK and _unusable(s, min_psnr_db) is None), None)
    if ok is not None:
        return Functional(works=True, record=ok.key, flags=ok.flags, references=ok.references)
    broken = next((s for s in with_refs if s.status == Status.OK), None)
    if broken is not None:
        return Functional(works=False, record=broken.key, flags=broken.flags, references=broken.references,
                          why=_unusable(broken, min_psnr_db))
    bad = next((s for s in with_refs if s.failure is not None and s.failure.kind not in OOM_KINDS), None)
    if bad is not None and bad.failure is not None:
        said = server_lines(bad.failure) or (bad.failure.message,)
        return Functional(works=False, record=bad.key, flags=bad.flags, references=bad.references,
                          server_says=without_stamp(said[0])[:400])
    return Functional(works=None)


def contribution_sites(models: Mapping[str, FlagSetFindings], counted: Iterable[str]) -> tuple[ContributionSite, ...]:
    """The distinct sites of the OOMs that decided the counted flag sets, the most flag sets first."""
    by_site: dict[tuple[str, str | None], list[tuple[str, int | None, int | None]]] = {}
    for flags in counted:
        oom = models[flags].memory.oom if flags in models else None
        if oom is not None and oom.site is not None:
            by_site.setdefault((oom.site, oom.function), []).append((flags, oom.references, oom.tried_bytes))
    sites = [ContributionSite(site=site, function=function, flag_sets=tuple(f for f, _, _ in hits),
                              references=tuple(n for _, n, _ in hits), tried_bytes=tuple(t for _, _, t in hits))
             for (site, function), hits in by_site.items()]
    return tuple(sorted(sites, key=lambda c: -len(c.flag_sets)))


def allocator_pairs(flag_sets: Iterable[tuple[str, tuple[str, ...], Mapping[str, str]]]) -> tuple[tuple[str, str], ...]:
    """Pairs of flag sets (name, args, env) whose args are equal and whose env differs only in the allocator
    settings (PYTORCH_CUDA_ALLOC_CONF): the one without the setting (or with the other value) first."""
    sets = list(flag_sets)
    pairs = []
    for i, (a, a_args, a_env) in enumerate(sets):
        for b, b_args, b_env in sets[i + 1:]:
            rest_a = {k: v for k, v in a_env.items() if k != ALLOC_CONF}
            rest_b = {k: v for k, v in b_env.items() if k != ALLOC_CONF}
            if a_args == b_args and rest_a == rest_b and a_env.get(ALLOC_CONF) != b_env.get(ALLOC_CONF):
                pairs.append((a, b) if ALLOC_CONF not in a_env else (b, a) if ALLOC_CONF not in b_env else (a, b))
    return tuple(pairs)


def fragmentation(models: Mapping[str, FlagSetFindings], pairs: Iterable[tuple[str, str]]) -> tuple[Fragmentation, ...]:
    out = []
    for a, b in pairs:
        oa = models[a].memory.oom if a in models else None
        ob = models[b].memory.oom if b in models else None
        if oa is None or oa.reserved_unallocated_bytes is None:
            continue
        if ob is None:  # b served what a could not: it ran out nowhere at or below the target
            out.append(Fragmentation(a=a, b=b, a_reserved_unallocated_bytes=oa.reserved_unallocated_bytes,
                                     b_reserved_unallocated_bytes=0, b_still_short=False))
        elif ob.reserved_unallocated_bytes is not None:
            out.append(Fragmentation(a=a, b=b, a_reserved_unallocated_bytes=oa.reserved_unallocated_bytes,
                                     b_reserved_unallocated_bytes=ob.reserved_unallocated_bytes,
                                     b_allocated_bytes=ob.allocated_bytes, b_still_short=True))
    return tuple(out)


def _flag_set(steps: Sequence[StepRecord], session: SessionRecord | None, role: str, target: int,
              capacity_bytes: int | None, held: tuple[Reading, ...]) -> FlagSetFindings:
    memory = with_held(memory_model(steps, session, target, capacity_bytes), held, capacity_bytes)
    probe = session.retention_probe if session is not None else None
    kept = retention(steps, memory.capacity_bytes or capacity_bytes, probe)
    return FlagSetFindings(role=role, memory=memory, speed=cached_speed(steps), retention=with_kept(kept, held))


def card_findings(steps: Sequence[StepRecord], sessions: Sequence[SessionRecord], roles: Mapping[str, str],
                  target: int, offload_roles: tuple[str, ...], capacity_bytes: int | None,
                  stops: Mapping[str, str], allocator: Iterable[tuple[str, str]] = (),
                  min_psnr_db: float = 0.0, held: Mapping[str, tuple[Reading, ...]] | None = None) -> Findings:
    session_of = {s.flags: s for s in sessions}
    models = {f: _flag_set([s for s in steps if s.flags == f], session_of.get(f), role, target, capacity_bytes,
                           (held or {}).get(f, ()))
              for f, role in roles.items()}
    counted = [f for f, r in roles.items() if (r == "default" or r in offload_roles) and stops.get(f) == "capacity"]
    no_site = tuple(m.memory.oom.record for f, m in models.items()
                    if f in counted and m.memory.oom is not None and m.memory.oom.site is None)
    return Findings(functional=functional(steps, min_psnr_db), contribution_sites=contribution_sites(models, counted),
                    flag_sets=models, fragmentation=fragmentation(models, allocator), no_site_ooms=no_site)
