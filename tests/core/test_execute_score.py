"""Scoring runs off the request path: an image that does not decode becomes a bad_response record there."""

from __future__ import annotations

import io
from pathlib import Path

from PIL import Image

from runner.core.records import FailureClass, Status, StepRecord
from runner.plan.lanes import Step, make_plan
from runner.plan.matrix import load_matrix
from runner.run.events import Events
from runner.run.execute import Baselines, References, RunContext, Served, SessionRunner
from runner.run.interrupts import Abandoned
from runner.run.store import RunStore


def runner(matrix_dir: Path, events: Events | None = None) -> tuple[SessionRunner, StepRecord]:
    matrix = load_matrix(matrix_dir / "matrix.toml")
    plan = make_plan(matrix)
    store = RunStore(matrix_dir / "run")
    ctx = RunContext(matrix, plan, store, "t", events or Events())
    session = plan.sessions[0]
    step = session.steps[0]
    record = StepRecord(key=step.key, card=step.card, flags=step.flags, role="default", fixture=step.fixture,
                        references=step.references, seed=step.seed, status=Status.OK, image="x.png",
                        image_sha256="ab", deterministic=True)
    return SessionRunner(ctx, session, References(), Baselines(matrix, store)), record


def test_undecodable_image_is_a_bad_response_without_a_png(matrix_dir: Path) -> None:
    r, record = runner(matrix_dir)
    scored, png = r.score(Served(record, b"\x89PNG not really", None))
    assert png is None and scored.status == Status.FAILED and scored.image is None
    assert scored.failure is not None and scored.failure.kind == FailureClass.BAD_RESPONSE
    assert "does not decode" in scored.failure.message and scored.deterministic is None


def test_served_image_is_scored_and_a_differing_repeat_measured(matrix_dir: Path) -> None:
    r, record = runner(matrix_dir)

    def png(value: int) -> bytes:
        out = io.BytesIO()
        Image.new("RGB", (16, 16), (value, 90, 30)).save(out, "PNG")
        return out.getvalue()

    scored, kept = r.score(Served(record, png(200), png(190)))
    assert kept == png(200) and scored.status == Status.OK and scored.scores is not None
    assert scored.scores.sanity.width == 16 and 20 < scored.repeat_psnr_db < 40


def test_the_step_in_flight_is_announced_before_its_request_goes_out(matrix_dir: Path) -> None:
    """The progress bar names the request in flight (a real one takes minutes), so the event comes first."""
    seen: list[tuple[str, int]] = []

    class Listener(Events):
        def sending(self, step: Step, sends: int) -> None:
            seen.append((step.key, sends))

    class InterruptedSender:  # the request never completes: Ctrl-C while it is in flight
        def repeats(self, *args: object, **kwargs: object) -> None:
            assert seen, "the request went out before the step was announced"
            raise Abandoned

    r, _ = runner(matrix_dir, Listener())
    step = r.session.steps[0]
    record = r.execute(InterruptedSender(), [], step, 0, determinism_resend=True)  # type: ignore[arg-type]
    assert seen == [(step.key, 2)]  # one timed send and the determinism re-send
    assert record.status == Status.SKIPPED and record.skip_reason == "run interrupted"
