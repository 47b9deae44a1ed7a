"""report.md from a hand-built run directory, read as a GPU engineer would: no Python None, steps split by
outcome, every flag set's story for a not-built card, SSIM, one line per group of identical flag sets, load
peak never a bare dash, OOM evidence not cut mid-number, the glossary, the reference-server notice."""

from __future__ import annotations

import hashlib
from pathlib import Path

from runner.core.records import Failure, FailureClass, Peak, ServerStart, SessionRecord, Status
from runner.core.units import clip
from runner.core.vocab import Role
from runner.judge.decision import Evidence, Verdict, World
from runner.judge.verdict import decide_all
from runner.judge.verdict_text import summary
from runner.present.progress import verdict_line
from runner.present.report import write_report
from runner.run.store import RunStore

from .test_plots import BROKEN, RULES, card_steps, never_started, step

MATRIX = """[servers.refserver]
command = ["{python}", "-m", "runner.refserver", "--port", "{port}"]
"""
OOM_LINE = ("2026-11-30 02:46:15,799 ERROR refserver: request 6 id=chatcmpl-eaf5a02945b22a67eb3a9f07697d9035 "
            "generation failed: CUDA out of memory. Tried to allocate 193.00 KiB. GPU 0 has a total capacity of "
            "7.75 MiB of which 12.00 KiB is free. Including non-PyTorch memory, this process has 7.74 MiB in use.")


def build_run(root: Path) -> tuple[RunStore, str]:
    store = RunStore(root)
    steps = card_steps("c")
    # offload, int8 and a fourth "resident" flag set give byte-identical images: one group, one line
    steps += [step("c", "resident", n, mib=5 + n) for n in (1, 2)]
    steps = [s.model_copy(update={"image_sha256": hashlib.sha256(str(s.references).encode()).hexdigest()})
             if s.status == Status.OK and s.flags != "fp8" else s for s in steps]
    steps = [s.model_copy(update={"deterministic": False}) if s.flags == "int8" and s.references == 1 else s
             for s in steps]
    oom = Failure(kind=FailureClass.OOM, message="HTTP 500; out-of-memory text in the log", evidence=(OOM_LINE,))
    steps.append(step("c", "offload", 3, Status.FAILED).model_copy(update={"failure": oom}))
    for s in steps:
        store.write_step(s)
    store.write_session(never_started("c"))
    for flags in ("offload", "int8", "fp8", "resident"):
        start = ServerStart(attempt=0, started_at=99.0, ready_s=1.0, failure=None, stopped_at=110.0,
                            load_peaks=(Peak(source="server", metric="device", bytes=3 * 2**20, samples=1,
                                             rate_hz=None, available=True),))
        store.write_session(SessionRecord(key=f"c/{flags}", card="c", flags=flags,
                                          role="quantization" if flags in ("int8", "fp8")
                                          else "other" if flags == "resident" else "offload", backend="local",
                                          starts=(start,)))
    store.write_run({"run_id": "r1", "matrix": {"path": "/x/local.toml", "sha256": "0" * 64, "text": MATRIX},
                     "runner": {"version": "0.1.0"}, "cards": {"c": {"vram_gib": 6 / 1024}},
                     "plan": {"sessions": ["c/default", "c/offload", "c/int8", "c/fp8", "c/resident"]}})
    rules = RULES.model_copy(update={"target_references": 3})
    steps, sessions = store.load_steps(), store.load_sessions()
    # "resident" never ran at the target (3): as an offload role it would leave the card undecided
    roles = {"default": "default", "offload": "offload", "resident": "other", "int8": "quantization",
             "fp8": "quantization"}
    for s in steps:  # the hand-built steps carry role "x"; give them their flag set's role
        store.write_step(s.model_copy(update={"role": Role(roles[s.flags])}))
    verdicts = decide_all(store.load_steps(), sessions, rules, ["c"])
    return store, write_report(store, verdicts).read_text()


def test_report_reads_right(tmp_path: Path) -> None:
    store, text = build_run(tmp_path / "r1")
    assert "None" not in text
    assert "— 6 ok (image passes the sanity checks), 2 broken output" in text and "1 failed, 2 skipped" in text
    assert "Target: the reference server" in text
    assert "**not-built**" in text
    for flags in ("int8", "fp8", "default", "offload"):  # the quantization flag sets are part of the story
        assert f"- `{flags}` [" in text
    assert "SSIM 0.900" in text
    assert "| int8 | quantization | 1 | 1.00 |" in text and "| **no** |" in text  # no repeat PSNR: no "None"
    groups = [ln for ln in text.splitlines() if "byte-identical" in ln]
    assert len(groups) == 1 and "'int8' = 'offload' = 'resident'" in groups[0], groups
    row = [ln for ln in text.splitlines() if ln.startswith("| default | default |")][-1]  # the session row
    assert "never (oom_at_load)" in row and "OOM at load — model load failed: CUDA out of memory" in row
    columns = [c.strip() for c in row.strip("|").split("|")]
    assert columns[4].startswith("n/a: server has no reading")  # load peak: why there is none, never a silent dash
    assert "total capacity of 7.75 MiB" in text and "capacity of 7.75 `" not in text
    for source in ("nvml", "server", "server-response", "host", "sidecar", "dcgm", "prometheus"):
        assert f"| `{source}` |" in text
    assert "| `server-response` |" in next(ln for ln in text.splitlines() if ln.endswith("| yes |"))
    assert next(ln for ln in text.splitlines() if ln.startswith("| `nvml` |")).endswith("| – |")
    assert "session peak" in text and "load peak" in text
    plots = {p.name for p in (store.root / "plots").glob("*.png")}
    assert {"c-capacity.png", "c-latency.png", "c--default-memory.png"} <= plots


def test_console_and_report_say_each_stop_in_the_same_words(tmp_path: Path) -> None:
    store, text = build_run(tmp_path / "r1")
    rules = RULES.model_copy(update={"target_references": 3})
    (v,) = decide_all(store.load_steps(), store.load_sessions(), rules, ["c"])
    line = verdict_line(v)
    assert line == f"c: not-built — {summary(v)}"
    row = next(ln for ln in text.splitlines() if ln.startswith("| c | **not-built**"))
    assert summary(v) in row and len(summary(v)) <= 300
    # every flag set's stop is named, in a few words (issue 19: 2 of 5 were left out before)
    for words in ("default OOM at load", "offload OOM at 3 refs", "fp8 broken output from 1 ref; 3 refs not in "
                  "the run", "int8 serves ≤2; 3 refs not in the run"):
        assert words in line, line


def test_a_long_summary_is_clipped_at_words() -> None:
    v = Verdict("c", World.NOT_BUILT, 4, None, "; ".join(["default 'default': server did not start (oom_at_load: "
                                                          "out of memory at load)"] * 8), Evidence(), (), ())
    line = verdict_line(v)
    assert len(line) <= 320 and line.startswith("c: not-built — ") and line.endswith("…")
    assert clip("a total capacity of 7.75 MiB of which", 26) == "a total capacity of …"


def test_progress_memory_is_cleared_when_the_next_session_loads() -> None:
    from rich.console import Console

    from runner.present.progress import ProgressView

    view = ProgressView(Console(file=open("/dev/null", "w")), enabled=False)  # noqa: SIM115
    view.lane_started("gpu0", ("c", "d"), 4)
    view.session_started("c", "default", 0)
    view.session_ready("c", "default", 1.234)
    view.memory("c", 7 * 2**20)
    task = view.progress.tasks[0]
    assert task.fields["memory"] == "mem 7.00 MiB" and task.fields["session"] == "c/default ready in 1.23 s"
    view.session_started("d", "int8", 0)
    assert task.fields["memory"] == "mem – (loading)" and task.fields["session"] == "d/int8 loading"
    view.lane_started("cpu-x", ("cpu-x",), 2)  # a lane of one card: the label does not repeat the card
    view.session_started("cpu-x", "int8", 1)
    assert view.progress.tasks[1].fields["session"] == "int8 loading (restart 1)"
    assert view.progress.tasks[1].fields["lane"] == "cpu-x"
    broken = step("c", "fp8", 1, sanity=BROKEN)
    assert view.step_done(broken) is None
