"""Flag sets checked against the real vLLM-Omni command line before anything starts.

A typo in a flag set (`--enable-cpu-offlaod`) otherwise shows only when the server dies at start on the GPU
host, after provisioning and an image pull. What a flag set is checked against:

- a release: what `[servers.X] vllm_omni` names, else the tag of an image named like vllm-omni
  (`vllm/vllm-omni:v0.30.0`, a digest after it ignored, a platform build such as `v0.30.0-cuda12` the same
  release). Its vocabulary — vLLM-Omni's own flags and those of the vLLM it is built on — is a data file per
  version in runner/plan/vllm_omni_flags/, written by scripts/vllm_omni_flags.py from the released wheel
  (never typed by hand);
- else, for a vLLM-Omni server that names no release (a fork: its command runs `--omni`, or its image is
  named like vllm-omni; a pre-release tag such as `v0.30.0rc1`; a release with no shipped vocabulary), the
  server's own `--help`, asked at the run's preflight by runner.run.flag_help; `parse_help` reads it here.
  `runner plan`, which starts nothing, says so in one line (`check`'s notes).

A server that is not vLLM-Omni is not checked: `--help` cannot safely be asked of an arbitrary program (one
that ignores it would start serving).

The spellings `vllm serve` itself accepts pass: `--flag=value`, underscores for dashes, `--flag.key` (a JSON
field of a config flag), `--no-flag` of a known flag (of a flag its `--help` lists as such, when the
vocabulary is a `--help`'s). Unique prefixes (which argparse would take) do not: the flag set should name the
flag it means. Refused as well, naming the flag meant (issue 46, V-1):
- an argument that starts with a typographic dash (`—enable-cpu-offload`, what copying from rendered docs
  gives): always, with or without a vocabulary;
- a single dash before a long flag's name (`-enable-cpu-offload`);
- a long flag's name without its dashes (`enable-cpu-offload`) where it cannot be the value of the argument
  before it: that argument is no flag (a value, or nothing), a flag known to take no value (a `--help` says
  which take one), or — when the vocabulary does not say (a shipped release) — it is a hyphenated name
  (`enable-cpu-offload` is no plausible value; `host` or `model` may be one, and pass). A server command's
  leading positionals (the program, the model) are never read as flags.
"""

from __future__ import annotations

import difflib
import json
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from runner.core.errors import UserError
from runner.plan.matrix import Matrix, ServerProfile

VOCAB_DIR = Path(__file__).resolve().parent / "vllm_omni_flags"

# Dashes that are not the ASCII hyphen-minus argparse reads: what typography and rendered docs put in its place.
DASHES = frozenset("\u2010\u2011\u2012\u2013\u2014\u2015\u2212\u2e3a\u2e3b\ufe58\ufe63\uff0d")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")  # a long flag's name, without its dashes
_NUMBER = re.compile(r"-\d+(\.\d*)?([eE][-+]?\d+)?")  # a negative number is a value, never a flag
_OMNI_REPO = re.compile(r"vllm[-_]omni", re.IGNORECASE)
_VERSION_TAG = re.compile(r"v?(?P<version>\d+\.\d+\.\d+)(?P<rest>.*)")
# A pre- or post-release marker (PEP 440's, and the words images use): `rc1`, `-rc1`, `.dev3`, `a1`, `.post1`.
_PRE_POST = re.compile(r"(?:[-._]?(?P<kind>rc|alpha|beta|dev|pre|preview|nightly|post)|[ab](?=\d))\d*(?![A-Za-z])",
                       re.IGNORECASE)
_VARIANT = re.compile(r"-[A-Za-z][A-Za-z0-9._]*")  # a platform build of the release: -cuda12, -cu130, -rocm


@dataclass(frozen=True)
class Vocabulary:
    """The flags a server takes. `name` says whose they are in a refusal (`vLLM-Omni 0.30.0`, `image X`),
    `source` where that was read (the matrix key naming the release, the `--help` asked). `valued`: the flags
    that take a value; None where the vocabulary does not say (a shipped release)."""

    name: str
    flags: frozenset[str]
    source: str = ""
    valued: frozenset[str] | None = None

    def knows(self, flag: str) -> bool:
        if flag in self.flags:
            return True
        # vLLM's boolean flags take --no-X; a --help lists each such negation itself
        return self.valued is None and flag.startswith("--no-") and "--" + flag[5:] in self.flags

    def near(self, flag: str, cutoff: float = 0.6) -> str | None:
        found = difflib.get_close_matches(flag, sorted(f for f in self.flags if f.startswith("--")), n=1,
                                          cutoff=cutoff)
        return found[0] if found else None

    def with_source(self, source: str) -> Vocabulary:
        return Vocabulary(self.name, self.flags, source, self.valued)


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
    return Vocabulary(f"vLLM-Omni {version}", frozenset(f for group in doc["flags"].values() for f in group))


# --- which release, or none ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageTag:
    """What an image reference says about vLLM-Omni: `omni` when its repository is named like vllm-omni;
    `release` X.Y.Z when its tag is that release; `other` why a version-like tag is not a release."""

    omni: bool
    tag: str | None
    release: str | None = None
    other: str | None = None


def image_tag(image: str) -> ImageTag:
    """`vllm/vllm-omni:v0.30.0@sha256:…` → release 0.30.0 (the digest pins the bytes, the tag still names the
    release); `v0.30.0-cuda12` the same release built for a platform; `v0.30.0rc1`, `0.30.0.post1` no release
    (a pre- or post-release may differ in its flags); `latest`, a commit, no tag: no release."""
    ref = image.partition("@")[0]
    slash, colon = ref.rfind("/"), ref.rfind(":")
    repo, tag = (ref[:colon], ref[colon + 1:]) if colon > slash else (ref, None)
    omni = bool(_OMNI_REPO.search(repo.rpartition("/")[2]))
    m = _VERSION_TAG.fullmatch(tag or "")
    if not (omni and m):
        return ImageTag(omni, tag)
    version, rest = m.group("version"), m.group("rest")
    marker = _PRE_POST.match(rest)
    if not rest or (_VARIANT.fullmatch(rest) and not marker):
        return ImageTag(omni, tag, release=version)
    if marker is None:
        return ImageTag(omni, tag, other=f"image tag {tag} is not exactly the release {version}")
    kind = "a post-release" if (marker.group("kind") or "").lower() == "post" else "a pre-release"
    return ImageTag(omni, tag, other=f"image tag {tag} is {kind} of {version}, not the release")


def release_of(profile: ServerProfile) -> tuple[str, str] | None:
    """(version, where it came from) of a vLLM-Omni server profile, or None when it names none."""
    if profile.vllm_omni:
        return profile.vllm_omni, f"servers.{profile.name}.vllm_omni"
    if profile.image and (release := image_tag(profile.image).release):
        return release, f"servers.{profile.name}.image"
    return None


def omni_server(profile: ServerProfile) -> str | None:
    """Why this server is vLLM-Omni (`vllm serve` runs as vLLM-Omni only with `--omni`), or None."""
    if profile.vllm_omni:
        return f"servers.{profile.name}.vllm_omni names a release"
    if profile.image and image_tag(profile.image).omni:
        return f"image {profile.image} is named like vllm-omni"
    if "--omni" in profile.command:
        return "its command runs --omni"
    return None


def asks_help(profile: ServerProfile) -> str | None:
    """Why a vLLM-Omni server's flags are asked of its own `--help` at preflight (it names no release with a
    shipped vocabulary), or None: a release checks them, or the server is not vLLM-Omni. A release named by
    `vllm_omni` with no shipped vocabulary is an error instead (`check`)."""
    if omni_server(profile) is None or profile.vllm_omni:
        return None
    tag = image_tag(profile.image) if profile.image else None
    if tag and tag.release:
        if vocabulary(tag.release) is not None:
            return None
        return (f"no flag vocabulary for vLLM-Omni {tag.release} is shipped (shipped: "
                f"{', '.join(shipped()) or 'none'})")
    if tag and tag.other:
        return tag.other
    if profile.image:
        return f"image {profile.image} names no release"
    return "its command names no release"


# --- the check ------------------------------------------------------------------------------------------------


def spelled(arg: str) -> str:
    """The flag an argument names, as `vllm serve` reads it (`--a_b.c=1` -> `--a-b`)."""
    name = arg.partition("=")[0]
    head = name[2:].partition(".")[0]
    return "--" + head.replace("_", "-") if name.startswith("--") else name


def _dashes(lead: str) -> str:
    """`—` → 'an em dash (U+2014)': the typographic dashes of an argument's lead, in words."""
    odd = list(dict.fromkeys(c for c in lead if c in DASHES))
    words = [f"{unicodedata.name(c, 'dash').lower()} (U+{ord(c):04X})" for c in odd]
    text = " and ".join(words)
    return ("an " if text[:1] in "aeiou" else "a ") + text


def _may_be_value(prev: str | None, word: str, vocab: Vocabulary) -> bool:
    """Whether `word` can be the value of the argument before it (see the module docstring)."""
    if prev is None or not prev.startswith("-") or "=" in prev or _NUMBER.fullmatch(prev):
        return False
    if prev[:1] in DASHES:
        return True  # refused itself already
    flag = spelled(prev) if prev.startswith("--") else prev
    if not vocab.knows(flag) or vocab.valued is None:
        return "-" not in word and "_" not in word  # arity not known: a single word may be a value
    return flag in vocab.valued


def problems(args: Sequence[str], vocab: Vocabulary | None, *, before: str | None = None,
             positionals: bool = False) -> list[str]:
    """What is wrong with each argument of `args`, one phrase each ending with the flag meant where one is
    known. `before`: the argument just before `args` (the server command's last, for a flag set);
    `positionals`: `args` starts with positionals (a server command: its program, its model), not read as
    flags. Without a vocabulary only the typographic dashes are found."""
    out: list[str] = []
    prev, leading = before, positionals
    for arg in args:
        if arg == "--":  # argparse's end of options: what follows is positional
            break
        lead = len(arg) - len(arg.lstrip("-" + "".join(DASHES)))
        if lead and any(c in DASHES for c in arg[:lead]):
            if name := _NAME.match(arg[lead:]):
                meant = "--" + name.group(0).replace("_", "-")
                near = meant if vocab is None or vocab.knows(meant) else vocab.near(meant)
                tail = (f"; did you mean {near}?" if near else
                        f"; {meant} is not a flag of {vocab.name} either" if vocab else "")
                out.append(f"{arg} starts with {_dashes(arg[:lead])}, not '--' (what copying a flag from "
                           f"rendered docs gives){tail}")
            leading = False
        elif arg.startswith("--"):
            leading = False
            flag = spelled(arg)
            if vocab is not None and not vocab.knows(flag):
                near = vocab.near(flag)
                out.append(f"{arg} is not a flag of {vocab.name}{_src(vocab)}"
                           + (f"; did you mean {near}?" if near else ""))
        elif arg.startswith("-") and len(arg) > 1:
            leading = False
            if vocab is not None and not _NUMBER.fullmatch(arg) and arg.partition("=")[0] not in vocab.flags:
                meant = spelled("-" + arg)
                near = meant if vocab.knows(meant) else vocab.near(meant, cutoff=0.85)
                if near:
                    out.append(f"{arg} has one dash, so argparse reads it as short options ({vocab.name}"
                               f"{', ' + vocab.source if vocab.source else ''}); did you mean {near}?")
        elif vocab is not None and not leading and _NAME.fullmatch(arg):
            meant = "--" + arg.replace("_", "-")
            if meant in vocab.flags and not _may_be_value(prev, arg, vocab):
                value = (f"; if it is the value of {prev}, write {prev}={arg}" if vocab.valued is None
                         and prev and prev.startswith("--") and "=" not in prev else "")
                out.append(f"{arg} is a flag of {vocab.name} without its dashes{_src(vocab)}{value}; did you "
                           f"mean {meant}?")
        prev = arg
    return out


def _src(vocab: Vocabulary) -> str:
    return f" ({vocab.source})" if vocab.source else ""


def check_server(matrix: Matrix, name: str, vocab: Vocabulary | None) -> None:
    """UserError (one line) for the first problem of server `name`'s command or of a flag set (`problems`)."""
    profile = matrix.servers[name]
    command = profile.command
    places: list[tuple[str, tuple[str, ...], str | None, bool]] = [(f"servers.{name}.command", command, None, True)]
    places += [(f"flags.{f}.args", matrix.flags[f].args, command[-1] if command else None, False)
               for f in matrix.axes.flags]
    for place, args, before, positionals in places:
        for problem in problems(args, vocab, before=before, positionals=positionals)[:1]:
            raise UserError(f"{matrix.path}: key '{place}': {problem}")


def check(matrix: Matrix) -> list[str]:
    """The flag check that needs nothing started: UserError (one line) for the first bad flag of a flag set or
    of a server command where the server's release is known (and, for every vLLM-Omni server, for a
    typographic dash); a release named by `vllm_omni` with no shipped vocabulary is an error. Returns one
    line per vLLM-Omni server whose flags are left to its own `--help` at the run's preflight."""
    notes = []
    for name in sorted({matrix.cards[c].server for c in matrix.axes.cards}):
        profile = matrix.servers[name]
        if omni_server(profile) is None:
            continue
        found = release_of(profile)
        vocab = vocabulary(found[0]) if found else None
        if found and vocab is None and found[1].endswith(".vllm_omni"):
            have = ", ".join(shipped()) or "none"
            raise UserError(f"{matrix.path}: key '{found[1]}': no flag vocabulary for vLLM-Omni {found[0]} "
                            f"(shipped: {have}; make one with scripts/vllm_omni_flags.py {found[0]})")
        check_server(matrix, name, vocab.with_source(found[1]) if vocab and found else None)
        if (why := asks_help(profile)) is not None:
            notes.append(f"flags: server '{name}' is vLLM-Omni and {why}: its flag sets are checked against the "
                         f"server's own --help at the run's preflight, before any server starts")
    return notes


# --- a server's own --help --------------------------------------------------------------------------------------

# An option line of argparse's help: two spaces, the invocation ("-s, --long METAVAR"), then two spaces and the
# help or the end of the line. Each comma-separated part is one option string and, when it takes a value, its
# metavar ("--x X", "--x {a,b}", "--x [X ...]"); before Python 3.13 every part repeats the metavar.
_OPTION_LINE = re.compile(r"  (-\S.*?)(?: {2,}\S.*)?")
# An option string as a server may print it (its --help is untrusted: nothing else reaches a refusal line).
OPTION = re.compile(r"-{1,2}[A-Za-z0-9#?][A-Za-z0-9_.#?+-]{0,127}")
_OPTION_PART = re.compile(rf"(?P<flag>{OPTION.pattern})(?P<metavar> \S.*)?")


def parse_help(text: str) -> tuple[frozenset[str], frozenset[str]]:
    """(every option string, those that take a value) of an argparse `--help`. Only option lines count: the
    usage, descriptions, epilogs and help texts (indented otherwise, or not made of option strings) do not."""
    flags: set[str] = set()
    valued: set[str] = set()
    for line in text.splitlines():
        m = _OPTION_LINE.fullmatch(line.rstrip())
        if not m:
            continue
        # split before each option string only: vLLM's metavars list choices as "['auto', 'hf']"
        parts = [_OPTION_PART.fullmatch(p) for p in re.split(r", (?=-)", m.group(1))]
        if not all(parts):
            continue
        names = {p.group("flag") for p in parts if p}
        flags |= names
        if any(p.group("metavar") for p in parts if p):
            valued |= names
    return frozenset(flags), frozenset(valued)


def from_help(text: str, name: str, source: str) -> Vocabulary | None:
    """A vocabulary from a `--help`, or None when it lists no flag beyond -h/--help."""
    flags, valued = parse_help(text)
    if not flags - {"-h", "--help"}:
        return None
    return Vocabulary(name, flags, source, valued)
