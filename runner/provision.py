"""`runner provision`: ansible/provision.yml through ansible-runner (the same playbook `ansible-playbook`
runs), so provisioning and the run share one tool and one virtual environment."""

from __future__ import annotations

import argparse
import getpass
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

REPO = Path(__file__).resolve().parents[1]
# ansible-playbook's prompt for -K / --ask-become-pass; ansible-runner answers it from `passwords`.
BECOME_PROMPT = r"^BECOME password.*:\s*?$"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="runner provision", description="Provision the GPU hosts: driver/CUDA and "
                                "toolkit checks, the pinned serving image, asset digests, meters, monitoring.")
    p.add_argument("--playbook", type=Path, default=REPO / "ansible" / "provision.yml")
    p.add_argument("-i", "--inventory", default=str(REPO / "ansible" / "inventory.yml"),
                   help="inventory file or a host list such as 'localhost,' (default: ansible/inventory.yml)")
    p.add_argument("-t", "--tags", help="roles to run: preflight, docker, meters_sidecar, assets, serving_image, "
                   "meters_dcgm, monitoring")
    p.add_argument("--skip-tags", help="roles to leave out, e.g. meters_dcgm,serving_image")
    p.add_argument("-l", "--limit", help="hosts to run on, e.g. rtx3090")
    p.add_argument("--check", action="store_true", help="dry run: report what would change, change nothing")
    p.add_argument("--diff", action="store_true", help="show the changes to files (with --check: the would-be ones)")
    p.add_argument("-K", "--ask-become-pass", action="store_true",
                   help="ask for the sudo password (package installs, /etc/prometheus, Grafana, services)")
    p.add_argument("-e", "--extra-var", action="append", default=[], metavar="KEY=VALUE")
    return p


def run_kwargs(args: argparse.Namespace, extravars: dict[str, str], become_password: str | None) -> dict[str, Any]:
    """What ansible_runner.run gets for these arguments (pure: the CLI and its test share it)."""
    flags = [f for f, on in (("--check", args.check), ("--diff", args.diff),
                             ("--ask-become-pass", become_password is not None)) if on]
    kwargs: dict[str, Any] = {"playbook": str(args.playbook), "inventory": args.inventory, "tags": args.tags,
                              "skip_tags": args.skip_tags, "limit": args.limit, "extravars": extravars,
                              "cmdline": " ".join(flags) or None}
    if become_password is not None:
        kwargs["passwords"] = {BECOME_PROMPT: become_password}
    return kwargs


def read_become_password(stdin: TextIO) -> str:
    """A person at a terminal is asked on it (no echo); piped input (`... -K < file`, a test, CI) gives the
    password as its first line. getpass alone would open the controlling terminal even when stdin is a
    pipe, and wait there for a keyboard that a script never uses."""
    if stdin.isatty():
        return getpass.getpass("BECOME password: ")
    print("BECOME password: (read from stdin, which is not a terminal)", file=sys.stderr)
    return stdin.readline().rstrip("\r\n")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.playbook.is_file():
        print(f"runner: error: playbook not found: {args.playbook}", file=sys.stderr)
        return 2
    extravars = {}
    for item in args.extra_var:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"runner: error: --extra-var must be KEY=VALUE, got {item!r}", file=sys.stderr)
            return 2
        extravars[key] = value
    # Asked here, once, and handed to ansible-runner's prompt answering: never put on a command line or in a file.
    password = read_become_password(sys.stdin) if args.ask_become_pass else None
    import ansible_runner

    venv_bin = str(Path(sys.executable).parent)
    env = {"ANSIBLE_CONFIG": str(args.playbook.parent / "ansible.cfg"),
           "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"}  # this venv's ansible-playbook
    with tempfile.TemporaryDirectory(prefix="runner-provision-") as pdd:
        result = ansible_runner.run(private_data_dir=pdd, envvars=env, **run_kwargs(args, extravars, password))
    print(f"runner provision: {result.status} (rc {result.rc})", file=sys.stderr)
    return int(result.rc or 0) if result.status == "successful" else int(result.rc or 1)
