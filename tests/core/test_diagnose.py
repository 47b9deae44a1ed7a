"""What the diagnosis pass sends (runner.run.diagnose.targets, pure), the matrix key, the dialects' and
backends' parts of the interface, and a refused snapshot in the findings (one line, nothing run)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from runner.backends.base import same_path
from runner.core.records import (
    DiagnosisRecord,
    Failure,
    FailureClass,
    OomReport,
    ServerStart,
    SessionRecord,
    Status,
    StepRecord,
)
from runner.plan.lanes import Session
from runner.run import dialects
from runner.run.diagnose import readings, targets
from runner.run.store import RunStore


def step(refs: int, status: Status, oom: bool = False, seed: int = 1) -> StepRecord:
    failure = Failure(kind=FailureClass.OOM, message="out of memory", evidence=(),
                      oom=OomReport(message="CUDA out of memory. Tried to allocate 2.00 MiB.", source="body",
                                    tried_bytes=2 * 2**20)) if oom else None
    return StepRecord(key=f"c/f/refs-{refs}/x-seed-{seed}", card="c", flags="f", role="default", fixture="x",
                      references=refs, seed=seed, status=status, failure=failure)


SESSION = Session("c", "f", ())


def test_the_deciding_request_oom_and_with_always_the_highest_and_lowest_served_counts() -> None:
    steps = [step(1, Status.OK), step(2, Status.OK), step(3, Status.FAILED, oom=True)]
    assert [(t.at, t.of, t.step.references if t.step else None) for t in targets("oom", SESSION, steps, None, 4)] \
        == [("oom", "c/f/refs-3/x-seed-1", 3)]
    assert [(t.at, t.step.references if t.step else None) for t in targets("always", SESSION, steps, None, 4)] \
        == [("oom", 3), ("peak", 2), ("peak", 1)]
    one = [step(2, Status.OK), step(2, Status.OK, seed=2)]  # one served count: one peak
    assert [(t.at, t.of) for t in targets("always", SESSION, one, None, 4)] == [("peak", "c/f/refs-2/x-seed-1")]
    assert targets("off", SESSION, steps, None, 4) == []
    assert targets("oom", SESSION, steps[:2], None, 4) == []  # nothing ran out: nothing to diagnose


def test_a_load_oom_is_diagnosed_by_a_start_a_host_oom_is_not() -> None:
    load = Failure(kind=FailureClass.OOM_AT_LOAD, message="out of memory at load", evidence=(),
                   oom=OomReport(message="CUDA out of memory. Tried to allocate 2.00 MiB.", source="server log"))
    record = SessionRecord(key="c/f", card="c", flags="f", role="default", backend="local",
                           starts=(ServerStart(attempt=0, started_at=1.0, ready_s=None, failure=load),))
    (t,) = targets("oom", SESSION, [], record, 4)
    assert (t.at, t.of, t.step) == ("oom", "c/f", None)
    host = step(2, Status.FAILED, oom=True)
    assert host.failure is not None and host.failure.oom is not None
    host = host.model_copy(update={"failure": host.failure.model_copy(update={
        "oom": host.failure.oom.model_copy(update={"memory": "host"})})})
    assert targets("oom", SESSION, [host], None, 4) == []


def test_the_vllm_omni_spelling_and_a_dialect_without_one() -> None:
    p = dialects.profiler("vllm-omni-chat", "/d")
    assert p is not None and p.args[0] == "--profiler-config"
    assert '"torch_profiler_dir": "/d"' in p.args[1] and '"torch_profiler_with_memory": true' in p.args[1]
    assert (p.start_path, p.stop_path) == ("/start_profile", "/stop_profile")
    assert dialects.profiler("openai-images", "/d") is None


def test_the_diagnosis_key_is_validated(matrix_dir: Path) -> None:
    from runner.core.errors import UserError
    from runner.plan.matrix import load_matrix

    path = matrix_dir / "matrix.toml"
    text = path.read_text()
    assert load_matrix(path).run.diagnosis == "oom"
    path.write_text(text.replace('[run]\n', '[run]\ndiagnosis = "sometimes"\n', 1))
    with pytest.raises(UserError, match="diagnosis"):
        load_matrix(path)


class _Runs:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.path}",))


def test_a_refused_snapshot_is_one_line_in_the_readings_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    folder = tmp_path / "c" / "f" / "diagnosis" / "oom"
    folder.mkdir(parents=True)
    (folder / "memory_snapshot_rank0.pickle").write_bytes(pickle.dumps({"segments": [_Runs(marker)]}))
    store = RunStore(tmp_path)
    store.write_diagnosis(DiagnosisRecord(key="c/f", card="c", flags="f", at="oom", of="c/f/refs-3/x-seed-1",
                                          references=3, started_at=1.0, total_s=1.0, outcome="oom",
                                          snapshot="c/f/diagnosis/oom/memory_snapshot_rank0.pickle"))
    (r,) = readings(store)[("c", "f")]
    assert r.held is None and r.why is not None
    assert r.why.startswith("allocator snapshot c/f/diagnosis/oom/memory_snapshot_rank0.pickle not read: refused: "
                            "the pickle names a global") and "\n" not in r.why
    assert not marker.exists()


def test_a_local_server_sees_the_folder_where_the_runner_does(tmp_path: Path) -> None:
    plan = object()
    assert same_path(plan, tmp_path) == (plan, str(tmp_path))  # type: ignore[arg-type]
