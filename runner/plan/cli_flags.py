"""Flag sets checked against the real vLLM-Omni command line before anything starts.

A typo in a flag set (`--enable-cpu-offlaod`) otherwise shows only when the server dies at start on the GPU
host, after provisioning and an image pull. The vocabulary of a release — vLLM-Omni's own flags and those of
the vLLM it is built on — is a data file per version in runner/plan/vllm_omni_flags/, written by
scripts/vllm_omni_flags.py from the released wheel (never typed by hand).

The release is what `[servers.X] vllm_omni` names, else the tag of a pinned image named like vllm-omni
(`vllm/vllm-omni:v0.30.0`). The spellings `vllm serve` itself accepts pass: `--flag=value`, underscores for
dashes, `--flag.key` (a JSON field of a config flag), `--no-flag` of a known flag. Unique prefixes (which
argparse would take) do not: the flag set should name the flag it means.
"""

from __future__ import annotations

import difflib
import json
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from runner.core.errors import UserError
from runner.plan.matrix import Matrix, ServerProfile

VOCAB_DIR = Path(__file__).resolve().parent / "vllm_omni_flags"
_IMAGE_TAG = re.compile(r"vllm[-_]omni[^:/]*:v?(?P<version>\d+\.\d+\.\d+)$")


@dataclass(frozen=True)
class Vocabulary:
    version: str
    flags: frozenset[str]


def shipped() -> tuple[str, ...]:
    """The releases whose vocabulary is shipped, oldest first."""
    return tuple(sorted((p.stem for p in VOCAB_DIR.glob("*.json")),
                        key=lambda v: tuple(int(x) for x in v.split(".") if x.isdigit())))


@cache
def vocabulary(version: str) -> Vocabulary | None:
    file = VOCAB_DIR / f"{version}.json"
    if not file.is_file():
        return None
    doc = json.loads(file.read_text(encoding="utf-8"))
    return Vocabulary(version, frozenset(f for group in doc["flags"].values() for f in group))


def release_of(profile: ServerProfile) -> tuple[str, str] | None:
    """(version, where it came from) of a vLLM-Omni server profile, or None when it names none."""
    if profile.vllm_omni:
        return profile.vllm_omni, f"servers.{profile.name}.vllm_omni"
    if profile.image and (m := _IMAGE_TAG.search(profile.image)):
        return m.group("version"), f"servers.{profile.name}.image"
    return None


def spelled(arg: str) -> str:
    """The flag an argument names, as `vllm serve` reads it (`--a_b.c=1` -> `--a-b`)."""
    name = arg.partition("=")[0]
    head = name[2:].partition(".")[0]
    return "--" + head.replace("_", "-") if name.startswith("--") else name


def unknown(args: Iterable[str], vocab: Vocabulary) -> list[tuple[str, str | None]]:
    """Each flag of `args` the release does not have, with its nearest real flag (None: nothing close)."""
    out = []
    for arg in args:
        if not arg.startswith("--") or arg == "--":
            continue  # a value (fp8, a JSON object, a path) or a short flag: not checked
        flag = spelled(arg)
        if flag in vocab.flags or (flag.startswith("--no-") and "--" + flag[5:] in vocab.flags):
            continue
        near = difflib.get_close_matches(flag, sorted(vocab.flags), n=1, cutoff=0.6)
        out.append((arg, near[0] if near else None))
    return out


def check(matrix: Matrix) -> None:
    """UserError (one line) for the first flag of a flag set, or of a server command, that the vLLM-Omni
    release its server names does not have; a release with no shipped vocabulary is an error when named
    by `vllm_omni`, a warning when read from an image tag."""
    used_servers = {matrix.cards[c].server for c in matrix.axes.cards}
    for name in sorted(used_servers):
        profile = matrix.servers[name]
        found = release_of(profile)
        if found is None:
            continue
        version, key = found
        vocab = vocabulary(version)
        if vocab is None:
            have = ", ".join(shipped()) or "none"
            why = (f"no flag vocabulary for vLLM-Omni {version} (shipped: {have}; make one with "
                   f"scripts/vllm_omni_flags.py {version})")
            if key.endswith(".vllm_omni"):
                raise UserError(f"{matrix.path}: key '{key}': {why}")
            print(f"runner: warning: {matrix.path}: {key}: {why}: flag sets not checked", file=sys.stderr)
            continue
        places = [(f"servers.{name}.command", profile.command)]
        places += [(f"flags.{f}.args", matrix.flags[f].args) for f in matrix.axes.flags]
        for place, args in places:
            for arg, near in unknown(args, vocab)[:1]:
                hint = f"; did you mean {near}?" if near else ""
                raise UserError(f"{matrix.path}: key '{place}': {arg} is not a flag of vLLM-Omni {version} "
                                f"({key}){hint}")
