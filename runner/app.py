"""The application layer: start a run, resume one, finish one (verdict, report, exit status).

cli.py only parses arguments and maps errors to exit codes; this module wires matrix → plan → pending →
execute → rescore → verdict → store/report, and says what the exit status means:
0 every card reached a world; 1 some card is undecided or the run is incomplete (steps a resume would
still send); 2 bad input (UserError, raised before anything starts; also a run folder another runner
holds); 130 / 143 / 129 interrupted by SIGINT (Ctrl-C) / SIGTERM / SIGHUP (runner.run.interrupts: servers
stopped, records kept, a partial report written, the exact resume command printed).
"""

from __future__ import annotations

import datetime as dt
import os
import re
import shlex
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from runner.core.errors import UserError
from runner.core.records import SCHEMA_VERSION, RecordError, RunRecord
from runner.core.records import load as load_record
from runner.core.registry import BACKENDS, load
from runner.core.secrets import resolved_values
from runner.core.units import slug
from runner.plan import inputs, preflight
from runner.plan.lanes import Plan, make_plan, sends_text
from runner.plan.matrix import Matrix, load_matrix
from runner.plan.soak import bounds_text as soak_bounds
from runner.present import runinfo
from runner.run import runlock
from runner.run.events import Events, Fanout
from runner.run.interrupts import Interrupts, exit_code
from runner.run.pending import Pending, pending
from runner.run.store import RunStore, new_run_folder

EXIT_OK, EXIT_INCOMPLETE, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130


@dataclass(frozen=True)
class Opened:
    """A run directory ready to execute: new, or an earlier run's to resume."""

    matrix: Matrix
    plan: Plan
    store: RunStore
    run_id: str
    run_doc: dict
    resumed: bool


def open_run(matrix_path: str, results: str | None, resume: str | None) -> Opened:
    matrix = load_matrix(matrix_path)
    plan = make_plan(matrix)
    preflight.check(matrix, plan, Path(resume or results or matrix.run.results_dir), resume=bool(resume))
    started = dt.datetime.now().timestamp()
    if resume:
        root = Path(resume)
        if not (root / "run.json").is_file():
            raise UserError(f"{root}: not a run directory (no run.json)")
        store = RunStore(root)
        run_doc = store.load_run()
        if newer := store.newer_records():  # resuming would send their steps again and overwrite them
            raise UserError(f"{newer[0]}: written by a newer runner (schema_version above {SCHEMA_VERSION})"
                            + (f", and {len(newer) - 1} more" if len(newer) > 1 else "")
                            + f"; resume {root} with that runner")
        recorded = run_doc.get("inputs")
        if isinstance(recorded, dict) and recorded:  # every input the records depend on (runner.plan.inputs)
            diff = inputs.changes(recorded, inputs.fingerprint(matrix, plan, salt=str(run_doc["run_id"])))
            if diff:
                raise UserError(f"{matrix_path}: {inputs.refusal(run_doc['run_id'], diff)}")
        elif run_doc["matrix"].get("sha256") != matrix.sha256:  # a run.json written before inputs were kept
            raise UserError(f"{matrix_path}: matrix changed since run {run_doc['run_id']} (sha256 differs)")
        return Opened(matrix, plan, store, run_doc["run_id"], run_doc, True)
    run_id = slug(matrix.run.name) + "-" + runinfo.iso_time(started).replace(":", "")
    root = (Path(results) if results else matrix.run.results_dir) / run_id
    return Opened(matrix, plan, RunStore(root), run_id, runinfo.run_doc(matrix, plan, run_id, started), False)


def claimed(run: Opened) -> Opened:
    """A new run with its own folder, made here and only here (store.new_run_folder: exclusively). When the
    planned one exists (a run of the same name started in the same second, or any folder of that name), the run
    takes the next free suffix as its id too, so run.json, the Slurm job names and the folder agree."""
    root = new_run_folder(run.store.root.parent, run.run_id)
    if root.name == run.run_id:
        return run
    doc = runinfo.run_doc(run.matrix, run.plan, root.name, float(run.run_doc["started_at"]))
    return replace(run, store=RunStore(root), run_id=root.name, run_doc=doc)


def left_to_do(run: Opened) -> Pending:
    return pending(run.plan, run.store.load_steps(), run.store.load_sessions())


def owed_topups(run: Opened) -> dict[str, int]:
    """Under `repeats = "auto"`, a resumed run whose steps are all decided may still owe top-up sends (it was
    stopped while topping up): how many the records ask for now per card (the executor's own rule,
    policy.topups)."""
    if not (run.resumed and run.matrix.run.auto_repeats):
        return {}
    from runner.judge.verdict import open_latencies
    from runner.plan import baseline
    from runner.run import policy

    steps, sessions = run.store.load_steps(), run.store.load_sessions()
    try:
        wall = baseline.wall_s(run.matrix)
    except UserError:
        wall = None
    owed = {}
    for card in dict.fromkeys(s.card for s in steps):
        mine = [s for s in steps if s.card == card]
        sides = [lat.sides for lat in open_latencies(card, mine, [s for s in sessions if s.card == card],
                                                     run.matrix.verdict, wall) if lat.sides]
        sends = sum(t.sends for s in run.plan.sessions if s.card == card
                    for t in policy.topups(sides, mine, card, s.flags, run.matrix.run.max_repeats))
        if sends:
            owed[card] = sends
    return owed


def owed_soak(run: Opened) -> dict[str, int]:
    """Soak requests still owed per card, on the cards whose steps are all done (runner.run.soak_state; none
    without [soak])."""
    if run.matrix.soak is None:
        return {}
    from runner.run.soak_state import owed

    return owed(run.matrix, run.store)


def owed_beyond_steps(todo: Pending, topups: dict[str, int], soak: dict[str, int]) -> dict[str, str]:
    """The cards with no step left that still owe top-up sends or soak requests (per card), with what they owe in
    words: they start servers too, so a resume's preflight reaches their hosts."""
    with_steps = {c for lane in todo.lanes for c in lane.cards}
    words: dict[str, list[str]] = {}
    for card, n in topups.items():
        words.setdefault(card, []).append(f"{n} top-up send(s)")
    for card, n in soak.items():
        words.setdefault(card, []).append(f"{n} soak request(s)")
    return {card: " and ".join(w) for card, w in words.items() if card not in with_steps}


def owed_here(owed: dict[str, int], todo: Pending) -> int:
    """What this invocation sends of `owed` (per card): none of a card set aside."""
    return sum(n for card, n in owed.items() if card not in todo.set_aside)


def banner(run: Opened, todo: Pending, owed: int = 0, soak_owed: int = 0) -> str:
    soak = run.matrix.soak
    if todo.steps == 0 and (owed or soak_owed):
        what = [f"{owed} top-up send(s) owed to open latency ratios (repeats = auto)"] if owed else []
        what += [f"{soak_owed} soak request(s) owed"] if soak_owed else []
        return (f"runner: run {run.run_id}: all {todo.planned_steps} step(s) decided; {'; '.join(what)} "
                f"→ {run.store.root}")
    if todo.steps == 0:
        return (f"runner: run {run.run_id}: nothing left to send, all {todo.planned_steps} step(s) decided "
                f"→ {run.store.root}")
    of = f" of {todo.planned_sessions}" if run.resumed else ""
    then = "" if soak is None else f", then the soak: {soak_bounds(soak)} per soaked flag set"
    return (f"runner: run {run.run_id}: {len(todo.sessions)}{of} session(s), {todo.steps} step(s) to send"
            f"{f' of {todo.planned_steps}' if run.resumed else ''} × {sends_text(run.matrix.run)}{then} "
            f"→ {run.store.root}")


def resume_command(command: Sequence[str], root: Path) -> str:
    """The run's own command line (program as invoked, matrix, options) with `--resume RUN_DIR`."""
    return shlex.join([*command, "--resume", str(root)])


def execute(run: Opened, events: Events, todo: Pending, stop: threading.Event | None = None,
            live: set | None = None) -> bool:
    """Run what is pending. Returns True when interrupted (a signal set `stop`, or Ctrl-C where no handler
    is installed); every finished step is on disk. `live` is filled with the servers up at any moment."""
    from runner.run.execute import RunContext, run_plan  # the executor pulls httpx, meters, backends

    records = {s.key: s for s in run.store.load_steps()}
    ctx = RunContext(matrix=run.matrix, plan=run.plan, store=run.store, run_id=run.run_id, events=events,
                     records=records, todo=todo, stop=stop or threading.Event(),
                     live=live if live is not None else set())
    try:
        run_plan(ctx)
    except KeyboardInterrupt:
        return True
    return ctx.stop.is_set()


def kill_all(servers: set, grace_s: float = 5.0) -> None:
    """Kill every server still up, side by side, waiting at most `grace_s` (an engine may not answer)."""
    threads = [threading.Thread(target=s.kill, daemon=True) for s in list(servers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=grace_s / max(1, len(threads)))


def finish(store: RunStore, matrix: Matrix, *, rescore: bool = True) -> list:
    """Rescore against the baseline cell, decide the verdicts, write verdict.json and the report."""
    from runner.core.units import GIB
    from runner.judge.findings.build import allocator_pairs
    from runner.judge.findings.profiles import profiles
    from runner.judge.findings.soak import with_soak
    from runner.judge.verdict import decide_all
    from runner.plan import baseline
    from runner.present import cost
    from runner.present.progress import verdict_line
    from runner.present.report import write_report
    from runner.run import diagnose
    from runner.run.rescore import rescore_against_cell
    from runner.run.soak_state import card_soaks

    if rescore:
        rescore_against_cell(matrix, store)
    steps, sessions = store.load_steps(), store.load_sessions()
    try:
        wall = baseline.wall_s(matrix)
    except UserError as exc:  # the report still comes out; only the baseline's latency is missing
        print(f"runner: warning: {exc}", file=sys.stderr)
        wall = None
    capacities = {c.name: round(c.vram_gib * GIB) for c in matrix.cards.values()}
    allocator = allocator_pairs((f.name, f.args, f.env) for f in matrix.flags.values())
    # What the runner resolved into the servers' environments: masked in every text a snapshot gives.
    secrets = dict.fromkeys(v for s in make_plan(matrix).sessions if s.server is not None
                            for v in resolved_values(s.server.env, os.environ))
    verdicts = decide_all(steps, sessions, matrix.verdict, list(dict.fromkeys(s.card for s in steps)), wall,
                          capacities, allocator,
                          diagnose.readings(store, {c.name: matrix.servers[c.server].own_packages
                                                    for c in matrix.cards.values()}, secrets))
    # A baseline cell on a card with another server: the report says its scores compare two servers.
    verdicts = [replace(v, notes=(*v.notes, note)) if (note := baseline.cell_mismatch(matrix, v.card)) else v
                for v in verdicts]
    soaks = card_soaks(matrix, store, verdicts)  # in each card's findings; the world stays the single request's
    verdicts = [with_soak(v, soaks.get(v.card)) for v in verdicts]
    store.write_verdicts([v.to_json() for v in verdicts])
    run = store.load_run()
    store.write_profiles(profiles(run["run_id"], verdicts, matrix.verdict, capacities).model_dump(mode="json"))
    costs = cost.card_costs(steps, sessions, matrix.verdict, run["started_at"], run.get("finished_at"), wall)
    soaked = store.load_soaks()
    report = write_report(store, verdicts, [*cost.cost_lines(costs), *cost.diagnosis_lines(store.load_diagnoses()),
                                            *cost.soak_lines(soaked, {r.key: store.load_soak_requests(r.key)
                                                                      for r in soaked})])
    for v in verdicts:  # one short line per card; report.md has the whole reason
        print(verdict_line(v))
    print(f"report: {report}")
    return verdicts


def as_recorded(matrix: Matrix, steps: Sequence[Any]) -> Matrix:
    """A run recorded before `repeats = "auto"` existed (no step lists its sends) was sent with the old
    default, `repeats = 2`, when its matrix names no repeats: its latency is judged as it was then."""
    if matrix.run.auto_repeats and steps and not any(s.sends for s in steps) and \
            not re.search(r"(?m)^\s*repeats\s*=", matrix.text):
        return replace(matrix, verdict=matrix.verdict.model_copy(update={"latency_looks": 1, "latency_max_repeats": 0}),
                       run=matrix.run.model_copy(update={"repeats_setting": 2}))
    return matrix


def exit_status(worlds: Sequence[str], steps_left: int) -> int:
    """0 every card reached a world; 1 some card is undecided or steps are left that a resume would send."""
    from runner.judge.decision import World

    return EXIT_INCOMPLETE if steps_left or World.UNDECIDED in worlds else EXIT_OK


def check_reachable(matrix: Matrix, todo: Pending, *, skip_unreachable: bool,
                    owing: dict[str, str] | None = None) -> Pending:
    """Every host the pending sessions will use answers, and those of the cards `owing` top-ups or a soak with no
    step left (preflight, nothing started yet): else one line per card and exit 2, or — with --skip-unreachable —
    that card is set aside for this invocation with one line (nothing of it starts), its work kept for a resume."""
    from runner.run import reach
    from runner.run.pending import without_cards

    owing = owing or {}
    cards = list(dict.fromkeys([*(c for lane in todo.lanes for c in lane.cards), *owing]))
    down = reach.unreachable(matrix, cards)
    if not down:
        return todo
    lines = list(dict.fromkeys(u.line() for u in down))
    skipped = list(dict.fromkeys(u.card for u in down))
    if not skip_unreachable or len(skipped) == len(cards):
        tail = ("; nothing started (--skip-unreachable runs the other cards without it)"
                if len(skipped) < len(cards) else "; nothing started")
        raise UserError("\n".join(line + tail for line in lines))
    left = without_cards(todo, skipped)
    for card in skipped:
        what = owing.get(card) or f"{todo.steps - without_cards(todo, [card]).steps} step(s)"
        why = "; ".join(u.line().split(": ", 1)[1] for u in down if u.card == card)
        print(f"runner: skipping card '{card}' ({what}, left for --resume): {why}", file=sys.stderr)
    return left


def check_flags(matrix: Matrix, plan: Plan, todo: Pending, stop: threading.Event) -> None:
    """The flag sets of a vLLM-Omni server that names no release (a fork), against its own `--help` where the
    pending cards run it (preflight, nothing started yet): a bad flag is one line and exit 2; flags that could
    not be asked are one warning line per server (runner.run.flag_help)."""
    from runner.run import flag_help

    cards = list(dict.fromkeys(c for lane in todo.lanes for c in lane.cards))
    for line in flag_help.check(matrix, plan, cards, stop=stop):
        print(f"runner: warning: {line}", file=sys.stderr)


def run(matrix_path: str, *, results: str | None = None, resume: str | None = None, progress: bool = True,
        metrics_port: int | None = None, skip_unreachable: bool = False,
        command: Sequence[str] | None = None) -> int:
    """`command`: how this run was invoked, less --resume/--results (cli.py builds it), for the printed
    resume command."""
    command = list(command) if command is not None else ["runner", matrix_path]
    stop: threading.Event = threading.Event()
    live: set = set()
    interrupts = Interrupts(stop, lambda: kill_all(live))
    interrupts.install()
    try:
        opened = open_run(matrix_path, results, resume)
        todo = None
        if not opened.resumed:  # a new run: an unreachable host ends it before its folder (and lock) exists
            todo = check_reachable(opened.matrix, pending(opened.plan, (), ()), skip_unreachable=skip_unreachable)
            check_flags(opened.matrix, opened.plan, todo, stop)
            opened = claimed(opened)
        lock = runlock.acquire(opened.store.root)  # a second runner on this folder is refused here
        try:
            return _run(opened, command, progress, metrics_port, skip_unreachable, interrupts, live, todo)
        finally:
            lock.release()
    finally:
        interrupts.restore()


def declared_run(doc: dict[str, Any], root: Path) -> dict[str, Any]:
    """run.json as RunRecord declares it (an older run's migrated to the current form), or one line naming the
    field that is not."""
    try:
        return load_record(RunRecord, doc).model_dump(mode="json")
    except RecordError as exc:
        raise UserError(f"{root / 'run.json'}: {exc}") from None


def _run(opened: Opened, command: list[str], progress: bool, metrics_port: int | None, skip_unreachable: bool,
         interrupts: Interrupts, live: set, todo: Pending | None = None) -> int:
    from runner.present.progress import ProgressView

    topups_owed, soaks_owed = owed_topups(opened), owed_soak(opened) if opened.resumed else {}
    if todo is None:  # a resume: what is left, then the hosts it needs (a card owing only top-ups or its soak too)
        todo = left_to_do(opened)
        owing = owed_beyond_steps(todo, topups_owed, soaks_owed)
        if todo.steps or owing:
            todo = check_reachable(opened.matrix, todo, skip_unreachable=skip_unreachable, owing=owing)
            check_flags(opened.matrix, opened.plan, todo, interrupts.stop)
    opened.store.write_run(declared_run(opened.run_doc, opened.store.root))
    owed = 0 if todo.steps else owed_here(topups_owed, todo)
    soak_owed = owed_here(soaks_owed, todo)
    print(banner(opened, todo, owed, soak_owed), file=sys.stderr)
    from runner.plan.baseline import cell_mismatch

    for card in opened.matrix.axes.cards:  # said before the run, not only in the report an hour later
        if note := cell_mismatch(opened.matrix, card):
            print(f"runner: warning: {note}", file=sys.stderr)
    work = bool(todo.steps or owed or soak_owed)
    if work:
        _reap_leftovers(opened.matrix, todo)
    view = ProgressView(enabled=progress)
    events: Events = view
    exporter = None
    if metrics_port is not None and work:
        from runner.present.exporter import RunExporter

        try:
            exporter = RunExporter(opened.run_id, metrics_port, capacities={
                name: round(card.vram_gib * 2**30) for name, card in opened.matrix.cards.items()})
        except OSError as exc:
            raise UserError(f"--metrics-port {metrics_port}: cannot listen on 127.0.0.1: {exc.strerror}") \
                from None
        events = Fanout(view, exporter)
    interrupted = False
    try:
        if work:
            with view:
                interrupted = execute(opened, events, todo, interrupts.stop, live)
    finally:
        if exporter:
            exporter.close()
    interrupts.phase = "report"  # a first signal from here on lets the report finish
    interrupted = interrupted or interrupts.interrupted
    if interrupted:
        print("runner: interrupted; writing the partial report (a few seconds)…", file=sys.stderr)
    finished = dt.datetime.now().timestamp()
    doc = {**opened.run_doc, "finished_at": finished, "finished_at_iso": runinfo.iso_time(finished),
           "interrupted": interrupted, "cards": runinfo.card_facts(opened.run_doc["cards"], opened.store)}
    if opened.resumed:
        doc["resumes"] = [*opened.run_doc.get("resumes", []), {"at_iso": runinfo.iso_time(finished),
                                                               "steps_to_send": todo.steps}]
    opened.store.write_run(declared_run(doc, opened.store.root))
    verdicts = finish(opened.store, opened.matrix, rescore=bool(todo.steps))
    left = left_to_do(opened)
    soak_left = sum(owed_soak(opened).values()) if not left.steps else 0  # a card with steps left: soak to come
    soak_words = f" and {soak_left} soak request(s)" if soak_left else ""
    if interrupted or interrupts.interrupted:
        done = left.planned_steps - left.steps
        print(f"runner: interrupted; kept {done} of {left.planned_steps} step(s) in {opened.store.root} "
              f"(partial report: {opened.store.root / 'report.md'}); {left.steps} left{soak_words}. Resume with:\n"
              f"  {resume_command(command, opened.store.root)}", file=sys.stderr)
        return exit_code(interrupts.signum) if interrupts.signum else EXIT_INTERRUPTED
    if left.steps or soak_left:
        print(f"runner: {left.steps} step(s){soak_words} not done (see report); a resume sends them: "
              f"{resume_command(command, opened.store.root)}", file=sys.stderr)
    return exit_status([v.world for v in verdicts], left.steps + soak_left)


def _reap_leftovers(matrix: Matrix, todo: Pending) -> None:
    """What a dead runner left is stopped before this run starts, by each backend the pending cards use (its
    registry entry's `reap`), and each removal says why: local servers by recorded PID + start time,
    containers whose owner labels name a dead runner. A live run's are kept."""
    cards = [matrix.cards[c] for lane in todo.lanes for c in lane.cards]
    for backend in dict.fromkeys(c.backend for c in cards):
        entry = BACKENDS.get(backend)
        if entry.reap is not None:
            for note in load(entry.reap)([c.options for c in cards if c.backend == backend]):
                print(f"runner: {note}", file=sys.stderr)
