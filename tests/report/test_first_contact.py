"""The runner's words at first contact with the real vLLM-Omni 0.30.0 server (issue 44; the session's shared
data, runner-report-first-contact.md): eight steps served with images, `peak_memory_mb: 0.0` in every answer, a
card whose meters are the server's /metrics (no device gauge there) and host RAM. Nothing measured the device, so
no sentence may say a peak was measured, compared or missing for lack of images, and no world may rest on it.
The records are built the way the runner builds them (the response's peak through the dialect and
step_records, the meter's reason as the server meter writes it)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from runner.core.records import Peak, Scores, ServerStart, SessionRecord, Status, StepRecord
from runner.core.vocab import Role
from runner.judge.decision import Evidence, Verdict, World
from runner.judge.verdict import decide_all, identical_pairs
from runner.judge.verdict_text import console_line, summary
from runner.meters.server import DEVICE_GAUGES, PEAK_GAUGES
from runner.plan.matrix import VerdictRules
from runner.present.report import write_report
from runner.run.dialects import peak_unread, server_peak
from runner.run.step_records import with_response_peak
from runner.run.store import RunStore

from .test_plots import GOOD

GIB = 2**30
RULES = VerdictRules(target_references=2)
# vLLM-Omni 0.30's chat answer on a platform whose memory hooks return 0 (the shared data's README)
CHAT = {"choices": [{"message": {"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"},
                                               "stage_durations": {"stage_0_gen_ms": 1400.0},
                                               "peak_memory_mb": 0.0}]}}], "metrics": None}
PORTS = {"default": 46021, "offload": 33895}
WALLS = {1: 1.47, 2: 2.66}


def gauge_reason(flags: str) -> str:
    url = f"http://127.0.0.1:{PORTS[flags]}/metrics"
    return (f"no samples in window ({url} exports no device-memory gauge ({', '.join(DEVICE_GAUGES + PEAK_GAUGES)}"
            "; vLLM-Omni 0.30 exports vllm_omni:peak_memory_mb only with --log-stats))")


def step(flags: str, n: int, seed: int) -> StepRecord:
    assert server_peak(CHAT) is None
    meters = [Peak(source="server", metric="device", bytes=None, samples=0, rate_hz=None, available=False,
                   reason=gauge_reason(flags)),
              Peak(source="host", metric="host", bytes=int(1.6 * GIB), samples=40, rate_hz=10.0, available=True)]
    return StepRecord(key=f"cpu/{flags}/refs-{n}/f-seed-{seed}", card="cpu", flags=flags, role=Role(flags),
                      fixture="f", references=n, seed=seed, status=Status.OK, started_at=100.0 + 10 * n + seed,
                      wall_s=WALLS[n], wall_samples_s=(WALLS[n],), image=f"f-seed-{seed}.png",
                      image_sha256=hashlib.sha256(f"{n}-{seed}".encode()).hexdigest(),  # the flags change nothing
                      peaks=with_response_peak(meters, None, peak_unread(CHAT)), deterministic=True,
                      scores=Scores(baseline=None, psnr_db=None, ssim=None, size_match=None,
                                    reason="no baseline image", sanity=GOOD))


def session(flags: str) -> SessionRecord:
    load = (Peak(source="server", metric="device", bytes=None, samples=0, rate_hz=None, available=False,
                 reason="no samples in window (server has no reading before its port opens)"),)
    return SessionRecord(key=f"cpu/{flags}", card="cpu", flags=flags, role=Role(flags), backend="local",
                         starts=(ServerStart(attempt=0, started_at=90.0, ready_s=15.89, failure=None,
                                             stopped_at=150.0, load_peaks=load),))


def first_contact(root: Path) -> tuple[RunStore, list[Verdict], str]:
    store = RunStore(root)
    for flags in ("default", "offload"):
        store.write_session(session(flags))
        for n in (1, 2):
            for seed in (1, 2):
                store.write_step(step(flags, n, seed))
    store.write_run({"run_id": "real-omni", "matrix": {"path": "<run>/real.toml", "sha256": "0" * 64, "text": ""},
                     "runner": {"version": "0.1.0"}, "cards": {"cpu": {"vram_gib": 24}},
                     "plan": {"sessions": ["cpu/default", "cpu/offload"]}})
    verdicts = decide_all(store.load_steps(), store.load_sessions(), RULES, ["cpu"])
    return store, verdicts, write_report(store, verdicts).read_text()


def test_findings_say_what_is_missing_a_device_figure_not_images(tmp_path: Path) -> None:
    _, (v,), text = first_contact(tmp_path / "run")
    assert "no request came back with an image" not in text
    for flags in ("default", "offload"):
        memory = v.findings.flag_sets[flags].memory if v.findings else None
        assert memory is not None and memory.answered == (1, 2) and memory.peaks == ()
        line = next(ln for ln in text.splitlines() if ln.startswith(f"- **{flags}**"))
        assert ("requests came back with images at 1 ref and 2 refs, but with no device-memory figure: the server "
                "reported 0.0 (not measured) at choices\\[0\\].message.content\\[0\\].peak\\_memory\\_mb") in line, line
        assert f"no meter read the device (server: no samples in window (http://127.0.0.1:{PORTS[flags]}" in line
        assert "none of the card's meters reads the whole device" in line


def test_identical_images_with_no_memory_figure_claim_no_memory_difference(tmp_path: Path) -> None:
    store, (v,), text = first_contact(tmp_path / "run")
    (pair,) = identical_pairs(store.load_steps())
    assert pair.memory == "unmeasured" and pair.compared == 0
    assert "different memory peaks" not in text and "changed memory" not in text
    note = next(ln for ln in text.splitlines() if "byte-identical" in ln)
    assert "'default' = 'offload'" in note and "no device-memory figure compares them" in note, note
    assert all("different memory peaks" not in n for n in v.notes)


def test_no_world_rests_on_a_served_target_that_nothing_measured(tmp_path: Path) -> None:
    _, (v,), text = first_contact(tmp_path / "run")
    assert v.world == World.UNDECIDED and v.flags is None
    line = console_line(v)
    assert line.startswith("cpu: undecided — cannot tell — default serves 2 refs, no device-memory figure "
                           "[cpu/default/refs-2/f-seed-1]; offload serves 2 refs, no device-memory figure"), line
    assert "| cpu | **undecided** | – | cannot tell — default serves 2 refs, no device-memory figure" in text
    blocking = v.to_json()["evidence"]["blocking"]
    assert [b["cause"] for b in blocking] == ["unmetered", "unmetered"]
    assert "the server reported 0.0 (not measured)" in blocking[0]["detail"]
    assert "serves 2 reference(s) with no device-memory figure: the server reported 0.0" in v.reason
    assert "- `default` [default]: **serves it, but nothing measured its memory** — serves 2 reference(s)" in text
    json.dumps(v.to_json(), allow_nan=False)


def test_no_sentence_asserts_a_figure_it_does_not_have(tmp_path: Path) -> None:
    _, _, text = first_contact(tmp_path / "run")
    for wrong in ("None", "peak ?", "✅ ?", "(None)", "peak seen ?"):
        assert wrong not in text, wrong
    row = next(ln for ln in text.splitlines() if ln.startswith("| default | default | ✅"))
    assert "✅ no device figure, 1.47 s" in row and "✅ no device figure, 2.66 s" in row, row


def test_a_deciding_flag_set_without_a_figure_is_named_first_and_said_so() -> None:
    """A verdict of an earlier runner (fits-resident on an unmetered cell) still reads true: the deciding flag
    set comes first and the line says it has no figure; the reason says so in words, never "peak ? (None)"."""
    v = Verdict(card="cpu", world=World.FITS_RESIDENT, target_references=2, flags="default",
                reason="", evidence=Evidence(wall_s=2.66), cells=(), notes=())
    assert summary(v) == "default serves 2 refs with no device-memory figure, 2.66 s/request at 2"
