"""wait_ready's order of questions, with a stand-in server whose answers change between two of them: the race
a clean-clone run met (a container OOM-killed at load between the exit check and the port check)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.backends.base import Attempt, ExitInfo, RunningServer, StartFailed
from runner.core.records import FailureClass
from runner.plan.lanes import ServerPlan
from runner.plan.matrix import ServerProfile


class DiesBetweenChecks(RunningServer):
    """Running when first asked; exited (OOM-killed) by the time its port is looked at, which took the port."""

    def __init__(self, tmp: Path, oom_killed: bool | None) -> None:
        plan = ServerPlan(backend="local", profile=ServerProfile(name="t", command=("x",), port=1), argv=("x",),
                          env={})
        super().__init__(plan, Attempt(name="t", log_path=tmp / "server.log"))
        (tmp / "server.log").write_text("loading\n")
        self.port, self.dies, self.asked, self.stopped = 1, oom_killed, 0, False

    def start(self) -> None: ...

    def exited(self) -> ExitInfo | None:
        self.asked += 1
        if self.asked == 1 or self.dies is None:
            return None
        return ExitInfo(code=137, oom_killed=self.dies)

    def foreign_answer(self) -> str | None:
        return "port 1 is no longer published by container t (now None); not measuring whatever answers there"

    def stop(self) -> None:
        self.stopped = True


@pytest.mark.parametrize(("dies", "kind"), [(True, FailureClass.OOM_AT_LOAD), (None, FailureClass.LOAD_EXIT)])
def test_a_port_gone_with_its_exited_server_is_classified_by_the_exit(tmp_path: Path, dies: bool | None,
                                                                      kind: FailureClass) -> None:
    server = DiesBetweenChecks(tmp_path, dies)
    with pytest.raises(StartFailed) as failed:
        server.wait_ready(5, poll_s=0.01)
    assert failed.value.failure.kind == kind and server.stopped
    if dies:
        assert "host memory" in failed.value.failure.message  # the kill, not the vanished port
    else:  # still running, yet its port is not its own: nothing is probed there
        assert "no longer published" in failed.value.failure.message
