"""Command line: `runner MATRIX`, `runner plan MATRIX`, `runner report RUN_DIR`, `runner refserver ...`.

Bad input ends as one line on stderr and exit code 2; an interrupted run keeps every record written so far.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from runner import __version__
from runner.errors import UserError

if TYPE_CHECKING:  # imported lazily below: `runner plan` and errors stay fast, no matplotlib/torch at start
    from runner.execute import RunContext
    from runner.matrix import Matrix
    from runner.plan import Plan
    from runner.store import RunStore

COMMANDS = ("run", "plan", "report", "compare", "provision", "refserver", "meter")


def cmd_run(args: argparse.Namespace) -> int:
    from runner import runinfo
    from runner.execute import Events, RunContext, run_plan
    from runner.matrix import load_matrix
    from runner.plan import make_plan
    from runner.progress import ProgressView
    from runner.store import RunStore

    matrix = load_matrix(args.matrix)
    plan = make_plan(matrix)
    started = dt.datetime.now().timestamp()
    if args.resume:
        root = Path(args.resume)
        if not (root / "run.json").is_file():
            raise UserError(f"{root}: not a run directory (no run.json)")
        run_doc = json.loads((root / "run.json").read_text())
        if run_doc["matrix"]["sha256"] != matrix.sha256:
            raise UserError(f"{args.matrix}: matrix changed since run {run_doc['run_id']} (sha256 differs)")
        run_id = run_doc["run_id"]
    else:
        run_id = re.sub(r"[^a-zA-Z0-9_.-]+", "-", matrix.run.name) + "-" + runinfo.iso_time(started).replace(":", "")
        root = (Path(args.results) if args.results else matrix.run.results_dir) / run_id
        run_doc = runinfo.run_doc(matrix, plan, run_id, started)
    store = RunStore(root)
    store.write_run(run_doc)
    # Skipped steps are sent on resume (an interrupt or a restart limit skipped them); done ones are not.
    done = {s.key: s for s in store.load_steps() if s.status != "skipped"} if args.resume else {}
    print(f"runner: run {run_id}: {len(plan.sessions)} server start(s), {len(plan.steps)} request(s) "
          f"→ {root}", file=sys.stderr)
    _reap_leftovers(matrix, plan)
    view = ProgressView(enabled=not args.no_progress)
    events: Events = view
    exporter = None
    if args.metrics_port is not None:
        from runner.exporter import Fanout, RunExporter

        try:
            exporter = RunExporter(run_id, args.metrics_port)
        except OSError as exc:
            raise UserError(f"--metrics-port {args.metrics_port}: cannot listen on 127.0.0.1: {exc.strerror}") \
                from None
        events = Fanout(view, exporter)
    ctx = RunContext(matrix=matrix, plan=plan, store=store, run_id=run_id, events=events, done=done)
    interrupted = False
    try:
        with view:
            run_plan(ctx)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if exporter:
            exporter.close()
    finished = dt.datetime.now().timestamp()
    store.write_run({**run_doc, "finished_at": finished, "finished_at_iso": runinfo.iso_time(finished),
                     "interrupted": interrupted, "cards": runinfo.card_facts(run_doc["cards"], store)})
    _finish(store, matrix, ctx)
    if interrupted:
        print(f"runner: interrupted; every finished step is in {root} (resume with --resume {root})",
              file=sys.stderr)
        return 130
    return 0


def _reap_leftovers(matrix: Matrix, plan: Plan) -> None:
    """Containers labelled by an earlier, interrupted run of this runner are removed before this one starts;
    nothing without the runner's label is touched."""
    hosts = {matrix.cards[c].docker_host for lane in plan.lanes for c in lane.cards
             if matrix.cards[c].backend == "docker"}
    if not hosts:
        return
    from docker.errors import DockerException

    from runner.backends.docker import reap

    for host in hosts:
        where = host or "local engine"
        try:
            for name in reap(host):
                print(f"runner: removed container {name} left by an earlier run ({where})", file=sys.stderr)
        except DockerException as exc:
            print(f"runner: could not check {where} for leftover containers: {exc}", file=sys.stderr)


def _finish(store: RunStore, matrix: Matrix, ctx: RunContext | None = None) -> None:
    from runner import baseline
    from runner.execute import rescore_against_cell
    from runner.report import write_report
    from runner.verdict import decide_all

    if ctx is not None:
        rescore_against_cell(ctx)
    steps, sessions = store.load_steps(), store.load_sessions()
    wall = None
    if matrix.baseline and matrix.baseline.directory:
        target = matrix.verdict.target_references
        try:
            samples = baseline.load_samples(matrix.baseline.directory)
        except UserError as exc:  # the report still comes out; only the baseline's latency is missing
            print(f"runner: warning: {exc}", file=sys.stderr)
            samples = []
        walls = [s.wall_s for s in samples if s.wall_s and s.references in (target, None)]
        wall = statistics.fmean(walls) if walls else None
    verdicts = decide_all(steps, sessions, matrix.verdict, list(dict.fromkeys(s.card for s in steps)), wall)
    report = write_report(store, verdicts)
    for v in verdicts:
        print(f"{v.card}: {v.world} — {v.reason}")
    print(f"report: {report}")


def cmd_plan(args: argparse.Namespace) -> int:
    from runner.matrix import load_matrix
    from runner.plan import describe, make_plan

    matrix = load_matrix(args.matrix, check_files=False)
    print(describe(make_plan(matrix), matrix))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    import tempfile

    from runner.matrix import load_matrix
    from runner.store import RunStore

    root = Path(args.run_dir)
    if not (root / "run.json").is_file():
        raise UserError(f"{root}: not a run directory (no run.json)")
    store = RunStore(root)
    doc = store.load_run()
    # The verdict is recomputed from the matrix text stored in the run (the file may have changed since),
    # with relative paths resolved from where the matrix was.
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "matrix.toml"
        copy.write_text(doc["matrix"]["text"])
        matrix = load_matrix(copy, check_files=False, base=Path(doc["matrix"]["path"]).resolve().parent)
    _finish(store, matrix)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from runner.compare import load_summary, render

    text = render(load_summary(Path(args.before)), load_summary(Path(args.after)))
    if args.out:
        Path(args.out).write_text(text)
    print(text, end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="runner", description="Benchmark matrix runner for GPU diffusion "
                                     "serving. `runner MATRIX` runs a matrix.")
    parser.add_argument("--version", action="version", version=f"runner {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a matrix (the default command)")
    run.add_argument("matrix")
    run.add_argument("--results", help="results folder (default: [run] results_dir)")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run in RUN_DIR")
    run.add_argument("--no-progress", action="store_true", help="no live bars, only one line per step")
    run.add_argument("--metrics-port", type=int, metavar="PORT",
                     help="serve the run's live metrics for Prometheus on 127.0.0.1:PORT (monitoring/ uses 9450)")
    run.set_defaults(func=cmd_run)
    plan = sub.add_parser("plan", help="print the plan of a matrix without running anything")
    plan.add_argument("matrix")
    plan.set_defaults(func=cmd_plan)
    report = sub.add_parser("report", help="(re)write report.md, verdict.json and plots of a run")
    report.add_argument("run_dir")
    report.set_defaults(func=cmd_report)
    compare = sub.add_parser("compare", help="what changed between two runs: verdicts, served cells, peaks, latency")
    compare.add_argument("before", metavar="RUN_A")
    compare.add_argument("after", metavar="RUN_B")
    compare.add_argument("--out", help="also write the markdown to this file")
    compare.set_defaults(func=cmd_compare)
    sub.add_parser("refserver", help="the reference diffusion server (see `runner refserver --help`)",
                   add_help=False)
    sub.add_parser("provision", help="provision the GPU hosts with ansible/provision.yml (ansible-runner)",
                   add_help=False)
    sub.add_parser("meter", help="the NVML meter sidecar for remote GPU hosts", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "refserver":
        from runner.refserver.cli import main as refserver_main

        return refserver_main(argv[1:])
    if argv and argv[0] == "provision":
        from runner.provision import main as provision_main

        return provision_main(argv[1:])
    if argv and argv[0] == "meter":
        from runner.meters.sidecar import main as meter_main

        return meter_main(argv[1:])
    if argv and argv[0] not in COMMANDS and not argv[0].startswith("-"):
        argv.insert(0, "run")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as exc:
        print(f"runner: error: {exc}", file=sys.stderr)
        return exc.exit_code
