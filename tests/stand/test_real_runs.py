"""`runner` end to end against the real vLLM-Omni 0.30.0 on the test stand: examples/real-omni.toml's worlds from the
real code (a card that serves 4 references with the server's own peak per count, one that runs out of memory in a
request at a line of vLLM-Omni's code, one that runs out at load), a start that fails for a reason that is not
memory (the platform plugin disabled), quoted by its cause."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import with_keys
from tests.stand.conftest import OOM_SITE, READY_TIMEOUT_S, ROOT, require_stand, stand_example

# These tests start the real server (a minute a start under the suite's load): handed out with the slow tests
# (tests/conftest.py), before the quick ones, so that none of them is the last thing a worker does
pytestmark = pytest.mark.slow


def run(matrix: Path, results: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runner", str(matrix), "--results", str(results), "--no-progress",
                           *extra], capture_output=True, text=True, timeout=800, cwd=ROOT)


@pytest.fixture(scope="module")
def example_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """examples/real-omni.toml with one seed and its default flag set (its offload flag sets are inert on a CPU:
    the example itself shows that); the diagnosis pass on."""
    require_stand()
    results = tmp_path_factory.mktemp("real-omni")
    matrix = stand_example(results / "matrix", matrix={"flags": '["default"]'})
    proc = run(matrix, results)
    (run_dir,) = results.glob("real-omni-*")
    return proc, run_dir


def verdicts(run_dir: Path) -> dict[str, dict]:
    return {c["card"]: c for c in json.loads((run_dir / "verdict.json").read_text())["verdicts"]}


def steps(run_dir: Path, card: str) -> dict[str, dict]:
    return {p.parent.name + "/" + p.stem: json.loads(p.read_text())
            for p in (run_dir / card / "default").glob("refs-*/*.json")}


def test_the_roomy_card_serves_four_references_with_the_servers_own_peaks(example_run) -> None:
    proc, run_dir = example_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert verdicts(run_dir)["cpu-roomy"]["world"] == "fits-resident"
    peaks = {}
    for key, record in steps(run_dir, "cpu-roomy").items():
        assert record["status"] == "ok", key
        (peak,) = [p for p in record["peaks"] if p["source"] == "server-response"]
        peaks[record["references"]] = peak["bytes"]
    assert sorted(peaks) == [1, 2, 3, 4]
    assert all(peaks[n] < peaks[n + 1] for n in (1, 2, 3))  # each reference costs memory, in the server's words
    assert peaks[1] > 100 * 2**20 and peaks[4] < 256 * 2**20


def test_the_small_card_runs_out_in_a_request_at_a_line_of_vllm_omnis_code(example_run) -> None:
    _, run_dir = example_run
    card = verdicts(run_dir)["cpu-small"]
    assert card["world"] == "not-built"
    failed = [r for r in steps(run_dir, "cpu-small").values() if r["status"] == "failed"]
    (oom,) = failed
    assert oom["references"] == 3 and oom["failure"]["kind"] == "oom"
    site = oom["failure"]["oom"]["site"]
    assert site == OOM_SITE, site
    report = (run_dir / "report.md").read_text().replace("\\_", "_")  # Markdown escapes the underscores
    assert "Where a fix would go" in report and site in report
    # the server's words are the body's message, never its JSON; the pass read a trace, no snapshot, and says so
    assert '{"error"' not in report and "the server says: Image generation failed: CUDA out of memory" in report
    assert "What held the memory (the diagnosis pass read no allocator snapshot):" in report


def test_what_the_real_server_leaves_after_a_request_is_the_last_requests_references(example_run) -> None:
    """vLLM-Omni 0.30.0 keeps each request's pre-processed references (12.3 MiB each at its condition size) until
    the next request (docs/evidence/stand-retention): the levels grow per reference in the matrix's order, and
    the retention probe (the 1-ref request sent again after the last) brings them back down."""
    _, run_dir = example_run
    findings = verdicts(run_dir)["cpu-roomy"]["findings"]["flag_sets"]["default"]
    kept = findings["retention"]
    assert kept["kind"] == "until-next-request" and kept["bound"] == "exact", kept
    assert 11 * 2**20 < kept["per_bytes"] < 13.5 * 2**20, kept
    assert kept["probe_floor_bytes"] - kept["load_bytes"] < 1.2 * kept["per_bytes"], kept
    report = (run_dir / "report.md").read_text()
    assert "per reference of the last request until the next one" in report


def test_the_tiny_card_runs_out_at_load_inside_vllm_omni(example_run) -> None:
    _, run_dir = example_run
    assert verdicts(run_dir)["cpu-tiny"]["world"] == "not-built"
    session = json.loads((run_dir / "cpu-tiny" / "default" / "session.json").read_text())
    failure = session["starts"][-1]["failure"]
    assert failure["kind"] == "oom_at_load", failure
    assert failure["oom"]["site"].startswith("vllm_omni/"), failure["oom"]
    # no diagnosis start: the real server's profiler starts only through its endpoints, which a load OOM never opens
    diagnosis = json.loads((run_dir / "cpu-tiny" / "default" / "diagnosis.json").read_text())
    assert diagnosis["outcome"] == "not run" and diagnosis["start_s"] is None, diagnosis
    assert 'its log says "vLLM server version 0.30.0"' in diagnosis["why_none"], diagnosis


def test_the_diagnosis_pass_does_not_kill_the_server_and_reads_its_trace(example_run) -> None:
    _, run_dir = example_run
    diagnosis = json.loads((run_dir / "cpu-small" / "default" / "diagnosis.json").read_text())
    assert diagnosis["outcome"] == "oom", diagnosis
    assert diagnosis["snapshot"] is None
    assert "Segmentation" not in (run_dir / diagnosis["log"]).read_text()
    assert diagnosis["trace"] and diagnosis["trace_device"] == "CPU", diagnosis
    assert diagnosis["trace_peak_bytes"] > 100 * 2**20
    assert "trace" in diagnosis["why_none"]


def test_a_start_without_the_platform_quotes_the_cause_not_the_wrapper(tmp_path: Path) -> None:
    require_stand()
    matrix = stand_example(tmp_path / "matrix", matrix={"flags": '["default"]', "cards": '["cpu-roomy"]',
                                                        "references": "[1]"},
                           verdict={"target_references": "1"})
    # VLLM_PLUGINS names the plugins vLLM-Omni may load: ours is not among them, so 0.30.0 runs without a platform
    matrix.write_text(matrix.read_text().replace('VLLM_TARGET_DEVICE = "cpu",',
                                                 'VLLM_TARGET_DEVICE = "cpu", VLLM_PLUGINS = "none",'))
    proc = run(matrix, tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    (run_dir,) = tmp_path.glob("real-omni-*")
    card = verdicts(run_dir)["cpu-roomy"]
    assert card["world"] == "undecided"
    said = json.dumps(card)
    assert "NotImplementedError" in said and "set_device" in said, said[:2000]


FIXTURES = Path(__file__).with_name("fixtures")


def fixture_matrix(name: str, folder: Path) -> Path:
    """A fixture matrix with its references pointed at examples/refs (its server paths are the stand's, relative to
    the repository's root, where the runner runs) and the suite's ready timeout."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    text = (FIXTURES / name).read_text().replace('"refs/', f'"{ROOT}/examples/refs/')
    path.write_text(with_keys(text, ready_timeout_s=str(READY_TIMEOUT_S)))
    return path


def test_the_first_contact_writes_no_sentence_its_records_contradict(tmp_path: Path) -> None:
    """The shared data's first contact again (no accounted card: peak_memory_mb 0.0 in every answer, no meter on
    the device): every request comes back with an image, nothing measures the device, and the report says so."""
    require_stand()
    proc = run(fixture_matrix("first-contact.toml", tmp_path / "matrix"), tmp_path)
    (run_dir,) = tmp_path.glob("real-omni-*")
    records = [json.loads(p.read_text()) for p in run_dir.glob("cpu/*/refs-*/*.json")]
    assert len(records) == 8 and all(r["status"] == "ok" and r["image"] for r in records), proc.stderr[-2000:]
    assert all(r["server_peak_mib"] is None for r in records)  # 0.0 is no figure
    report = (run_dir / "report.md").read_text()
    # the three sentences of the first contact, each contradicted by these records
    assert "no request came back with an image" not in report
    assert "different memory peaks" not in report and "the flags changed memory" not in report
    assert "fits-resident (default) — offload serves" not in proc.stdout
    # what is true instead: served with images, no device-memory figure, so no world
    card = verdicts(run_dir)["cpu"]
    assert card["world"] == "undecided" and "no device-memory figure" in card["reason"], card["reason"]
    assert "came back with images at 1 ref and 2 refs, but with no device-memory figure" in report
    assert proc.returncode == 1


def test_a_model_the_server_does_not_serve_is_named_before_any_request(tmp_path: Path) -> None:
    require_stand()
    proc = run(fixture_matrix("model-mismatch.toml", tmp_path / "matrix"), tmp_path)
    lines = proc.stderr.splitlines()  # the console's lines
    said = [i for i, line in enumerate(lines) if line.startswith('[servers.omni] model = "')
            and "'omni'" in line and "tiny-qwen-image-edit-plus" in line]
    steps_at = [i for i, line in enumerate(lines) if line.startswith("cpu/default/refs-")]
    assert len(said) == 1 and steps_at and said[0] < steps_at[0], proc.stderr[-3000:]
    (run_dir,) = tmp_path.glob("real-omni-edits-*")
    records = [json.loads(p.read_text()) for p in run_dir.glob("cpu/default/refs-*/*.json")]
    assert len(records) == 2 and all(r["failure"]["http_status"] == 400 for r in records)  # every request sent
    message = records[0]["failure"]["evidence"][0]
    assert "Model mismatch: request specifies 'omni'" in message and "tiny-qwen-image-edit-plus" in message
    reason = verdicts(run_dir)["cpu"]["reason"]
    assert "Model mismatch" in reason and '"POST /v1/images/edits HTTP/1.1" 400' not in reason, reason
