"""A server-written file's bytes read in a child process bounded in memory and time (`read`), and that child
(`python -m runner.observe.isolated`).

Unpickling builds what the pickle says, and a few bytes say a lot: a 260 KB gzip of 255 MiB of NONE opcodes
becomes a list of 255 M pointers (6.7 GB); shared lists make every walk over them long. A bound on the bytes or
on the opcodes cannot tell that from a real snapshot: the real 34-layer Qwen-Image snapshot is 140 MB as a
pickle, 18.7 M opcodes, ~0.8 GB once unpickled (measured: VmPeak 764 MB; the expandable one 834 MB), and
counting its opcodes in Python (pickletools.genops) alone takes 9 s. So the reader runs in a child whose address
space is capped (RLIMIT_AS) and which is killed at a deadline: a bomb ends as a MemoryError there, said here in
one line, and the runner's own memory never holds what the file built. The child runs only the readers named in
READERS, in its own session (a Ctrl-C at the terminal is the runner's to handle), and hands back plain JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

MAX_MEMORY = 2 * 2**30  # the child's address space: ~2.5x the real snapshot's need
DEADLINE_S = 60.0  # the real snapshot reads in ~3 s
MAX_ANSWER = 64 * 2**20  # the child's JSON (bounded by the readers: sites and texts are capped)
READERS = {"snapshot": "runner.observe.snapshot:read_json", "live": "runner.observe.snapshot:live_json",
           "trace": "runner.observe.trace:read_json"}
_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding the runner package


def read(reader: str, data: bytes, args: dict[str, Any], error: type[ValueError], *,
         memory: int = MAX_MEMORY, deadline_s: float = DEADLINE_S) -> Any:
    """READERS[reader](data, **args) in the bounded child: its JSON answer, or `error` with one line why not
    (the reader's own refusal, the memory cap, the deadline, a child that died)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)}
    header = json.dumps({"reader": reader, "args": args, "memory": memory}).encode() + b"\n"
    proc = subprocess.Popen([sys.executable, "-m", "runner.observe.isolated"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(header + data, timeout=deadline_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise error(f"not read within {deadline_s:g} s") from None
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    try:
        answer = json.loads(out) if len(out) <= MAX_ANSWER else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        raise error(f"its reader ended without an answer ({how})")
    if answer.get("memory"):
        raise error(f"too large: reading it needs more than {memory / 2**30:g} GiB of memory")
    if "error" in answer:
        raise error(str(answer["error"]))
    return answer.get("value")


def _child() -> None:
    import importlib
    import resource

    spec = json.loads(sys.stdin.buffer.readline())
    _, hard = resource.getrlimit(resource.RLIMIT_AS)  # a cap set above this process is kept where it is lower
    memory = int(spec["memory"]) if hard == resource.RLIM_INFINITY else min(int(spec["memory"]), hard)
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    answer: dict[str, Any]
    try:
        module, _, name = READERS[spec["reader"]].partition(":")
        value = getattr(importlib.import_module(module), name)(sys.stdin.buffer.read(), **spec["args"])
        answer = {"value": value}
    except MemoryError:
        answer = {"memory": True}
    except ValueError as exc:  # the reader's one line (SnapshotError, TraceError)
        answer = {"error": str(exc)}
    except Exception as exc:  # anything else the bytes provoked: named, never a traceback
        answer = {"error": f"its reader failed: {type(exc).__name__}"}
    sys.stdout.write(json.dumps(answer))


if __name__ == "__main__":
    _child()
