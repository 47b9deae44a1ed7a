"""The server's Python traceback in a log window → its frames and the OOM site (pure).

Logs are read as they are: each line may carry a worker-process prefix (`(EngineCore_0 pid=4242) `,
`(DiffusionWorker pid=4243) `), then a logger record's (`ERROR 12-05 07:51:10 [diffusion_worker.py:1870] `:
vLLM-Omni 0.30.0 logs its tracebacks so) or torch's `[rank0]: `, and lines of other processes may sit between
a traceback's lines; a traceback's lines are followed per prefix, so an interleaved line of another process
neither ends nor joins it. The traceback read is the last one whose exception is an out-of-memory error (the
last raised as one, before a wrapper that only carries its text); one longer than the log window (its header
left out) is read from its first whole frame.

The site rule (docs/results.md): the site is the innermost frame of the server's own code, where a frame is
the server's own when
1. it is not the Python standard library (`…/lib/python3.X/…` outside site-packages, `<frozen …>`),
2. its package is not a framework the server calls (FRAMEWORKS: torch, triton, … — their frames show how an
   allocation was made, not where the server asked for it), and
3. it is inside one of the server's packages (SERVER_PACKAGES, however installed: a wheel in site-packages or
   an editable clone), or outside any site-packages/dist-packages folder (a clone or a script the server
   runs from source: the server's code by where it lives). Third-party packages installed in site-packages
   (diffusers, transformers, vllm under vLLM-Omni) are not the server's code.
The accounted card's allocator (ALLOCATOR_STANDINS: the tensor ledger the reference server and the vLLM-Omni test
stand count with) is never the server's own code, as PyTorch's native allocator has no frame at all.
A traceback with no such frame (all torch frames, say) has no site: it says "no server frame", keeping its
innermost frames as evidence, rather than naming a library's line as the place for a fix. A `__torch_dispatch__`
hook (a TorchDispatchMode or a tensor subclass: an accounting shim that plays the allocator's part, as vLLM-Omni's
CPU probe did) and every frame it calls run inside torch's dispatcher for the op the server's line asked for:
they are the allocator's frames, which a CUDA OOM's traceback never shows, never the site.

Prefixes are read off each line before anything else: the process (`(APIServer pid=N) `), torch.distributed's
rank (`[rank0]: `) and vLLM's logger header (`ERROR 12-05 07:15:37 [stage_runtime.py:308] `, repeated on every
line of a logged traceback). A traceback is followed per stream (process, rank, logger call), so vLLM-Omni's
habit of printing one failure four times (two loggers, the thread's excepthook, the main thread's exit), with
lines of other streams between, reads as four tracebacks. Python's chain markers ("The above exception was the
direct cause of the following exception:", "During handling of the above exception, another exception
occurred:") link a stream's tracebacks into one chain, root cause first (`chains`).

Paths are shortened to the package-relative form: from inside site-packages, else from the innermost
server or framework package folder (`…/src/vllm-omni/vllm_omni/diffusion/models/utils.py` →
`vllm_omni/diffusion/models/utils.py`), else kept whole.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where a Frame is made: the isolated snapshot reader needs no pydantic (0.1 s a child)
    from runner.core.records import Frame

# What the runner knows as the servers it drives: vLLM-Omni and the reference server (package `runner`).
SERVER_PACKAGES = ("vllm_omni", "runner")
FRAMEWORKS = ("torch", "torchvision", "torchaudio", "triton", "functorch", "numpy", "accelerate", "safetensors",
              "xformers", "flash_attn", "bitsandbytes", "torchao")
CALLERS_KEPT = 3
# The accounted card's allocator: the reference server's tensor ledger, which the vLLM-Omni test stand's platform
# runs inside the real server too. Its frames stand where a CUDA OOM's native allocator frames would be (none):
# how the memory was asked for, not where.
ALLOCATOR_STANDINS = ("runner/refserver/ledger.py", "runner/refserver/memory.py")

# vLLM's `_add_prefix` writes `(VllmWorker rank=0 pid=4242) `, coloured on a terminal
# (`\x1b[1;36m(DiffusionWorker pid=4243)\x1b[0;0m `); the log window is read inert (quote.py), where ESC is
# the visible text `\x1b`: both spellings of the colour codes are part of the prefix.
_SGR = r"(?:\x1b|\\x1b)\[[0-9;]*m"
PREFIX = re.compile(rf"^(?:{_SGR})*\((?P<who>[A-Za-z][\w.-]*(?: [\w.=-]+)*? pid=\d+)\)(?:{_SGR})*\s?")
# torch.distributed's per-rank prefix (`[rank0]: `), and vLLM's logger header (`%(levelname)s %m-%d %H:%M:%S
# [file:line] `, on every line of a multi-line record): the stream a line belongs to, not its text.
RANK = re.compile(r"^\[rank\d+\]:\s?")
LOGGER = re.compile(r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? "
                    r"\[(?P<src>[^\]\s]+:\d+)\] ?")
CAUSE = "The above exception was the direct cause of the following exception:"
CONTEXT = "During handling of the above exception, another exception occurred:"
MARKERS = (CAUSE, CONTEXT)
# The frame functions from which on frames run inside torch's dispatcher (see the module's docstring).
DISPATCH_HOOKS = ("__torch_dispatch__",)
FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)')
START = re.compile(r"^\s*Traceback \(most recent call last\):")
EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Fault|OutOfMemory)\b")
CARETS = re.compile(r"^\s*[\^~\s]+$")
OOM = re.compile(r"out of memory|OutOfMemory", re.IGNORECASE)
SITE_DIRS = ("site-packages", "dist-packages")
STDLIB = re.compile(r"/lib/python\d+(\.\d+)?/")


def split_prefix(line: str) -> tuple[str, str]:
    """(the stream a line belongs to, its text): the process prefix, the rank prefix and vLLM's logger header
    read off (the header's level and source name the stream; its time does not)."""
    who = rank = src = ""
    if m := PREFIX.match(line):
        who, line = m.group("who"), line[m.end():]
    if m := RANK.match(line):
        rank, line = m.group().strip(), line[m.end():]
    if m := LOGGER.match(line):
        src, line = f"{m['level']} {m['src']}", line[m.end():]
    return "|".join((who, rank, src)) if rank or src else who, line


def strip_prefix(line: str) -> str:
    return split_prefix(line)[1]


Frames = list[tuple[str, int, str, str | None]]  # outermost first: (path, line, function, code)


class _Block:
    def __init__(self, chain: int | None = None) -> None:
        self.frames: Frames = []
        self.exception: str | None = None
        self.expect_code = False
        self.chain = chain  # the chain it continues (a chain marker came before it), else None


def chains(text: str) -> list[list[tuple[Frames, str]]]:
    """Every exception chain in a log excerpt, in the order each ended: its tracebacks (frames, exception line)
    root cause first, linked per stream by Python's chain markers. A traceback longer than the window (its
    header left out) is read from its first whole frame."""
    open_: dict[str, _Block] = {}
    linking: dict[str, int] = {}  # stream → the chain a marker said the next traceback continues
    last: dict[str, int] = {}  # stream → the chain its last traceback ended
    found: list[list[tuple[Frames, str]]] = []
    order: list[int] = []  # chain indexes by the time their last link ended
    for raw in text.splitlines():
        who, line = split_prefix(raw.rstrip("\r"))
        if line.strip() in MARKERS:
            if who in last:
                linking[who] = last[who]
            continue
        if START.match(line):
            open_[who] = _Block(linking.pop(who, None))
            continue
        block = open_.get(who)
        if block is None:
            if not FRAME.match(line):
                continue
            # A frame with no header before it: a traceback longer than the log window, its header left
            # out; its tail holds the innermost frames and the exception, what the site is read from.
            block = open_[who] = _Block(linking.pop(who, None))
        if m := FRAME.match(line):
            block.frames.append((m["path"], int(m["line"]), m["function"], None))
            block.expect_code = True
        elif block.expect_code and line.startswith("    ") and not CARETS.match(line):
            path, number, function, _ = block.frames[-1]
            block.frames[-1] = (path, number, function, line.strip()[:200])
            block.expect_code = False
        elif CARETS.match(line) and line.strip():
            continue
        elif EXCEPTION.match(line.strip()) and not line.startswith(" "):
            link = (block.frames, line.strip()[:400])
            if block.chain is None:
                found.append([link])
                at = len(found) - 1
            else:
                at = block.chain
                found[at].append(link)
                order.remove(at)
            order.append(at)
            last[who] = at
            del open_[who]
        else:
            block.expect_code = False  # a line of another kind (an interleaved log line of this process)
    return [found[i] for i in order]


def tracebacks(text: str) -> list[tuple[Frames, str]]:
    """Every complete traceback in a log excerpt: (frames outermost first as (path, line, function, code),
    the exception line), followed per stream; a chain's links in their printed order."""
    return [link for chain in chains(text) for link in chain]


def _parts(path: str) -> list[str]:
    return [p for p in path.replace("\\", "/").split("/") if p]


def package_path(path: str, own: tuple[str, ...] = SERVER_PACKAGES) -> tuple[str, str | None]:
    """(package-relative path, its top package or None): from inside site-packages, else from a known
    package's folder, else the path whole."""
    parts = _parts(path)
    for d in SITE_DIRS:  # installed: the package is the folder inside site-packages
        if d in parts:
            rest = parts[len(parts) - parts[::-1].index(d):]
            return "/".join(rest), rest[0] if len(rest) > 1 else None
    known = (*own, *FRAMEWORKS)
    for i in range(len(parts) - 2, -1, -1):  # a clone: the innermost known package folder (…/vllm_omni/…)
        if parts[i] in known:
            return "/".join(parts[i:]), parts[i]
    return path, None


def is_own(path: str, own: tuple[str, ...] = SERVER_PACKAGES) -> bool:
    if path.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return False
    rel, package = package_path(path, own)
    if rel in ALLOCATOR_STANDINS:
        return False
    if package in own:
        return True
    if package in FRAMEWORKS:
        return False
    parts = _parts(path)
    if any(d in parts for d in SITE_DIRS):
        return False
    return not STDLIB.search(path.replace("\\", "/"))


def site_of(frames: Frames, own: tuple[str, ...] = SERVER_PACKAGES
            ) -> tuple[str | None, str | None, tuple[Frame, ...], str | None]:
    """(site, function, evidence frames innermost first, why no site) for a traceback's frames."""
    from runner.core.records import Frame

    hook = next((i for i, (_, _, f, _) in enumerate(frames) if f in DISPATCH_HOOKS), len(frames))
    made = [Frame(path=package_path(p, own)[0], line=n, function=f, code=c, own=i < hook and is_own(p, own))
            for i, (p, n, f, c) in enumerate(frames)]
    inner_first = made[::-1]
    at = next((i for i, fr in enumerate(inner_first) if fr.own), None)
    if at is None:
        return None, None, tuple(inner_first[:CALLERS_KEPT + 1]), "no server frame"
    site = inner_first[at]
    callers = [fr for fr in inner_first[at + 1:] if fr.own][:CALLERS_KEPT]
    return f"{site.path}:{site.line}", site.function, (site, *callers), None


def _typed_oom(exception: str) -> bool:
    """An exception line whose type is PyTorch's OOM (`torch.OutOfMemoryError: …`), not one that carries an
    OOM's text in its message (`RuntimeError: Orchestrator initialization failed: CUDA out of memory …`)."""
    return "OutOfMemory" in exception.split(":", 1)[0]


def oom_traceback(text: str) -> tuple[Frames, str] | None:
    """The traceback of the last out-of-memory error in a log excerpt: of the last chain holding an exception
    of PyTorch's OOM type, its first such link (a wrapper that repeats the OOM's text in its message — vLLM-Omni's
    `RuntimeError(output.error)` after the worker caught it — raised elsewhere); with no typed OOM (torch < 1.13
    raised `RuntimeError: CUDA out of memory`), the first OOM link of the last chain that has one."""
    found = chains(text)
    for test in (_typed_oom, lambda e: bool(OOM.search(e))):
        link = next((link for chain in reversed(found) for link in chain if test(link[1])), None)
        if link is not None:
            return link
    return None


def last_chain(text: str) -> list[tuple[Frames, str]]:
    """The exception chain a log excerpt ended with (root cause first); empty when it has none."""
    found = chains(text)
    return found[-1] if found else []
