"""Fault plan: injected failures for tests and demos, parsed from repeatable `--fault KIND[@N]`.

N is the 1-based number of the generation request (chat or images, counted on arrival) the fault applies
to; without @N it applies to every request. Two faults act at load instead: `load-fail` and
`slow-load=SECONDS` (also spelled `slow-load@SECONDS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

REQUEST_FAULTS = ("exit", "hang", "malformed-json", "no-image", "wrong-size", "transparent", "grey")
LOAD_FAULTS = ("load-fail", "slow-load")
# Faults that make no sense "on every request" must name their request.
NEEDS_N = ("exit", "hang")


@dataclass(frozen=True)
class Fault:
    kind: str
    request: int | None = None  # None = every request


@dataclass(frozen=True)
class FaultPlan:
    faults: tuple[Fault, ...] = ()
    load_fail: bool = False
    slow_load_s: float = 0.0
    specs: tuple[str, ...] = field(default=(), compare=False)

    @classmethod
    def parse(cls, specs: list[str] | None) -> FaultPlan:
        faults: list[Fault] = []
        load_fail = False
        slow_load = 0.0
        for spec in specs or []:
            kind, sep, arg = spec.strip().replace("=", "@", 1).partition("@")
            if kind == "load-fail":
                load_fail = True
            elif kind == "slow-load":
                try:
                    slow_load = float(arg)
                except ValueError:
                    raise ValueError(f"--fault {spec}: slow-load needs seconds, e.g. slow-load=5") from None
            elif kind in REQUEST_FAULTS:
                n: int | None = None
                if sep:
                    if not arg.isdigit() or int(arg) < 1:
                        raise ValueError(f"--fault {spec}: N must be a 1-based request number")
                    n = int(arg)
                elif kind in NEEDS_N:
                    raise ValueError(f"--fault {spec}: {kind} needs a request number, e.g. {kind}@2")
                faults.append(Fault(kind, n))
            else:
                known = ", ".join(LOAD_FAULTS + REQUEST_FAULTS)
                raise ValueError(f"--fault {spec}: unknown kind {kind!r} (known: {known})")
        return cls(tuple(faults), load_fail, slow_load, tuple(specs or ()))

    def for_request(self, n: int) -> frozenset[str]:
        """Kinds that apply to request number n."""
        return frozenset(f.kind for f in self.faults if f.request is None or f.request == n)
