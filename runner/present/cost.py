"""What a run cost, and what the next one will: pure functions of the records.

- `card_costs`: per card the GPU-busy time (every server start, from start to stop: the card is not its
  owner's meanwhile), starts, load time, sends made, sends saved by implied OOMs and against `repeats = 2`,
  and the moment the card's verdict was known (replayed from the send times: the earliest moment after which
  the verdict of what had been recorded by then, with every step not yet recorded counted as not run, no
  longer changed) against the moment the run ended. The report ends with it.
- `estimate`: `runner plan MATRIX --estimate-from RUN`: the expected GPU time per lane of a plan, from an
  earlier run's load time per session and sends and time per send per cell; `soak_estimate` adds each lane's
  soak (one start per flag set it may soak, its requests at the earlier run's time per soak request, else per
  send at the counts it mixes, plus the quiet window each).
- `soak_lines`: the soak's cost for the report's cost section, apart from the measured sends.
The "known at" moment is found by bisection over the send times (docs/results.md says what that assumes).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from runner.core.records import (
    NOT_RUN,
    DiagnosisRecord,
    SendTime,
    SessionRecord,
    SoakRecord,
    SoakRequest,
    Status,
    StepRecord,
)
from runner.core.units import fmt_s, refs_text
from runner.plan import soak as soak_plan
from runner.plan.lanes import Plan
from runner.plan.matrix import Matrix, VerdictRules


def sends_of(r: StepRecord) -> tuple[SendTime, ...]:
    """Every send of a step; records written before `sends` existed: rebuilt from their timed samples (plus
    the sends the request counted), back to back from `started_at`."""
    if r.sends or r.status == Status.SKIPPED or r.started_at is None:
        return r.sends
    walls = list(r.wall_samples_s or ((r.wall_s,) if r.wall_s is not None else ()))
    n = max(int(r.request.get("sends", len(walls) or 1)), len(walls), 1)
    walls += [walls[0] if walls else (r.wall_s or 0.0)] * (n - len(walls))
    out, t = [], r.started_at
    for i, w in enumerate(walls):
        out.append(SendTime(started_at=t, wall_s=w, timed=i < len(r.wall_samples_s or ())))
        t += w
    return tuple(out)


def _end(s: SendTime) -> float:
    return s.started_at + s.wall_s


@dataclass(frozen=True)
class CardCost:
    card: str
    starts: int
    gpu_busy_s: float  # Σ over server starts of stop − start
    load_s: float  # Σ over server starts of the time to ready
    sends: int
    send_s: float  # Σ of every send's wall time
    saved_by_implied: int  # steps an OOM decided without sending (each would have been one send)
    saved_vs_repeats_2: int  # what `repeats = 2` would have sent for the same steps, less what was sent
    world: str
    known_at: float | None  # epoch seconds; None: never reached a world
    started_at: float
    ended_at: float


def _start_end(start: Any, fallback: float) -> float:
    return start.stopped_at if start.stopped_at is not None else fallback


def card_costs(steps: Sequence[StepRecord], sessions: Sequence[SessionRecord], rules: VerdictRules,
               run_started: float, run_ended: float | None, baseline_wall_s: float | None = None) -> list[CardCost]:
    from runner.judge.verdict import decide  # verdict pulls the statistics; the plan estimate needs none of it

    last = max((_end(s) for r in steps for s in sends_of(r)), default=run_started)
    ended = run_ended or last
    out = []
    for card in dict.fromkeys(r.card for r in steps):
        mine = [r for r in steps if r.card == card]
        own_sessions = [s for s in sessions if s.card == card]
        starts = [st for s in own_sessions for st in s.starts]
        sent = [r for r in mine if r.status != Status.SKIPPED]
        final = decide(card, mine, own_sessions, rules, baseline_wall_s)
        out.append(CardCost(
            card=card, starts=len(starts),
            gpu_busy_s=sum(max(0.0, _start_end(st, ended) - st.started_at) for st in starts),
            load_s=sum(st.ready_s or 0.0 for st in starts),
            sends=sum(len(sends_of(r)) for r in sent), send_s=sum(s.wall_s for r in sent for s in sends_of(r)),
            saved_by_implied=sum(1 for r in mine if r.status == Status.SKIPPED and r.implied_by),
            saved_vs_repeats_2=sum((2 if r.status == Status.OK or len(r.wall_samples_s) else 1) - len(sends_of(r))
                                   for r in sent),
            world=final.world.value,
            known_at=_known_at(card, mine, own_sessions, rules, baseline_wall_s, final.world.value),
            started_at=run_started, ended_at=ended))
    return out


def _visible_at(r: StepRecord, by_key: dict[str, StepRecord], sessions: dict[str, SessionRecord]) -> float | None:
    """When a step's outcome was first on record: its first send answered; an implied skip with its OOM; a
    skip for a failed start with that start's end; None for a skip that was never decided (interrupted)."""
    if r.status != Status.SKIPPED:
        sends = sends_of(r)
        return _end(sends[0]) if sends else None
    if r.implied_by and r.implied_by in by_key and by_key[r.implied_by].status != Status.SKIPPED:
        return _visible_at(by_key[r.implied_by], by_key, sessions)
    session = sessions.get(f"{r.card}/{r.flags}")
    if session is not None and session.start_failure is not None and session.starts:
        st = session.starts[-1]
        return st.stopped_at or st.started_at
    return None


def _as_of(r: StepRecord, t: float, seen: float | None) -> StepRecord:
    """A step as its record stood at time t: not yet run, or with the timed samples answered by then."""
    if seen is None or seen > t:
        return r.model_copy(update={"status": Status.SKIPPED, "skip_reason": "not yet run", "implied_by": None,
                                    "failure": None, "scores": None, "wall_samples_s": (), "sends": ()})
    if r.status != Status.OK or not r.sends:
        return r
    timed = [s for s in r.sends if s.timed]
    done = max(1, sum(1 for s in timed if _end(s) <= t))
    return r.model_copy(update={"wall_samples_s": r.wall_samples_s[:done]})


def _known_at(card: str, steps: list[StepRecord], sessions: list[SessionRecord], rules: VerdictRules,
              baseline_wall_s: float | None, world: str) -> float | None:
    from runner.judge.decision import World
    from runner.judge.verdict import decide

    if world == World.UNDECIDED:
        return None
    by_key = {r.key: r for r in steps}
    by_session = {s.key: s for s in sessions}
    seen = {r.key: _visible_at(r, by_key, by_session) for r in steps}
    moments = sorted({t for t in seen.values() if t is not None}
                     | {_end(s) for r in steps for s in r.sends if s.timed})

    def settled(t: float) -> bool:
        now = [_as_of(r, t, seen[r.key]) for r in steps]
        started = [s for s in sessions if s.starts and s.starts[0].started_at <= t]
        return decide(card, now, started, rules, baseline_wall_s).world == world

    # Bisection over the moments (a verdict takes ~ms, a run has hundreds of moments): a card's verdict
    # moves from undecided to its world once, as steps arrive; one that changed back and forth is dated at
    # one of its changes.
    low, high = 0, len(moments) - 1
    if high < 0 or not settled(moments[high]):
        return None
    while low < high:
        mid = (low + high) // 2
        if settled(moments[mid]):
            high = mid
        else:
            low = mid + 1
    return moments[low]


def cost_lines(costs: Sequence[CardCost]) -> list[str]:
    """The report's closing section."""
    if not costs:
        return []
    t0, end = costs[0].started_at, max(c.ended_at for c in costs)
    lines = ["## What the run cost", "",
             "| card | GPU busy | server starts (load) | sends (time) | saved: implied by an OOM | saved vs "
             "`repeats = 2` | verdict known at | run ended at |", "|---|---|---|---|---|---|---|---|"]
    for c in costs:
        known = "– (undecided)" if c.known_at is None else f"{_clock(c.known_at - t0)} ({c.world})"
        lines.append(f"| {c.card} | {_clock(c.gpu_busy_s)} | {c.starts} ({fmt_s(c.load_s)} s) | {c.sends} "
                     f"({fmt_s(c.send_s)} s) | {c.saved_by_implied} | {c.saved_vs_repeats_2} | {known} | "
                     f"{_clock(end - t0)} |")
    lines += ["", f"{sum(c.sends for c in costs)} sends in all; {sum(c.saved_by_implied for c in costs)} not "
              f"made because an OOM implied their steps (each would have been one send: an OOM ends a step at "
              f"its first send), {sum(c.saved_vs_repeats_2 for c in costs)} fewer than `repeats = 2` would have "
              "made for the same steps (negative: more). GPU busy is every server start from start to stop; "
              "\"verdict known at\" is the moment after which the verdict of what was on record by then no "
              "longer changed (times from the run's start).", ""]
    return lines


def _clock(seconds: float) -> str:
    s = max(0, round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


# -- the plan's estimate from an earlier run ------------------------------------------------------------------
@dataclass(frozen=True)
class LaneEstimate:
    lane: str
    starts: float
    sends: float
    gpu_s: float
    guessed: int  # sessions without a counterpart in the earlier run (priced at its means)
    soak_flag_sets: int = 0  # flag sets its soak may take (at most: profiles.json decides where [soak] names none)
    soak_requests: float = 0.0
    soak_s: float = 0.0  # included in gpu_s


PLAUSIBLE_S = 7 * 24 * 3600.0  # a load or a send said to last over a week is an edited record, not a time


def _times(values: Iterable[float | None]) -> list[float]:
    """The figures that can be times of a load or a send; the rest are left out, never summed (two sends of
    1e308 s overflowed the mean, one printed a 300-digit hour count: issue 30, C-2)."""
    return [v for v in values if v is not None and 0 < v <= PLAUSIBLE_S]


def estimate(plan: Plan, steps: Iterable[StepRecord], sessions: Iterable[SessionRecord]) -> list[LaneEstimate]:
    """Per lane: Σ over sessions of starts × load time + Σ over cells of sends × time per send, each figure the
    earlier run's for the same card/flags (cell: same references), scaled to the plan's steps per cell. A
    session or cell the earlier run lacks is priced at that run's mean load time, one send per step at its
    mean time per send."""
    steps, sessions = list(steps), list(sessions)
    by_session = {s.key: s for s in sessions}
    loads = _times(st.ready_s for s in sessions for st in s.starts)
    mean_load = statistics.fmean(loads) if loads else 0.0
    walls = _times(x.wall_s for r in steps for x in sends_of(r))
    mean_send = statistics.fmean(walls) if walls else 0.0
    cells: dict[tuple[str, str, int], list[StepRecord]] = {}
    for r in steps:
        cells.setdefault((r.card, r.flags, r.references), []).append(r)
    out = []
    for lane in plan.lanes:
        starts = sends = gpu = 0.0
        guessed = 0
        for s in lane.sessions:
            prior = by_session.get(s.key)
            own = _times(st.ready_s for st in prior.starts) if prior else []
            n_starts = len(prior.starts) if prior and prior.starts else 1
            guessed += prior is None
            starts += n_starts
            gpu += n_starts * (statistics.fmean(own) if own else mean_load)
            for n in sorted({st.references for st in s.steps}):
                planned = sum(1 for st in s.steps if st.references == n)
                earlier = cells.get((s.card, s.flags, n))
                if earlier:
                    made = [x for r in earlier for x in sends_of(r)]
                    per_step = len(made) / len(earlier)
                    timed = _times(x.wall_s for x in made)
                    each = statistics.fmean(timed) if timed else mean_send
                else:
                    per_step, each = 1.0, mean_send
                sends += planned * per_step
                gpu += planned * per_step * each
        out.append(LaneEstimate(lane.name, starts, sends, gpu, guessed))
    return out


def soak_estimate(matrix: Matrix, estimates: Sequence[LaneEstimate], plan: Plan, steps: Iterable[StepRecord],
                  sessions: Iterable[SessionRecord], soak_requests: Iterable[SoakRequest]) -> list[LaneEstimate]:
    """Each lane's estimate with its soak added: per flag set it may soak (runner.plan.soak.candidates: at most),
    one start at its load time, and its requests at the earlier run's mean time per soak request of that flag
    set, else its mean time per send at the counts the soak mixes, else the run's; plus the quiet window after
    each; bounded by [soak] minutes."""
    soak = matrix.soak
    if soak is None:
        return list(estimates)
    steps, sessions = list(steps), list(sessions)
    loads = _times(st.ready_s for s in sessions for st in s.starts)
    mean_load = statistics.fmean(loads) if loads else 0.0
    by_session = {s.key: s for s in sessions}
    soaked: dict[str, list[float]] = {}
    for r in soak_requests:
        soaked.setdefault(r.key, []).append(r.wall_s)
    walls = _times(x.wall_s for r in steps for x in sends_of(r))
    out = []
    for e in estimates:
        lane = next(x for x in plan.lanes if x.name == e.lane)
        flag_sets, requests, seconds = 0, 0.0, 0.0
        for card in lane.cards:
            for flags in soak_plan.candidates(matrix, card):
                key = f"{card}/{flags}"
                prior = by_session.get(key)
                own = _times(st.ready_s for st in prior.starts) if prior else []
                each = _times(soaked.get(key, ())) or _times(x.wall_s for r in steps if r.card == card and
                                                             r.flags == flags and r.references in soak.counts
                                                             for x in sends_of(r)) or walls
                per = (statistics.fmean(each) if each else 0.0) + matrix.run.quiet_s
                span = soak.requests * per if soak.minutes is None else min(soak.requests * per, soak.minutes * 60)
                flag_sets += 1
                requests += span / per if per > 0 else soak.requests
                seconds += (statistics.fmean(own) if own else mean_load) + span
        out.append(LaneEstimate(e.lane, e.starts, e.sends, e.gpu_s + seconds, e.guessed, flag_sets, requests,
                                seconds))
    return out


def estimate_lines(estimates: Sequence[LaneEstimate], source: str) -> list[str]:
    lines = [f"expected GPU time from {source} (starts × load time + sends × time per send, per cell):"]
    for e in estimates:
        guess = f"; {e.guessed} session(s) not in that run, priced at its means" if e.guessed else ""
        soak = (f"; with its soak: at most {e.soak_flag_sets} flag set(s), {e.soak_requests:.0f} request(s), "
                f"{_clock(e.soak_s)}" if e.soak_flag_sets else "")
        lines.append(f"  lane {e.lane}: {e.starts:.0f} start(s), {e.sends:.0f} send(s), {_clock(e.gpu_s)}{guess}{soak}")
    if estimates:
        lines.append(f"  run: {_clock(max(e.gpu_s for e in estimates))} (lanes in parallel), "
                     f"{_clock(sum(e.gpu_s for e in estimates))} of GPU time in all")
    return lines


def diagnosis_lines(diagnoses: Sequence[DiagnosisRecord]) -> list[str]:
    """The diagnosis passes' cost (runner.run.diagnose): apart from the measured sends, per flag set."""
    if not diagnoses:
        return []
    lines = ["Diagnosis passes (one start with the allocator history on and the deciding request sent once more, "
             "per flag set decided by a device OOM; not measurements, not counted above):", "",
             "| flag set | at | start (load) | request | whole pass | outcome | snapshot |",
             "|---|---|---|---|---|---|---|"]
    for d in sorted(diagnoses, key=lambda d: (d.key, d.at)):
        got = f"`{d.snapshot.rsplit('/', 1)[-1]}`" if d.snapshot else (d.why_none or "none")
        start, request = ("–" if s is None else f"{fmt_s(s)} s" for s in (d.start_s, d.request_s))
        whole = "–" if d.outcome == NOT_RUN else f"{fmt_s(d.total_s)} s"
        lines.append(f"| {d.key} | {d.at} ({refs_text(d.references)}) | {start} | {request} | {whole} | "
                     f"{d.outcome} | {got} |")
    ran = [d for d in diagnoses if d.outcome != NOT_RUN]
    total = sum(d.total_s for d in ran)
    said = (f"{len(ran)} diagnosis pass(es), {fmt_s(total)} s in all ({fmt_s(total / len(ran))} s per pass)"
            if ran else "No diagnosis pass was run")
    skipped = len(diagnoses) - len(ran)
    lines += ["", said + (f"; {skipped} not run (the table says why)." if skipped else "."), ""]
    return lines


def soak_lines(soaks: Sequence[SoakRecord], requests: dict[str, Sequence[SoakRequest]]) -> list[str]:
    """The soak's cost (runner.run.soak), per soaked flag set, apart from the measured sends: its server starts
    (GPU busy from start to stop), its requests and their time."""
    if not soaks:
        return []
    lines = ["The soak (one start per soaked flag set, its requests one at a time; not counted above):", "",
             "| flag set | server starts (load) | GPU busy | requests (time) | stopped |", "|---|---|---|---|---|"]
    busy_all = 0.0
    for r in soaks:
        mine = requests.get(r.key, ())
        busy = sum(max(0.0, (st.stopped_at or st.started_at) - st.started_at) for st in r.starts)
        busy_all += busy
        load = sum(st.ready_s or 0.0 for st in r.starts)
        lines.append(f"| {r.key} | {len(r.starts)} ({fmt_s(load)} s) | {_clock(busy)} | {len(mine)} "
                     f"({fmt_s(sum(x.wall_s for x in mine))} s) | {r.stopped or 'running'} |")
    sent = sum(len(requests.get(r.key, ())) for r in soaks)
    lines += ["", f"{sent} soak request(s) in all, {_clock(busy_all)} of GPU time.", ""]
    return lines
