"""Fault plan: injected failures for tests and demos, parsed from repeatable `--fault KIND[@N]`.

N is the 1-based number of the generation request (chat or images, counted on arrival) the fault applies
to; without @N it applies to every request. Two faults act at load instead: `load-fail` and
`slow-load=SECONDS` (also spelled `slow-load@SECONDS`). `jitter=MIN:MAX[:SEED]` adds to every request a
sleep drawn uniformly from [MIN, MAX] seconds by a generator seeded with SEED and the request number: a
latency distribution the runner's noise handling can be tested against, the same on every server start.
SEED `pid` seeds it with the server's process id instead: fresh draws at every start (a session restarted
for more sends of the same requests must not replay the draws of its first start).
`corrupt-ref=K` damages the K-th data-URI reference of every chat request on arrival (its bytes cut to a
quarter before decoding), as if it had been corrupted on its way: 0.30 drops it with its warning and serves.
`zero-peak[@N]` reports a peak of 0.0 (in the response's metrics and the /metrics gauge), as vLLM-Omni does
when its worker measured nothing.
`scraped[@N]` holds the response until /metrics has been scraped twice since the request arrived (at most
10 s): a poller's first reading then lies inside the request's window on its own clock (it is taken before its
second scrape is sent), so a test of what a window holds does not depend on the machine's load.
`host-memory=MIB@N` makes request N allocate (and touch, and keep) MIB MiB of host memory, and
`load-host-memory=MIB` the same at load: under a container's memory limit the kernel's OOM killer ends the
server, the host-memory OOM the runner must tell from a crash and from a CUDA OOM.
`leak=SIZE[@N]` makes every request (or request N) allocate SIZE (bytes, or with KiB/MiB/GiB/TiB) on the
device at its start and never free it: the server's current memory after each request grows by SIZE, and the
request that no longer fits fails as an out-of-memory.
Every number is checked at start against its domain (finite, in range): a value outside it is a usage error.
"""

from __future__ import annotations

import math
import os
import random
import re
from dataclasses import dataclass, field

REQUEST_FAULTS = ("exit", "hang", "malformed-json", "no-image", "wrong-size", "transparent", "grey", "zero-peak",
                  "scraped")
LOAD_FAULTS = ("load-fail", "slow-load", "jitter", "corrupt-ref", "load-host-memory")
SIZED_FAULTS = ("host-memory", "leak")  # KIND=SIZE@N: a size and the request it applies to
# Faults that make no sense "on every request" must name their request.
NEEDS_N = ("exit", "hang")


MAX_DELAY_S = 86400.0  # slow-load and jitter: a day; longer is no test of anything
MAX_HOST_MIB = 2**20  # host-memory, load-host-memory: 1 TiB
MAX_LEAK_BYTES = 2**50  # leak: 1 PiB, the bound of every memory figure
MAX_REFS = 16  # corrupt-ref: the network's reference slots
MAX_REQUEST = 10**12  # @N


@dataclass(frozen=True)
class Fault:
    kind: str
    request: int | None = None  # None = every request
    mib: int = 0  # host-memory: how much the request allocates
    nbytes: int = 0  # leak: what the request leaves on the device


@dataclass(frozen=True)
class FaultPlan:
    faults: tuple[Fault, ...] = ()
    load_fail: bool = False
    slow_load_s: float = 0.0
    jitter: tuple[float, float, int] | None = None  # (min s, max s, seed)
    corrupt_ref: int | None = None  # 1-based reference damaged on arrival in every chat request
    load_host_mib: int = 0  # host memory allocated and held at load (load-host-memory)
    specs: tuple[str, ...] = field(default=(), compare=False)

    @classmethod
    def parse(cls, specs: list[str] | None) -> FaultPlan:
        faults: list[Fault] = []
        load_fail = False
        slow_load = 0.0
        jitter = None
        corrupt_ref = None
        load_host_mib = 0
        for spec in specs or []:
            quoted = spec if len(spec) <= 60 else spec[:57] + "..."  # what the one-line error shows of it
            kind, sep, arg = spec.strip().replace("=", "@", 1).partition("@")
            if kind == "load-fail":
                load_fail = True
            elif kind == "slow-load":
                try:
                    slow_load = float(arg)
                except ValueError:
                    slow_load = math.nan
                if not (math.isfinite(slow_load) and 0 <= slow_load <= MAX_DELAY_S):
                    raise ValueError(f"--fault {quoted}: slow-load needs seconds from 0 to {MAX_DELAY_S:g}, "
                                     "e.g. slow-load=5")
            elif kind == "jitter":
                jitter = _jitter(quoted, arg)
            elif kind == "corrupt-ref":
                if _count(arg, MAX_REFS) is None:
                    raise ValueError(f"--fault {quoted}: corrupt-ref needs a 1-based reference number up to "
                                     f"{MAX_REFS}, e.g. corrupt-ref=3")
                corrupt_ref = int(arg)
            elif kind == "load-host-memory":
                if _count(arg, MAX_HOST_MIB) is None:
                    raise ValueError(f"--fault {quoted}: load-host-memory needs MiB from 1 to {MAX_HOST_MIB}, "
                                     "e.g. load-host-memory=512")
                load_host_mib = int(arg)
            elif kind == "host-memory":
                mib, _, n_text = arg.partition("@")
                if _count(mib, MAX_HOST_MIB) is None or _count(n_text, MAX_REQUEST) is None:
                    raise ValueError(f"--fault {quoted}: {kind} needs MiB (1 to {MAX_HOST_MIB}) and a request number, "
                                     f"e.g. {kind}=512@2")
                faults.append(Fault(kind, int(n_text), mib=int(mib)))
            elif kind == "leak":
                size, _, n_text = arg.partition("@")
                nbytes = parse_size(size)
                if nbytes is None or (n_text and _count(n_text, MAX_REQUEST) is None):
                    raise ValueError(f"--fault {quoted}: leak needs a size from 1 byte to 1 PiB (bytes, or with KiB, "
                                     "MiB, GiB, TiB) and optionally a request number, e.g. leak=64MiB or leak=1GiB@3")
                faults.append(Fault(kind, int(n_text) if n_text else None, nbytes=nbytes))
            elif kind in REQUEST_FAULTS:
                n: int | None = None
                if sep:
                    if _count(arg, MAX_REQUEST) is None:
                        raise ValueError(f"--fault {quoted}: N must be a 1-based request number")
                    n = int(arg)
                elif kind in NEEDS_N:
                    raise ValueError(f"--fault {quoted}: {kind} needs a request number, e.g. {kind}@2")
                faults.append(Fault(kind, n))
            else:
                known = ", ".join(LOAD_FAULTS + REQUEST_FAULTS + SIZED_FAULTS)
                raise ValueError(f"--fault {quoted}: unknown kind {kind[:40]!r} (known: {known})")
        return cls(tuple(faults), load_fail, slow_load, jitter, corrupt_ref, load_host_mib, tuple(specs or ()))

    def for_request(self, n: int) -> frozenset[str]:
        """Kinds that apply to request number n."""
        return frozenset(f.kind for f in self.faults if f.request is None or f.request == n)

    def leak_bytes(self, n: int) -> int:
        """Device bytes request number n leaves behind (0 without a leak fault)."""
        return sum(f.nbytes for f in self.faults if f.kind == "leak" and f.request in (None, n))

    def host_mib(self, n: int) -> int:
        """Host memory (MiB) request number n allocates (0 without a host-memory fault)."""
        return sum(f.mib for f in self.faults if f.kind == "host-memory" and f.request == n)

    def delay_s(self, n: int) -> float:
        """The jitter sleep of request number n (0 without jitter)."""
        if self.jitter is None:
            return 0.0
        low, high, seed = self.jitter
        return random.Random(seed * 1_000_003 + n).uniform(low, high)


def _jitter(quoted: str, arg: str) -> tuple[float, float, int]:
    parts = arg.split(":")
    try:
        low, high = float(parts[0]), float(parts[1])
        seed = os.getpid() if parts[2:3] == ["pid"] else int(parts[2]) if len(parts) > 2 else 0
    except (ValueError, IndexError):
        raise ValueError(f"--fault {quoted}: jitter needs MIN:MAX seconds (and optionally :SEED), "
                         f"e.g. jitter=0.5:1.5 or jitter=0.5:1.5:pid") from None
    if len(parts) > 3 or not (math.isfinite(low) and math.isfinite(high) and 0 <= low <= high <= MAX_DELAY_S):
        raise ValueError(f"--fault {quoted}: jitter needs 0 <= MIN <= MAX <= {MAX_DELAY_S:g} seconds, "
                         "e.g. jitter=0.5:1.5")
    return low, high, seed


def _count(text: str, most: int) -> int | None:
    """A whole number from 1 to `most` written in digits, else None (a 5000-digit one is never converted)."""
    if not text.isdigit() or len(text) > len(str(most)) or not 1 <= int(text) <= most:
        return None
    return int(text)


_SIZE = re.compile(r"^(\d{1,16}(?:\.\d{1,9})?)\s*(B|KiB|MiB|GiB|TiB)?$")
_UNITS = {None: 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_size(text: str) -> int | None:
    """"64MiB", "1.5GiB", "4096" (bytes) -> bytes; None unless it is from 1 byte to 1 PiB."""
    m = _SIZE.match(text.strip())
    if not m:
        return None
    nbytes = int(float(m.group(1)) * _UNITS[m.group(2)])
    return nbytes if 1 <= nbytes <= MAX_LEAK_BYTES else None


_HELD: list[bytearray] = []  # host memory a fault allocated: kept until the process ends


def hold_host_memory(mib: int) -> None:
    """Allocate mib MiB of host memory, every page written (resident, not merely reserved), and keep it."""
    _HELD.append(bytearray(mib * 2**20))  # zero-filled by CPython: each page is touched
