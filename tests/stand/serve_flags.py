"""Run by the stand's own Python: every long flag the real `vllm-omni serve --omni` parser accepts, one per line.
The parser is built as vllm_omni/entrypoints/cli/main.py builds it (its serve subcommand), nothing served."""

import argparse

import vllm_omni.entrypoints.cli.serve as serve
from vllm_omni.utils.tracking_parser import TrackingArgumentParser

parser = TrackingArgumentParser()
sub = parser.add_subparsers(dest="subparser")
for cmd in serve.cmd_init():
    cmd.subparser_init(sub)
flags: set[str] = set()
for name, p in sub.choices.items():
    if name == "serve":
        for action in p._actions:
            if not isinstance(action, argparse._HelpAction):
                flags.update(o for o in action.option_strings if o.startswith("--"))
print("\n".join(sorted(flags)))
