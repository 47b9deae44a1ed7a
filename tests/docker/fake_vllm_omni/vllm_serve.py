"""Stands for `vllm serve` of the seed's vLLM-Omni image in the flag tests (tests/docker/test_fork_flags_image.py), the
one thing the preflight asks of it: its help. What is real: vLLM-Omni 0.30.0's flag names (the shipped
vocabulary, copied beside this file into the image), Python's own argparse help format, and vLLM's split of it
(a plain --help lists the config groups only, --help=all every flag; without --omni, vLLM's flags alone, as
vLLM-Omni's entry point dispatches on it). What is not: which flags take a value is guessed from their names
(the vocabulary does not record it), and nothing is served."""

import argparse
import json
import sys
from pathlib import Path

DOC = json.loads((Path(__file__).parent / "0.30.0.json").read_text())
NO_VALUE = ("--enable-", "--disable-", "--use-", "--vae-use-", "--enforce-eager", "--omni", "--log-stats",
            "--trust-remote-code", "--headless")


def parser(omni: bool) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vllm serve", usage="vllm serve [model_tag] --omni [options]",
                                 description="Launch a local OpenAI-compatible API server (a stand-in).",
                                 epilog="Use `--help=all` to show all available flags at once.")
    ap.add_argument("model_tag", nargs="?")
    groups = {"OmniConfig": DOC["flags"]["vllm-omni"] if omni else [], "EngineArgs": DOC["flags"]["vllm"]}
    for title, flags in groups.items():
        group = ap.add_argument_group(title, f"{title} flags.")
        for flag in flags:
            if flag.startswith(NO_VALUE):
                group.add_argument(flag, action="store_true")
            else:
                group.add_argument(flag, metavar=flag.lstrip("-").replace("-", "_").upper())
    return ap


def main(argv: list[str]) -> int:
    ap = parser("--omni" in argv)
    if "--help=all" in argv:
        print(ap.format_help())
        return 0
    if "--help" in argv or "-h" in argv:
        print(ap.format_usage() + "\nConfig Groups:\n"
              + "".join(f"  {g.title:<22}{g.description}\n" for g in ap._action_groups if g._group_actions))
        return 0
    ap.parse_args(argv)
    print("the stand-in serves nothing", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
