"""`repeats = "auto"` plans no send that cannot change a verdict (issue 31, item 4): a flag set whose role decides
no card's world (neither `default` nor an offload role: fp8, int8 on the seed's matrix) sends every seed at the
target count and only the first seed at the other counts; every default and offload session, whose cells a
latency ratio compares and whose spread it pools, keeps every seed. The steps left out decide nothing: the
verdict from every step of a full plan equals the verdict from the steps auto plans."""

from __future__ import annotations

import random
from pathlib import Path

from runner.core.records import (
    Failure,
    FailureClass,
    Peak,
    Sanity,
    Scores,
    ServerStart,
    SessionRecord,
    Status,
    StepRecord,
)
from runner.judge.verdict import decide_all
from runner.plan.lanes import Step, describe, first_seed_off_target, make_plan
from runner.plan.matrix import Matrix, load_matrix

ROOT = Path(__file__).resolve().parents[2]
SEED = ROOT / "examples" / "seed-emulated.toml"  # matrix.toml's flag sets, axes, seeds and rules
SEEDS = (2301, 2302, 2303, 2304)


def seed_matrix(tmp_path: Path, *edits: tuple[str, str]) -> Matrix:
    text = SEED.read_text()
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new, 1)
    path = tmp_path / f"seed-{len(list(tmp_path.glob('*.toml')))}.toml"
    path.write_text(text)
    return load_matrix(path, check_files=False)


def sent(m: Matrix) -> dict[str, set[tuple[int, int]]]:
    return {s.key: {(st.references, st.seed) for st in s.steps} for s in make_plan(m).sessions}


EVERY = {(n, s) for n in (1, 2, 3, 4) for s in SEEDS}


def test_auto_sends_one_seed_off_the_target_only_for_flag_sets_that_decide_no_world(tmp_path: Path) -> None:
    m = seed_matrix(tmp_path)
    assert m.run.auto_repeats and m.verdict.target_references == 4
    plan = sent(m)
    for key, steps in plan.items():
        role = m.flags[key.split("/")[1]].role
        if role in ("quantization",):  # fp8, int8: every seed at 4, seed 2301 at 1-3
            assert steps == {(n, 2301) for n in (1, 2, 3)} | {(4, s) for s in SEEDS}, key
        else:  # default and offload: a latency ratio may compare any of their counts
            assert steps == EVERY, key
    assert sum(map(len, plan.values())) == 8 * 16 + 4 * 7
    text = describe(make_plan(m), m)
    assert "7 step(s) × 1 timed send" in text and "(role 'quantization' decides no world: every seed at 4" in text


def test_every_seed_is_planned_where_the_rule_does_not_hold(tmp_path: Path) -> None:
    cases = {
        "repeats = 2": ('true_cfg_scale = 4.0', 'true_cfg_scale = 4.0\nrepeats = 2'),
        "repeats = 1": ('true_cfg_scale = 4.0', 'true_cfg_scale = 4.0\nrepeats = 1'),
        "memory may depend on the seed": ('stop_after_oom = true', 'stop_after_oom = true\noom_implies_seeds = false'),
        "quantization decides offload-works": ('offload_roles = ["offload"]',
                                               'offload_roles = ["offload", "quantization"]'),
    }
    for why, edit in cases.items():
        m = seed_matrix(tmp_path, edit)
        assert all(steps == EVERY for steps in sent(m).values()), why
    # the baseline cell's images are what every other image is scored against, seed by seed
    m = seed_matrix(tmp_path, ('cell = "rtx3090/layerwise"', 'cell = "rtx3090/fp8"'))
    plan = sent(m)
    assert plan["rtx3090/fp8"] == EVERY and len(plan["rtx5080/fp8"]) == 7 and len(plan["rtx3090/int8"]) == 7
    m = seed_matrix(tmp_path, ('cell = "rtx3090/layerwise"', 'cell = "fp8"'))  # each card's own fp8
    assert not any(first_seed_off_target(m, c, "fp8") for c in ("rtx3090", "rtx5080"))


# --- the steps auto leaves out decide nothing --------------------------------------------------------------
GOOD = Sanity(width=128, height=128, mode="RGB", transparent_share=0.0, pixel_std=40.0, nan_or_black=False,
              broken=False)
BROKEN = Sanity(width=128, height=128, mode="RGBA", transparent_share=0.97, pixel_std=0.5, nan_or_black=False,
                broken=True, reasons=("97% of pixels fully transparent",))
# (card, flags) -> (the first count that runs out of memory, None: serves all; wall s; output broken)
SHAPE = {("rtx3090", "default"): (4, 0.80, False), ("rtx3090", "cpu-offload"): (4, 1.6, False),
         ("rtx3090", "cpu-offload-expandable"): (4, 1.6, False), ("rtx3090", "layerwise"): (None, 1.05, False),
         ("rtx3090", "fp8"): (None, 1.2, True), ("rtx3090", "int8"): (None, 0.9, False),
         ("rtx5080", "cpu-offload"): (1, 1.6, False), ("rtx5080", "cpu-offload-expandable"): (1, 1.6, False),
         ("rtx5080", "layerwise"): (4, 1.1, False), ("rtx5080", "fp8"): (4, 1.2, True),
         ("rtx5080", "int8"): (4, 0.9, False)}  # rtx5080/default: out of memory at load


def records(m: Matrix, steps: list[Step], rng: random.Random) -> list[StepRecord]:
    """What a run of these steps records on the seed's shape: every seed's own wall time (±20 %, and a seed
    effect shared by the sessions), OOMs implying the larger counts and the other seeds at their count."""
    seed_effect = {s: rng.uniform(0.9, 1.1) for s in SEEDS}
    out: list[StepRecord] = []
    oom_key: dict[tuple[str, str], str] = {}
    for st in steps:
        if (st.card, st.flags) not in SHAPE:
            continue
        oom_at, wall, broken = SHAPE[(st.card, st.flags)]
        base = dict(key=st.key, card=st.card, flags=st.flags, role=m.flags[st.flags].role, fixture=st.fixture,
                    references=st.references, seed=st.seed)
        if (st.card, st.flags) in oom_key:
            out.append(StepRecord(**base, status=Status.SKIPPED, skip_reason="implied by an out-of-memory",
                                  implied_by=oom_key[(st.card, st.flags)]))
        elif oom_at is not None and st.references >= oom_at:
            oom_key[(st.card, st.flags)] = st.key
            out.append(StepRecord(**base, status=Status.FAILED, wall_s=0.3, failure=Failure(
                kind=FailureClass.OOM, message="CUDA out of memory. Tried to allocate 257.00 KiB", evidence=())))
        else:
            w = wall * st.references ** 0.1 * seed_effect[st.seed] * rng.uniform(0.8, 1.2)
            out.append(StepRecord(**base, status=Status.OK, wall_s=w, wall_samples_s=(w,),
                                  image_sha256=f"{st.key}", scores=Scores(
                                      baseline="rtx3090/layerwise", psnr_db=8.0 if broken else 28.0, ssim=0.9,
                                      size_match=True, reason=None, sanity=BROKEN if broken else GOOD),
                                  peaks=(Peak(source="server-response", metric="device", bytes=(3 + st.references)
                                              * 2**20, samples=1, rate_hz=None, available=True),)))
    return out


def sessions(m: Matrix) -> list[SessionRecord]:
    out = []
    for card, flags in [*SHAPE, ("rtx5080", "default")]:
        failure = Failure(kind=FailureClass.OOM_AT_LOAD, message="out of memory at load", evidence=()) \
            if (card, flags) == ("rtx5080", "default") else None
        start = ServerStart(attempt=0, started_at=0.0, ready_s=None if failure else 1.0, failure=failure)
        out.append(SessionRecord(key=f"{card}/{flags}", card=card, flags=flags,
                                 role=m.flags[flags].role, backend="local", starts=(start,)))
    return out


def test_the_verdict_from_every_seed_is_the_verdict_from_what_auto_plans(tmp_path: Path) -> None:
    m = seed_matrix(tmp_path)
    full = seed_matrix(tmp_path, ('stop_after_oom = true', 'stop_after_oom = true\noom_implies_seeds = false'))
    every, planned = make_plan(full).steps, {st.key for st in make_plan(m).steps}
    assert len(every) == 192 and len(planned) == 156 and planned < {st.key for st in every}
    ss = sessions(m)
    for trial in range(20):
        recs = records(m, list(every), random.Random(trial))
        kept = [r for r in recs if r.key in planned]
        assert len(kept) < len(recs)
        a = decide_all(recs, ss, m.verdict, ["rtx3090", "rtx5080"])
        b = decide_all(kept, ss, m.verdict, ["rtx3090", "rtx5080"])
        for x, y in zip(a, b, strict=True):
            assert (x.world, x.flags, x.latency, x.reason) == (y.world, y.flags, y.latency, y.reason), trial
        assert [v.world.value for v in a] == ["offload-works", "not-built"]
