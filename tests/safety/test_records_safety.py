"""Issue 9 items 4-6 and 11: secrets never stored or printed, "${VAR}" resolved only at start, wrong-size
images are broken output, record paths stay in the run folder, and a full or read-only results disk stops
with one clear error while earlier records stay intact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from runner.backends.base import Attempt
from runner.backends.local import LocalServer
from runner.core.records import Status, StepRecord
from runner.judge import scoring, verdict
from runner.plan.lanes import ServerPlan, make_plan
from runner.plan.matrix import ServerProfile, VerdictRules, load_matrix
from runner.present import runinfo
from runner.run.store import RunStore, StoreError, atomic_write, inside

SECRET = "hf_SeCrEt_0123456789"


def secret_matrix(d: Path) -> Path:
    text = (d / "matrix.toml").read_text()
    text = text.replace('[cards.small]', f'[cards.small]\nenv = {{ HF_TOKEN = "{SECRET}", PLAIN = "1" }}')
    text = text.replace('role = "offload"', f'role = "offload"\nenv = {{ "MY_API_KEY" = "{SECRET}x", '
                                            f'GATED_TOKEN = "${{RUNNER_TEST_TOKEN}}" }}')
    (d / "matrix.toml").write_text(text)
    return d / "matrix.toml"


def test_run_json_holds_no_secret_and_its_matrix_text_still_loads(matrix_dir: Path, tmp_path: Path) -> None:
    m = load_matrix(secret_matrix(matrix_dir))
    doc = runinfo.run_doc(m, make_plan(m), "r", 0.0)
    stored = json.dumps(doc)
    assert SECRET not in stored
    assert doc["matrix"]["sha256"] == m.sha256  # the hash is still the real file's (resume compares it)
    parsed = tomllib.loads(doc["matrix"]["text"])
    assert parsed["cards"]["small"]["env"] == {"HF_TOKEN": "***", "PLAIN": "1"}
    assert parsed["flags"]["host-cache"]["env"]["GATED_TOKEN"] == "${RUNNER_TEST_TOKEN}"  # a name, kept
    copy = tmp_path / "stored.toml"
    copy.write_text(doc["matrix"]["text"])
    load_matrix(copy, check_files=False, base=matrix_dir)  # `runner report` reloads it


def test_plan_prints_no_secret(matrix_dir: Path) -> None:
    path = secret_matrix(matrix_dir)
    proc = subprocess.run([sys.executable, "-m", "runner", "plan", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert SECRET not in proc.stdout + proc.stderr and "MY_API_KEY=***" in proc.stdout


def test_env_reference_is_resolved_only_in_the_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNNER_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("RUNNER_TEST_TOKEN", SECRET)
    out = tmp_path / "seen"
    argv = (sys.executable, "-c", f"import os; open({str(out)!r}, 'w').write(os.environ['HF_TOKEN'])")
    spec = ServerPlan(backend="local", profile=ServerProfile(name="t", command=argv), argv=argv,
                      env={"HF_TOKEN": "${RUNNER_TEST_TOKEN}"})
    server = LocalServer(spec, Attempt(name="t", log_path=tmp_path / "server.log"))
    server.start()
    server.proc.wait(30)  # type: ignore[union-attr]
    assert out.read_text() == SECRET
    assert spec.env["HF_TOKEN"] == "${RUNNER_TEST_TOKEN}"  # what the runner holds and records is the name
    assert SECRET not in json.dumps(server.info())


def png(size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def test_wrong_size_is_broken_output() -> None:
    requested = scoring.score(png((32, 32)), None, None, expected_size=(64, 64))
    assert requested.sanity.broken and "requested 64x64" in requested.sanity.reasons[0]
    vs_base = scoring.score(png((32, 32)), png((64, 64)), "b")
    assert vs_base.sanity.broken and "baseline is 64x64" in vs_base.sanity.reasons[0]
    right = scoring.score(png((64, 64)), None, None, expected_size=(64, 64))
    assert not right.sanity.broken
    # ... and the verdict does not count it as served.
    step = StepRecord(key="c/f/refs-1/x-seed-1", card="c", flags="f", role="default", fixture="x",
                      references=1, seed=1, status=Status.OK, scores=vs_base)
    rules = VerdictRules(target_references=1, max_latency_ratio=2.5, min_psnr_db=20, offload_roles=("offload",),
                         max_transparent_share=0.5, min_pixel_std=2.0)
    (cell,) = verdict.summarise([step], rules)
    assert cell.blocker == "broken"


def test_record_paths_stay_inside_the_run_folder(tmp_path: Path) -> None:
    assert inside(tmp_path, "a/b/refs-1/x.json") == tmp_path / "a/b/refs-1/x.json"
    for bad in ("../x.json", "a/../../x.json", "/etc/x.json", ".."):
        with pytest.raises(ValueError):
            inside(tmp_path, bad)
    with pytest.raises(ValueError):
        RunStore(tmp_path).session_dir("..")


@pytest.fixture
def tiny_disk(tmp_path: Path):  # type: ignore[no-untyped-def]
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_full_disk_is_one_store_error_and_earlier_records_survive(tiny_disk: Path) -> None:
    store = RunStore(tiny_disk / "run")
    store.write_run({"run_id": "r"})
    written = 0
    with pytest.raises(StoreError) as info:
        for i in range(1000):
            atomic_write(store.root / "c" / "f" / f"blob-{i}.bin", os.urandom(16_000))
            written = i
    message = str(info.value)
    assert "No space left on device" in message and "every record finished before it is kept" in message
    assert "\n" not in message
    assert json.loads((store.root / "run.json").read_text()) == {"run_id": "r"}
    assert (store.root / "c" / "f" / f"blob-{written}.bin").stat().st_size == 16_000
    assert not list((store.root / "c" / "f").glob(".*"))  # no temp file left behind


def test_read_only_disk_is_one_store_error(tiny_disk: Path) -> None:
    store = RunStore(tiny_disk / "run")
    store.write_run({"run_id": "r"})
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_disk)], check=True)
    with pytest.raises(StoreError) as info:
        store.write_run({"run_id": "r", "more": 1})
    assert "Read-only file system" in str(info.value)
    assert json.loads((store.root / "run.json").read_text()) == {"run_id": "r"}


def test_matrix_text_masking_survives_odd_toml(tmp_path: Path) -> None:
    from runner.core.secrets import mask_text

    text = textwrap.dedent(f'''
        [servers.a]
        env = {{ "HF_TOKEN" = 'lit{SECRET}', OTHER = "1" }}
        [cards.b.env]
        DB_PASSWORD = """
        {SECRET}"""
        port = 1
    ''')
    pairs = [("HF_TOKEN", f"lit{SECRET}"), ("OTHER", "1"), ("DB_PASSWORD", f"{SECRET}")]
    masked = mask_text(text, pairs)
    assert SECRET not in masked
    assert tomllib.loads(masked)["servers"]["a"]["env"] == {"HF_TOKEN": "***", "OTHER": "1"}


def test_cell_rescoring_keeps_the_requested_size_check(matrix_dir: Path, tmp_path: Path) -> None:
    """A baseline cell of the same wrong size must not make a wrong-size image look served after the run."""
    import io

    from runner.run.rescore import rescore_against_cell

    path = matrix_dir / "matrix.toml"
    path.write_text(path.read_text() + '\n[baseline]\ncell = "small/default"\n')
    m = load_matrix(path)  # size = "64x64"
    store = RunStore(tmp_path / "run")
    buf = io.BytesIO()
    png((32, 32)).save(buf, "PNG")
    for flags in ("default", "host-cache"):
        step = StepRecord(key=f"small/{flags}/refs-1/pair-seed-1", card="small", flags=flags, role="default",
                          fixture="pair", references=1, seed=1, status=Status.OK)
        store.write_step(step, buf.getvalue())
    rescore_against_cell(m, store)
    for s in store.load_steps():
        assert s.scores is not None and s.scores.sanity.broken
        assert "requested 64x64" in s.scores.sanity.reasons[0]
