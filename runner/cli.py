"""Command line: `runner MATRIX`, `runner plan MATRIX`, `runner report RUN_DIR`, `runner refserver ...`.

Parses arguments and maps errors to exit codes; the run itself is runner.app (imported lazily, so `runner
plan` and errors stay fast: no matplotlib/torch at start). Bad input ends as one line on stderr and exit
code 2; an interrupted run keeps every record written so far.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import warnings
from pathlib import Path

from runner import __version__
from runner.core.errors import UserError
from runner.observe import quote

EXIT_HELP = """exit status of a run:
  0    every card reached a world (fits-resident, offload-works, not-built)
  1    some card is undecided, or steps are left that --resume would send
  2    bad input (one line naming file/key/value; nothing started), or a host a card uses
       does not answer (one line per card; --skip-unreachable runs the other cards),
       does not answer, or a run folder another runner holds (the line names it)
  130  interrupted by SIGINT (Ctrl-C), 143 by SIGTERM, 129 by SIGHUP: servers stopped,
       finished steps kept, partial report written, resume command printed; a second
       signal stops at once"""

COMMANDS = ("run", "plan", "report", "compare", "schema", "provision", "refserver", "meter")
# The run folders a person names, made absolute here and nowhere else: the folder reaches a Slurm job step
# (`sbatch --chdir` and `--output` inside it: a relative path there is read from the folder itself), run.json and
# the printed resume command, none of which runs in this working folder (issue 46 R-1).
RUN_FOLDER_ARGS = ("results", "resume", "run_dir", "estimate_from")


def invoked_as(argv0: str | None = None, executable: str | None = None) -> list[str]:
    """The program as the user typed it, for the printed resume command: `.venv/bin/runner` when that is what
    ran (README's setup puts nothing on PATH), plain `runner` only when PATH finds this very script,
    `python -m runner` as run."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    executable = sys.executable if executable is None else executable
    if Path(argv0).name == "__main__.py":  # python -m runner
        return [_from_cwd(executable), "-m", "runner"]
    on_path = shutil.which(Path(argv0).name)
    if on_path and Path(argv0).exists() and Path(on_path).resolve() == Path(argv0).resolve():
        return [Path(argv0).name]
    return [_from_cwd(argv0)]


def _from_cwd(path: str) -> str:
    """A path under the working folder as ./relative (how a person types it), anything else as it is."""
    try:
        rel = Path(path).absolute().relative_to(Path.cwd())
    except ValueError:
        return path
    return str(rel) if len(rel.parts) > 1 else f"./{rel}"


def absolute_folders(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with every run folder given resolved against the working folder (as the matrix's results_dir is)."""
    for name in RUN_FOLDER_ARGS:
        value = getattr(args, name, None)
        if value is not None:
            try:
                setattr(args, name, str(Path(value).resolve()))
            except (OSError, RuntimeError) as exc:  # RuntimeError: a loop of symbolic links
                raise UserError(f"{value}: cannot resolve this folder: {getattr(exc, 'strerror', None) or exc}") \
                    from None
    return args


def cmd_run(args: argparse.Namespace) -> int:
    from PIL import Image

    from runner import app

    # A server's image is refused from its header when it declares more pixels than the run's cap (scoring.decode),
    # and the inputs are checked by preflight: PIL's own warning past 89 Mpx would only put a raw library line on
    # the console, mid-display (the hostile corpus's 12000x12000 PNG did).
    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)

    again = [*invoked_as(), args.matrix, *(["--no-progress"] if args.no_progress else []),
             *(["--metrics-port", str(args.metrics_port)] if args.metrics_port is not None else []),
             *(["--skip-unreachable"] if args.skip_unreachable else [])]
    return app.run(args.matrix, results=args.results, resume=args.resume, progress=not args.no_progress,
                   metrics_port=args.metrics_port, skip_unreachable=args.skip_unreachable, command=again)


def cmd_plan(args: argparse.Namespace) -> int:
    from runner.plan import cli_flags
    from runner.plan.lanes import describe, make_plan
    from runner.plan.matrix import load_matrix

    matrix = load_matrix(args.matrix, check_files=False)
    notes = cli_flags.check(matrix)  # a fork's flags: checked at the run's preflight, said here in one line
    plan = make_plan(matrix)
    print(describe(plan, matrix))
    for note in notes:
        print(note)
    if args.estimate_from:
        from runner.present.cost import estimate, estimate_lines, soak_estimate
        from runner.run.store import RunStore

        root = Path(args.estimate_from)
        if not (root / "run.json").is_file():
            raise UserError(f"--estimate-from {root}: not a run directory (no run.json)")
        store = RunStore(root)
        steps, sessions = store.load_steps(), store.load_sessions()
        soaked = [r for s in store.load_soaks() for r in store.load_soak_requests(s.key)]
        lanes = soak_estimate(matrix, estimate(plan, steps, sessions), plan, steps, sessions, soaked)
        print("\n".join(estimate_lines(lanes, str(root))))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    import tempfile

    from runner.plan.matrix import load_matrix
    from runner.run.store import RunStore

    root = Path(args.run_dir)
    if not (root / "run.json").is_file():
        raise UserError(f"{root}: not a run directory (no run.json)")
    from runner import app

    store = RunStore(root)
    doc = app.declared_run(store.load_run(), root)  # the same check a resume makes: a run.json of this runner
    # The verdict is recomputed from the matrix text stored in the run (the file may have changed since),
    # with relative paths resolved from where the matrix was.
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "matrix.toml"
        copy.write_text(doc["matrix"]["text"])
        try:
            matrix = load_matrix(copy, check_files=False, base=Path(doc["matrix"]["path"]).resolve().parent)
        except UserError as exc:  # name the run's file, not the temporary copy
            raise UserError(str(exc).replace(str(copy), f"{root / 'run.json'} (its matrix.text)")) from None

    app.finish(store, app.as_recorded(matrix, store.load_steps()), rescore=False)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from runner.present.compare import load_summary, render

    text = render(load_summary(Path(args.before)), load_summary(Path(args.after)), show_all=args.all)
    if args.out:
        from runner.run.store import write_output

        write_output(Path(args.out), text)
    print(text, end="")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from runner.present import schemas

    for path in schemas.write(Path(args.out) if args.out else schemas.FOLDER):
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="runner", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Benchmark matrix runner for GPU diffusion serving. `runner MATRIX` runs a matrix.",
        epilog=EXIT_HELP)
    parser.add_argument("--version", action="version", version=f"runner {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a matrix (the default command)", epilog=EXIT_HELP,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("matrix")
    run.add_argument("--results", help="results folder (default: [run] results_dir)")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run in RUN_DIR")
    run.add_argument("--no-progress", action="store_true", help="no live bars, only one line per step")
    run.add_argument("--metrics-port", type=int, metavar="PORT",
                     help="serve the run's live metrics for Prometheus on 127.0.0.1:PORT/metrics (monitoring/ uses "
                     "9450) and a live page of each card's memory and step at http://127.0.0.1:PORT/")
    run.add_argument("--skip-unreachable", action="store_true",
                     help="carry on without a card whose Docker host, sidecar, dcgm-exporter or Prometheus does not "
                     "answer in preflight (one line says so; nothing of it starts, not its soak either: its steps, "
                     "top-ups and soak are left for --resume); without it such a card stops the run before anything "
                     "starts (exit 2)")
    run.set_defaults(func=cmd_run)
    plan = sub.add_parser("plan", help="print the plan of a matrix without running anything")
    plan.add_argument("matrix")
    plan.add_argument("--estimate-from", metavar="RUN_DIR",
                      help="also print the expected GPU time per lane, from an earlier run's load and send times")
    plan.set_defaults(func=cmd_plan)
    report = sub.add_parser("report", help="(re)write report.md, verdict.json and plots of a run")
    report.add_argument("run_dir")
    report.set_defaults(func=cmd_report)
    compare = sub.add_parser("compare", help="what changed between two runs: verdicts, served cells, peaks, latency")
    compare.add_argument("before", metavar="RUN_A")
    compare.add_argument("after", metavar="RUN_B")
    compare.add_argument("--out", help="also write the markdown to this file")
    compare.add_argument("--all", action="store_true", help="list every cell, not only changes beyond noise")
    compare.set_defaults(func=cmd_compare)
    schema = sub.add_parser("schema", help="write the JSON Schemas of the records and verdict.json")
    schema.add_argument("--out", metavar="DIR", help="folder to write them to (default: the package's runner/schema)")
    schema.set_defaults(func=cmd_schema)
    sub.add_parser("refserver", help="the reference diffusion server (see `runner refserver --help`)",
                   add_help=False)
    sub.add_parser("provision", help="provision the GPU hosts with ansible/provision.yml (ansible-runner)",
                   add_help=False)
    sub.add_parser("meter", help="the NVML meter sidecar for remote GPU hosts", add_help=False)
    return parser


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules (blocked)
        return False


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "refserver":
        missing = [m for m in ("torch", "fastapi", "uvicorn") if not _importable(m)]
        if missing and not {"-h", "--help"} & set(argv[1:]):
            print(f"runner: error: `runner refserver` needs the refserver extra ({', '.join(missing)} missing): "
                  "pip install -e '.[refserver]' (scripts/setup.sh does it)", file=sys.stderr)
            return 2
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
        return absolute_folders(args).func(args)
    except BrokenPipeError:  # `runner plan m.toml | head`: the reader left; no traceback for that
        sys.stderr.close()
        return 0
    except UserError as exc:
        for line in str(exc).splitlines() or [""]:  # one line per problem (several unreachable cards)
            print(f"runner: error: {quote.console(line)}", file=sys.stderr)  # may quote a file's or server's text
        return exc.exit_code
