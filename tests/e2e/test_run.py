"""`runner MATRIX` end to end against the real reference server (subprocesses on 127.0.0.1).

Each test writes a small matrix, runs the real command, and asserts on the records it wrote.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jsonschema
import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "runner" / "schema" / "result.schema.json").read_text())
REFS = [str(ROOT / "examples" / "refs" / f"ref-{i}.png") for i in range(1, 5)]

OOM_TEXT = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"

pytestmark = pytest.mark.slow


def matrix(tmp: Path, body: str, *, seeds: str = "[1]", request_timeout: int = 30, ready_timeout: int = 90,
           repeats: int = 1, diagnosis: str = "oom") -> Path:
    text = textwrap.dedent(f"""
        [run]
        name = "e2e"
        diagnosis = "{diagnosis}"
        seeds = {seeds}
        repeats = {repeats}
        steps = 2
        size = "128x128"
        true_cfg_scale = 4.0
        negative_prompt = " "
        request_timeout_s = {request_timeout}
        ready_timeout_s = {ready_timeout}
        results_dir = "{tmp / 'results'}"

        [servers.ref]
        command = ["{{python}}", "-m", "runner.refserver", "--port", "{{port}}", "--preset", "tiny",
                   "--vram-gib", "{{vram_gib}}", "--oom-reply", "mangled"]

        [fixtures.shapes]
        prompt = "shapes on a table"
        references = {json.dumps(REFS)}
        """) + textwrap.dedent(body)
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "matrix.toml"
    path.write_text(text)
    return path


def run(path: Path, *extra: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess[str], Path]:
    proc = subprocess.run([sys.executable, "-m", "runner", str(path), "--no-progress", *extra],
                          capture_output=True, text=True, timeout=timeout, cwd=path.parent)
    runs = sorted((path.parent / "results").glob("e2e-*"))
    return proc, runs[-1] if runs else path.parent


def step(run_dir: Path, key: str) -> dict:
    return json.loads((run_dir / f"{key}.json").read_text())


def no_server_left(run_dir: Path) -> None:
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        assert not ("runner.refserver" in cmd and str(run_dir.parent.parent) in cmd), cmd


def test_three_flag_sets_oom_implied_skip_broken_output_and_offload_verdict(tmp_path: Path) -> None:
    path = matrix(tmp_path, """
        [cards.tight]
        server = "ref"
        vram_mib = 7.75

        [flags.default]
        role = "default"

        [flags.cond-host]
        role = "offload"
        args = ["--cond-cache", "host"]

        [flags.fp8]
        role = "offload"
        args = ["--quantization", "int8", "--fault", "transparent"]

        [baseline]
        cell = "tight/cond-host"

        [matrix]
        references = [1, 2, 3, 4]

        [verdict]
        max_latency_ratio = 20  # this test is about OOM and offload semantics, not a 2-core machine's timing
        """)
    proc, run_dir = run(path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # every record is written and valid against the published schema
    records = sorted(run_dir.glob("tight/*/refs-*/*.json")) + sorted(run_dir.glob("tight/*/session.json"))
    assert len(records) == 12 + 3
    for r in [*records, run_dir / "run.json"]:
        jsonschema.validate(json.loads(r.read_text()), SCHEMA)
    # default: OOM at 3 references, found in the server log (the HTTP body does not say so), 4 implied
    oom = step(run_dir, "tight/default/refs-3/shapes-seed-1")
    assert oom["status"] == "failed" and oom["failure"]["kind"] == "oom"
    assert "server log" in oom["failure"]["message"]
    assert any("CUDA out of memory" in line for line in oom["failure"]["evidence"])
    implied = step(run_dir, "tight/default/refs-4/shapes-seed-1")
    assert implied["status"] == "skipped" and "out-of-memory at 3" in implied["skip_reason"]
    # cache in host memory serves 4 with less device memory; images identical to the device cache's
    ok = step(run_dir, "tight/cond-host/refs-4/shapes-seed-1")
    assert ok["status"] == "ok" and (run_dir / "tight/cond-host/refs-4/shapes-seed-1.png").is_file()
    assert step(run_dir, "tight/cond-host/refs-1/shapes-seed-1")["deterministic"] is True
    assert ok["peaks"][0]["source"] == "server-response" and ok["peaks"][0]["available"]
    same = step(run_dir, "tight/default/refs-2/shapes-seed-1")
    assert same["image_sha256"] == step(run_dir, "tight/cond-host/refs-2/shapes-seed-1")["image_sha256"]
    # the transparent output is served over HTTP but is broken, and scored against the baseline cell
    broken = step(run_dir, "tight/fp8/refs-4/shapes-seed-1")
    assert broken["status"] == "ok" and broken["scores"]["sanity"]["broken"]
    assert broken["scores"]["baseline"] == "tight/cond-host/refs-4/shapes-seed-1"
    assert broken["scores"]["psnr_db"] < 15
    verdict = json.loads((run_dir / "verdict.json").read_text())["verdicts"][0]
    assert verdict["world"] == "offload-works" and verdict["flags"] == "cond-host"
    assert verdict["evidence"]["latency_ratio"] is not None
    # the default's evidence is the OOM at 3, not the step at 4 it implied
    assert verdict["evidence"]["flag_sets"]["default"]["record"] == "tight/default/refs-3/shapes-seed-1"
    assert verdict["evidence"]["flag_sets"]["default"]["stop"] == "capacity"
    assert "the baseline cell" in verdict["reason"]  # tight/cond-host is the baseline: not scored against itself
    report = (run_dir / "report.md").read_text()
    assert "offload-works" in report and "❌ OOM" in report and "⏭" in report
    assert (run_dir / "plots" / "tight-capacity.png").stat().st_size > 5000
    assert (run_dir / "plots" / "tight--default-memory.png").is_file()
    memory = (run_dir / "tight/default/memory.csv").read_text().splitlines()
    assert memory[0] == "t,attempt,source,metric,bytes" and len(memory) > 10
    assert "tight: offload-works" in proc.stdout
    no_server_left(run_dir)


def test_crash_restarts_once_and_records_lost_steps(tmp_path: Path) -> None:
    # Request 1 and its determinism repeat are requests 1-2; request 3 kills the server. After the restart
    # the new process dies at its own third request, and the one allowed restart is used up.
    path = matrix(tmp_path, """
        [cards.roomy]
        server = "ref"
        vram_mib = 64

        [flags.dies]
        role = "default"
        args = ["--fault", "exit@3"]

        [matrix]
        references = [0, 1, 2]
        """, seeds="[1, 2]")
    proc, run_dir = run(path)
    assert proc.returncode == 1, proc.stderr[-2000:]  # a step is left that a resume would send
    assert "1 step(s) not done" in proc.stderr and "--resume" in proc.stderr
    keys = [f"roomy/dies/refs-{n}/shapes-seed-{s}" for n in range(3) for s in (1, 2)]
    got = [step(run_dir, k) for k in keys]
    assert [g["status"] for g in got] == ["ok", "failed", "ok", "ok", "failed", "skipped"]
    assert got[1]["failure"]["kind"] == "crash" and got[1]["lost"] and got[1]["failure"]["exit_code"] == 1
    assert got[2]["attempt"] == 1 and got[4]["attempt"] == 1
    assert "restart" in got[5]["skip_reason"]
    verdict = json.loads((run_dir / "verdict.json").read_text())["verdicts"][0]
    assert verdict["world"] == "undecided"  # a crash without OOM text says nothing about memory
    assert verdict["evidence"]["blocking"][0]["record"] == "roomy/dies/refs-2/shapes-seed-1"  # the crash at 2
    session = json.loads((run_dir / "roomy/dies/session.json").read_text())
    assert len(session["starts"]) == 2 and all(s["ready_s"] for s in session["starts"])
    assert (run_dir / "roomy/dies/server.1.log").is_file()
    no_server_left(run_dir)


def test_hang_times_out_restarts_and_start_failures_are_classified(tmp_path: Path) -> None:
    path = matrix(tmp_path, f"""
        [servers.never-listens]
        command = ["{sys.executable}", "-c", "import time; time.sleep(120)", "{tmp_path}"]

        [servers.oom-at-load]
        command = ["{sys.executable}", "-c", "import sys; print('{OOM_TEXT}'); sys.exit(1)"]

        [cards.roomy]
        server = "ref"
        vram_mib = 64

        [cards.hangs-at-load]
        server = "never-listens"
        vram_gib = 1

        [cards.dies-at-load]
        server = "oom-at-load"
        vram_gib = 1

        [flags.hang]
        role = "default"
        args = ["--fault", "hang@3"]

        [flags.plain]
        role = "default"

        [matrix]
        references = [1, 2, 3]
        exclude = [{{card = "roomy", flags = "plain"}}, {{card = "hangs-at-load", flags = "hang"}},
                   {{card = "dies-at-load", flags = "hang"}}]
        """, request_timeout=4, ready_timeout=20)
    proc, run_dir = run(path)
    assert proc.returncode == 1, proc.stderr[-2000:]  # the never-ready card is left to a resume
    hung = step(run_dir, "roomy/hang/refs-2/shapes-seed-1")
    assert hung["failure"]["kind"] == "timeout" and hung["lost"] and 3.5 < hung["wall_s"] < 10
    session = json.loads((run_dir / "roomy/hang/session.json").read_text())
    assert len(session["starts"]) == 2  # restarted for the step after the hang, which was served
    assert step(run_dir, "roomy/hang/refs-3/shapes-seed-1")["status"] == "ok"
    load = json.loads((run_dir / "dies-at-load/plain/session.json").read_text())["starts"][0]
    assert load["failure"]["kind"] == "oom_at_load" and load["failure"]["exit_code"] == 1
    assert "CUDA out of memory" in load["failure"]["evidence"][0]
    assert step(run_dir, "dies-at-load/plain/refs-1/shapes-seed-1")["skip_reason"] == \
        "server did not start: oom_at_load"
    never = json.loads((run_dir / "hangs-at-load/plain/session.json").read_text())["starts"][0]
    assert never["failure"]["kind"] == "ready_timeout"
    verdicts = {v["card"]: v for v in json.loads((run_dir / "verdict.json").read_text())["verdicts"]}
    assert verdicts["dies-at-load"]["world"] == "not-built"
    assert "oom_at_load" in verdicts["dies-at-load"]["reason"]
    assert verdicts["hangs-at-load"]["world"] == "undecided"
    assert "ready_timeout" in verdicts["hangs-at-load"]["evidence"]["blocking"][0]["why"]
    # The never-listening server was stopped, not left behind. Its folder in its command tells it from other
    # tests' sleepers running beside it (a parallel run met one).
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        assert not ("time.sleep(120)" in cmd and str(tmp_path) in cmd), cmd


def test_interrupt_keeps_records_and_resume_finishes(tmp_path: Path) -> None:
    path = matrix(tmp_path, """
        [cards.roomy]
        server = "ref"
        vram_mib = 64

        [flags.default]
        role = "default"

        [matrix]
        references = [0, 1, 2, 3, 4]
        """, seeds="[1, 2, 3, 4]")
    proc = subprocess.Popen([sys.executable, "-m", "runner", str(path), "--no-progress"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(tmp_path.glob("results/e2e-*/roomy/default/refs-*/*.json"))) < 3:
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err and "Traceback" not in err
    run_dir = next(tmp_path.glob("results/e2e-*"))
    # what was kept and the exact resume command are printed; a partial report is written
    assert f"-m runner {path} --no-progress --resume {run_dir}" in err and "kept " in err
    report = (run_dir / "report.md").read_text()
    assert "interrupted" in report and "run interrupted" in report
    records = {p: p.read_bytes() for p in run_dir.glob("roomy/default/refs-*/*.json")}
    done = {p for p, text in records.items() if json.loads(text)["status"] == "ok"}
    assert 3 <= len(done) < 20
    assert any(json.loads(t)["status"] == "skipped" and json.loads(t)["skip_reason"] == "run interrupted"
               for t in records.values())
    no_server_left(run_dir)
    resumed = subprocess.run([sys.executable, "-m", "runner", str(path), "--no-progress", "--resume", str(run_dir)],
                             capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    after = [json.loads(p.read_text()) for p in run_dir.glob("roomy/default/refs-*/*.json")]
    assert len(after) == 20 and all(r["status"] == "ok" for r in after)
    session = json.loads((run_dir / "roomy/default/session.json").read_text())
    assert [s["attempt"] for s in session["starts"]] == [0, 1]  # the first run's start is kept
    assert any(n.startswith("resumed with") for n in session["notes"])
    assert (run_dir / "roomy/default/server.1.log").is_file()
    # the steps finished before the interrupt were not sent again: their records are byte for byte the same,
    # and the banner announced only the rest
    assert all(p.read_bytes() == records[p] for p in done)
    assert f"{20 - len(done)} step(s) to send of 20" in resumed.stderr
    assert sum(r["attempt"] == 1 for r in after) == 20 - len(done)


def test_openai_images_dialect_and_require_idle_gpu_without_a_way_to_check(tmp_path: Path) -> None:
    path = matrix(tmp_path, """
        [servers.images]
        command = ["{python}", "-m", "runner.refserver", "--port", "{port}", "--preset", "tiny",
                   "--served-model-name", "{model}"]  # vLLM-Omni 0.30's images API refuses another name
        dialect = "openai-images"

        [cards.cpu]
        server = "images"
        vram_gib = 1

        [cards.gpu]
        server = "ref"
        gpu = "0"
        vram_gib = 24
        meters = ["nvml", "server"]

        [flags.default]
        role = "default"

        [matrix]
        references = [0]
        """)
    text = path.read_text().replace("[run]\n", "[run]\nrequire_idle_gpu = true\n", 1)
    path.write_text(text)
    proc, run_dir = run(path)
    assert proc.returncode == 1, proc.stderr[-2000:]  # the GPU card's step is left to a resume
    ok = step(run_dir, "cpu/default/refs-0/shapes-seed-1")
    assert ok["status"] == "ok" and ok["request"]["path"] == "/v1/images/generations"
    assert ok["scores"]["sanity"]["width"] == 128 and ok["deterministic"] is True
    # No NVML here: the GPU card cannot be shown idle, so nothing is started on it (and nothing is killed).
    held = step(run_dir, "gpu/default/refs-0/shapes-seed-1")
    assert held["status"] == "skipped" and "cannot verify the GPU is idle" in held["skip_reason"]
    session = json.loads((run_dir / "gpu/default/session.json").read_text())
    assert session["starts"] == [] and session["idle_baseline"]["available"] is False
    facts = json.loads((run_dir / "run.json").read_text())["cards"]
    assert facts["cpu"]["vram_gib"] == 1 and "finished_at" in json.loads((run_dir / "run.json").read_text())


def test_sealed_baseline_directory_scores_each_step_and_report_reruns(tmp_path: Path) -> None:
    body = """
        [cards.roomy]
        server = "ref"
        vram_mib = 64

        [flags.default]
        role = "default"

        [matrix]
        references = [1, 2]
        """
    first, first_dir = run(matrix(tmp_path / "a", body))
    assert first.returncode == 0, first.stderr[-2000:]
    # Seal the first run's images as a baseline folder, the way the seed's Diffusers attempt is laid out.
    sealed = tmp_path / "b" / "sealed"
    sealed.mkdir(parents=True)
    samples = []
    for n in (1, 2):
        key = f"roomy/default/refs-{n}/shapes-seed-1"
        (sealed / f"shapes-{n}r-1.png").write_bytes((first_dir / f"{key}.png").read_bytes())
        samples.append({"fixture": "shapes", "references": n, "seed": 1, "file": f"shapes-{n}r-1.png",
                        "wall_s": 80.0})
    (sealed / "samples.json").write_text(json.dumps({"samples": samples}))
    second_path = matrix(tmp_path / "b", body.replace("[matrix]", '[baseline]\ndir = "sealed"\n\n[matrix]'))
    second, run_dir = run(second_path)
    assert second.returncode == 0, second.stderr[-2000:]
    scored = step(run_dir, "roomy/default/refs-2/shapes-seed-1")["scores"]
    assert scored["baseline"] == str((sealed / "shapes-2r-1.png").resolve()) and scored["psnr_db"] == 100.0
    verdict = json.loads((run_dir / "verdict.json").read_text())["verdicts"][0]
    assert verdict["world"] == "fits-resident"
    # `runner report` rebuilds everything from the records and the matrix text stored in run.json
    (run_dir / "report.md").unlink()
    again = subprocess.run([sys.executable, "-m", "runner", "report", str(run_dir)], capture_output=True, text=True,
                           timeout=120, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "fits-resident" in (run_dir / "report.md").read_text() and "warning" not in again.stderr


def tree(run_dir: Path) -> dict[Path, bytes]:
    """Every step and session record and server log of a run, by path."""
    return {p: p.read_bytes() for p in run_dir.glob("*/*/**/*")
            if p.is_file() and p.suffix in (".json", ".log", ".png", ".csv")}


def test_resume_of_a_finished_run_starts_nothing_and_sends_nothing(tmp_path: Path) -> None:
    path = matrix(tmp_path, f"""
        [servers.oom-at-load]
        command = ["{sys.executable}", "-c", "import sys; print('{OOM_TEXT}'); sys.exit(1)"]

        [cards.tight]
        server = "ref"
        vram_mib = 7.75

        [cards.dies-at-load]
        server = "oom-at-load"
        vram_gib = 1

        [flags.default]
        role = "default"

        [matrix]
        references = [1, 2, 3, 4]
        """, seeds="[1, 2]")
    first, run_dir = run(path)
    assert first.returncode == 0, first.stderr[-2000:]
    # tight: OOM at 3 refs (seed 1); seed 2 at 3 and everything at 4 are implied by it, not sent
    implied = [step(run_dir, f"tight/default/refs-{n}/shapes-seed-{s}") for n, s in ((3, 2), (4, 1), (4, 2))]
    assert all(r["status"] == "skipped" and r["implied_by"] == "tight/default/refs-3/shapes-seed-1" for r in implied)
    assert step(run_dir, "tight/default/refs-3/shapes-seed-1")["failure"]["kind"] == "oom"
    before = tree(run_dir)
    again = subprocess.run([sys.executable, "-m", "runner", str(path), "--no-progress", "--resume", str(run_dir)],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "nothing left to send" in again.stderr
    # no server started (no new log, session.json unchanged), no request sent (step records unchanged)
    assert tree(run_dir) == before  # (its wall time is no proof: 11 s under a loaded CI, with nothing started)
    assert "tight: " in again.stdout and "dies-at-load: not-built" in again.stdout


def test_kill_mid_session_resume_continues_it_and_keeps_the_killed_start(tmp_path: Path) -> None:
    path = matrix(tmp_path, """
        [cards.roomy]
        server = "ref"
        vram_mib = 64

        [flags.first]
        role = "default"

        [flags.second]
        role = "offload"
        args = ["--cond-cache", "host"]

        [matrix]
        references = [0, 1, 2, 3]
        """, seeds="[1, 2, 3]")
    proc = subprocess.Popen([sys.executable, "-m", "runner", str(path), "--no-progress"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and len(list(tmp_path.glob("results/e2e-*/roomy/second/refs-*/*.json"))) < 3:
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)  # no cleanup of the runner's own: records are what was written
    proc.wait(timeout=30)
    run_dir = next(tmp_path.glob("results/e2e-*"))
    time.sleep(3)  # the killed runner's server notices its parent is gone or is left; it is not ours to judge
    first_session = (run_dir / "roomy/first/session.json").read_bytes()
    kept = {p: p.read_bytes() for p in run_dir.glob("roomy/*/refs-*/*.json")}
    killed = json.loads((run_dir / "roomy/second/session.json").read_text())
    assert len(killed["starts"]) == 1 and killed["starts"][0]["stopped_at"] is None  # open when killed
    samples = (run_dir / "roomy/second/memory.csv").read_text().splitlines()
    assert len(samples) > 2
    resumed = subprocess.run([sys.executable, "-m", "runner", str(path), "--no-progress", "--resume", str(run_dir)],
                             capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "1 of 2 session(s)" in resumed.stderr
    # the finished session was not restarted; the killed one continued with a new start after the killed one
    assert (run_dir / "roomy/first/session.json").read_bytes() == first_session
    assert not (run_dir / "roomy/first/server.1.log").exists()
    session = json.loads((run_dir / "roomy/second/session.json").read_text())
    assert [s["attempt"] for s in session["starts"]] == [0, 1]
    assert session["starts"][0]["started_at"] == killed["starts"][0]["started_at"]
    memory = (run_dir / "roomy/second/memory.csv").read_text().splitlines()
    assert set(samples[1:]) <= set(memory[1:])  # the killed start's samples are kept
    assert any(line.split(",")[1] == "1" for line in memory[1:])
    assert all(p.read_bytes() == text for p, text in kept.items())  # finished steps not sent again
    records = [json.loads(p.read_text()) for p in run_dir.glob("roomy/*/refs-*/*.json")]
    assert len(records) == 24 and all(r["status"] == "ok" for r in records)


def test_repeats_are_timed_and_compared_and_a_failing_repeat_is_what_it_is(tmp_path: Path) -> None:
    path = matrix(tmp_path, """
        [cards.roomy]
        server = "ref"
        vram_mib = 64

        [flags.default]
        role = "default"

        [flags.repeat-dies]
        role = "offload"
        args = ["--fault", "exit@2"]

        [matrix]
        references = [0, 1]
        """, repeats=3, request_timeout=10)
    proc, run_dir = run(path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ok = step(run_dir, "roomy/default/refs-1/shapes-seed-1")
    assert len(ok["wall_samples_s"]) == 3 and ok["wall_s"] == ok["wall_samples_s"][0]
    assert ok["deterministic"] is True and ok["request"]["sends"] == 3
    # the second send of the first step kills the server: a crash (lost), not "served, not deterministic"
    died = step(run_dir, "roomy/repeat-dies/refs-0/shapes-seed-1")
    assert died["status"] == "failed" and died["failure"]["kind"] == "crash" and died["lost"]
    assert died["deterministic"] is None and "send 2 of 3" in died["failure"]["message"]
    assert died["wall_samples_s"] == [died["wall_s"]]
    # the next step is not charged: the server was restarted for it (and dies again at its own 2nd send)
    nxt = step(run_dir, "roomy/repeat-dies/refs-1/shapes-seed-1")
    assert nxt["attempt"] == 1 and "send 2 of 3" in nxt["failure"]["message"]


def test_determinism_resend_that_hangs_is_a_timeout_and_does_not_charge_the_next_step(tmp_path: Path) -> None:
    path = matrix(tmp_path, """
        [cards.roomy]
        server = "ref"
        vram_mib = 64

        [flags.resend-hangs]
        role = "default"
        args = ["--fault", "hang@2"]

        [matrix]
        references = [0, 1]
        """, request_timeout=4)
    proc, run_dir = run(path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    hung = step(run_dir, "roomy/resend-hangs/refs-0/shapes-seed-1")
    assert hung["status"] == "failed" and hung["failure"]["kind"] == "timeout" and hung["lost"]
    assert hung["deterministic"] is None and "send 2 of 2" in hung["failure"]["message"]
    assert hung["wall_samples_s"] == [hung["wall_s"]] and hung["wall_s"] < 4  # the timed send was served
    nxt = step(run_dir, "roomy/resend-hangs/refs-1/shapes-seed-1")
    assert nxt["status"] == "ok" and nxt["attempt"] == 1 and nxt["wall_s"] < 4
