"""Where a server runs: one runner.core.registry.BACKENDS entry per backend (`local`: a subprocess, `docker`: a
container on a local engine or ssh://). Kept light."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runner.backends.base import Attempt, RunningServer
    from runner.plan.lanes import ServerPlan


def create(plan: ServerPlan, attempt: Attempt) -> RunningServer:
    """The planned server's backend, for one start (its class is imported only now)."""
    from runner.core.registry import BACKENDS, load

    return load(BACKENDS.get(plan.backend).factory)(plan, attempt)  # type: ignore[no-any-return]
