#!/usr/bin/env python3
"""Maintainer script: the command-line flags of one vLLM-Omni release, read from its published wheel as
source (AST), nothing imported or run, written to runner/plan/vllm_omni_flags/<version>.json.

    scripts/vllm_omni_flags.py 0.30.0 --vllm-sdist /tmp/vllm-0.30.0.tar.gz

`vllm serve --omni` takes two sets of flags: vLLM-Omni's own (its `add_argument` calls in
vllm_omni/entrypoints/cli/serve.py and vllm_omni/engine/arg_utils.py) and those of the vLLM it is built on
(engine and frontend arguments). vLLM-Omni X.Y is aligned with vLLM X.Y (its version.py warns otherwise), and
vLLM publishes recent releases as source archives only, so the vLLM half is read from that archive, given
with --vllm-sdist (how to fetch it without building it: docs/vllm-omni.md). The wheel is fetched here with
`pip download --no-deps vllm-omni==VERSION` (nothing installed).

A flag is every string starting with "-" among an add_argument call's positional arguments. Where a module
registers flags from dataclass fields (an add_argument whose flag is an f-string: vLLM's FrontendArgs), the
fields of that module's *Args classes are flags too, spelled --field-name.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import json
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

OUT_DIR = Path(__file__).resolve().parent.parent / "runner" / "plan" / "vllm_omni_flags"

# The modules whose add_argument calls build `vllm serve --omni`'s parser (benchmark CLIs left out).
OMNI_MODULES = ("vllm_omni/entrypoints/cli/serve.py", "vllm_omni/engine/arg_utils.py")
VLLM_MODULES = ("vllm/engine/arg_utils.py", "vllm/entrypoints/cli/serve.py")
VLLM_CLI_ARGS = "cli_args.py"  # vllm/entrypoints/**/cli_args.py: the frontend's arguments


def flags_in_source(text: str) -> set[str]:
    """The flags a module's add_argument calls register (see the module docstring)."""
    tree = ast.parse(text)
    flags: set[str] = set()
    dynamic = False
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and _callee(node) == "add_argument"):
            continue
        for arg in node.args:
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("-"):
                flags.add(arg.value)
            elif isinstance(arg, ast.JoinedStr):
                dynamic = True
    if dynamic:
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name.endswith("Args")):
            for stmt in cls.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) \
                        and not stmt.target.id.startswith("_"):
                    flags.add("--" + stmt.target.id.replace("_", "-"))
    return flags


def _callee(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def omni_flags(wheel: Path) -> tuple[set[str], dict[str, int]]:
    """vLLM-Omni's own flags from its wheel, and how many each module gave."""
    flags: set[str] = set()
    counts: dict[str, int] = {}
    with zipfile.ZipFile(wheel) as zf:
        for name in OMNI_MODULES:
            found = flags_in_source(zf.read(name).decode("utf-8"))
            counts[name] = len(found)
            flags |= found
    return flags, counts


def vllm_flags(sdist: Path) -> tuple[set[str], dict[str, int]]:
    """vLLM's engine and frontend flags from its source archive (paths inside it lose the top folder)."""
    flags: set[str] = set()
    counts: dict[str, int] = {}
    with tarfile.open(sdist) as tf:
        for member in tf.getmembers():
            inner = str(PurePosixPath(*PurePosixPath(member.name).parts[1:]))
            wanted = inner in VLLM_MODULES or (inner.startswith("vllm/entrypoints/")
                                               and PurePosixPath(inner).name == VLLM_CLI_ARGS)
            if not (wanted and member.isfile()):
                continue
            handle = tf.extractfile(member)
            assert handle is not None
            found = flags_in_source(io.TextIOWrapper(handle, encoding="utf-8").read())
            counts[inner] = len(found)
            flags |= found
    return flags, counts


def download_wheel(version: str, into: Path, *, timeout_s: float = 120) -> Path:
    """`pip download --no-deps vllm-omni==VERSION` into `into`; the wheel's path (CalledProcessError or
    TimeoutExpired when the index does not answer)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                    "--timeout", "15", "--retries", "1", "--disable-pip-version-check", "-q",
                    f"vllm-omni=={version}", "-d", str(into)],
                   check=True, capture_output=True, text=True, timeout=timeout_s)
    wheels = sorted(into.glob(f"vllm_omni-{version}-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"pip download left no vllm_omni-{version} wheel in {into}")
    return wheels[0]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def vocabulary(version: str, wheel: Path, sdist: Path | None, command: Iterable[str]) -> dict[str, object]:
    """The data file's content (sorted, so that a re-run on the same archives writes the same bytes)."""
    omni, omni_counts = omni_flags(wheel)
    doc: dict[str, object] = {
        "generated_by": " ".join(command),
        "note": "written by scripts/vllm_omni_flags.py from the release's own files; do not edit by hand",
        "vllm_omni": version,
        "wheel": {"file": wheel.name, "sha256": _sha256(wheel), "modules": omni_counts},
        "flags": {"vllm-omni": sorted(omni)},
    }
    if sdist is not None:
        vflags, v_counts = vllm_flags(sdist)
        doc["vllm_sdist"] = {"file": sdist.name, "sha256": _sha256(sdist), "modules": v_counts}
        doc["flags"] = {"vllm-omni": sorted(omni), "vllm": sorted(vflags - omni)}
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("version", help="the vLLM-Omni release, e.g. 0.30.0")
    ap.add_argument("--vllm-sdist", type=Path, help="the aligned vLLM release's source archive (.tar.gz)")
    ap.add_argument("--wheel", type=Path, help="a vllm_omni wheel already downloaded (default: pip download)")
    ap.add_argument("--out", type=Path, default=OUT_DIR, help=f"folder of the data files (default {OUT_DIR})")
    args = ap.parse_args(argv)
    command = ["scripts/vllm_omni_flags.py", args.version]
    if args.vllm_sdist:
        command += ["--vllm-sdist", args.vllm_sdist.name]
    with tempfile.TemporaryDirectory() as tmp:
        try:
            wheel = args.wheel or download_wheel(args.version, Path(tmp))
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, FileNotFoundError) as exc:
            print(f"vllm_omni_flags: could not fetch vllm-omni=={args.version}: "
                  f"{getattr(exc, 'stderr', None) or exc}".strip(), file=sys.stderr)
            return 1
        doc = vocabulary(args.version, wheel, args.vllm_sdist, command)
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / f"{args.version}.json"
    target.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    flags = doc["flags"]
    assert isinstance(flags, dict)
    print(f"{target}: " + ", ".join(f"{len(v)} {k} flags" for k, v in flags.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
