"""Preflight reaches every host a run will use: a card on an `ssh://` host that refuses connections, or a
sidecar that does not answer with `require_idle_gpu`, stops the run with one line naming the card, the host
and the cause (exit 2, nothing started); `--skip-unreachable` runs the other cards and leaves that one's
steps for a resume, with one line.

The hosts are closed ports on 127.0.0.1 (bound, then released) — real connection refusals, with the real
`ssh` client and httpx."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_run import matrix, run

from runner.run import reach


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # released on close: nothing listens there


DOCKER_SERVER = """
[servers.boxed]
image = "runner-refserver:preflight-test"
command = ["python", "-m", "runner.refserver", "--host", "0.0.0.0", "--port", "{port}", "--preset", "tiny"]
port = 8000
"""

FLAGS = """
[flags.default]
role = "default"

[matrix]
references = [1, 2]
"""


def assert_stopped_in_preflight(proc: subprocess.CompletedProcess[str], tmp: Path, *needles: str) -> str:
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1, errors  # one line, not one per step
    line = errors[0]
    assert line.startswith("runner: error: card "), line
    for needle in needles:
        assert needle in line, line
    assert "Traceback" not in proc.stderr and "skipped" not in proc.stderr
    assert not (tmp / "results").exists()  # nothing started, nothing written
    return line


@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the ssh client (openssh-client)")
def test_a_card_on_an_unreachable_ssh_host_stops_in_preflight(tmp_path: Path) -> None:
    port = closed_port()
    host = f"ssh://root@127.0.0.1:{port}"
    path = matrix(tmp_path, DOCKER_SERVER + f"""
        [cards.remote]
        server = "boxed"
        backend = "docker"
        docker_host = "{host}"
        publish_host = "0.0.0.0"
        vram_gib = 1
        """ + FLAGS)
    proc, _ = run(path, timeout=60)
    line = assert_stopped_in_preflight(proc, tmp_path, "'remote'", host, "Connection refused")
    assert "docker host" in line


def test_an_unreachable_sidecar_with_require_idle_gpu_stops_in_preflight(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    path = matrix(tmp_path, f"""
        [cards.watched]
        server = "ref"
        vram_gib = 1
        meters = ["sidecar", "server"]
        sidecar_url = "{url}"
        """ + FLAGS)
    text = path.read_text().replace("[run]\n", "[run]\nrequire_idle_gpu = true\n", 1)
    path.write_text(text)
    proc, _ = run(path, timeout=60)
    assert_stopped_in_preflight(proc, tmp_path, "'watched'", "sidecar", url, "ConnectError")


def test_skip_unreachable_runs_the_other_cards_and_leaves_that_one_for_a_resume(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    path = matrix(tmp_path, f"""
        [cards.here]
        server = "ref"
        vram_gib = 1

        [cards.away]
        server = "ref"
        vram_gib = 1
        meters = ["prometheus", "server"]
        prometheus_url = "{url}"
        """ + FLAGS)
    proc, run_dir = run(path, "--skip-unreachable")
    assert proc.returncode == 1, proc.stderr  # steps left that a resume would send
    skips = [ln for ln in proc.stderr.splitlines() if "away" in ln and "skipping" in ln]
    assert len(skips) == 1 and url in skips[0] and "2 step(s)" in skips[0], proc.stderr
    assert (run_dir / "here" / "default").is_dir() and not (run_dir / "away").exists()
    assert sum("skipped (" in ln for ln in proc.stdout.splitlines() + proc.stderr.splitlines()) == 0
    assert "2 step(s) not done" in proc.stderr


def test_every_endpoint_a_card_names_is_probed(tmp_path: Path) -> None:
    from runner.plan.matrix import load_matrix

    path = matrix(tmp_path, DOCKER_SERVER + """
        [cards.all]
        server = "boxed"
        backend = "docker"
        docker_host = "ssh://u@gpu-host:2222"
        publish_host = "0.0.0.0"
        vram_gib = 1
        meters = ["sidecar", "dcgm", "prometheus", "server"]
        sidecar_url = "http://gpu-host:9500"
        dcgm_url = "http://gpu-host:9400/metrics"
        prometheus_url = "http://monitor:9090"

        [cards.plain]
        server = "ref"
        vram_gib = 1
        dcgm_url = "http://not-used:9400/metrics"
        """ + FLAGS.replace("[matrix]", "[matrix]\ncards = [\"all\", \"plain\"]"))
    m = load_matrix(path)
    found = [(e.card, e.what, e.probe_url) for e in reach.endpoints(m, ["all", "plain"])]
    assert found == [("all", "docker host", "ssh://u@gpu-host:2222"),
                     ("all", "sidecar", "http://gpu-host:9500/info"),
                     ("all", "dcgm-exporter", "http://gpu-host:9400/metrics"),
                     ("all", "Prometheus", "http://monitor:9090/api/v1/query?query=1")]  # 'plain' names no meter
    assert reach.ssh_argv("ssh://u@gpu-host:2222")[-7:] == ["-p", "2222", "--", "gpu-host", "docker", "version",
                                                            "--format", "{{.Server.Version}}"][-7:]
    assert reach.one_line("a\x1b[31mred\nline\x00") == "a\\x1b[31mred line\\x00"


def test_the_flag_is_in_the_help() -> None:
    out = subprocess.run([sys.executable, "-m", "runner", "run", "--help"], capture_output=True, text=True,
                         timeout=60).stdout
    assert "--skip-unreachable" in out


def test_a_baseline_cell_of_another_server_is_said_before_the_run_and_in_the_report(tmp_path: Path) -> None:
    """Card 'other' runs a differently sized model than the baseline cell's card: its PSNR compares two models'
    images. The run warns before it starts, verdict.json and report.md carry the note for that card only."""
    import json

    path = matrix(tmp_path, """
        [servers.bigger]
        command = ["{python}", "-m", "runner.refserver", "--port", "{port}", "--preset", "tiny", "--dim", "128",
                   "--vram-gib", "{vram_gib}"]

        [cards.base]
        server = "ref"
        vram_gib = 1

        [cards.other]
        server = "bigger"
        vram_gib = 1

        [flags.default]
        role = "default"

        [baseline]
        cell = "base/default"

        [matrix]
        references = [1]
        """)
    proc, run_dir = run(path)
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("runner: warning: baseline cell")]
    assert len(warnings) == 1 and "than other (server 'bigger' vs 'ref'" in warnings[0], proc.stderr
    notes = {v["card"]: v["notes"] for v in json.loads((run_dir / "verdict.json").read_text())["verdicts"]}
    assert not any("runs another server" in n for n in notes["base"])
    assert any("runs another server" in n for n in notes["other"])
    report = (run_dir / "report.md").read_text()
    other = report[report.index("## other"):]
    assert "runs another server than other" in other
