"""READY means the host is ready as it is: issue 22's cases that need no running sidecar, each over real SSH
to a throwaway user of its own (ready.py). Each puts the host into the untidy state a user's machine can be in (an
odd prometheus.yml, an unreadable file, a user outside the docker group) and checks that the summary says NOT
READY, names why and exits non-zero, or says READY only where the host is. Each test has its own world, so they
run side by side; the sidecar's cases, which build on one another, are test_provision_ready_sidecar.py's.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from ready import BEGIN, Cli, cli, interrupt_at, ready_world
from sshhost import executable

pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.usefixtures("clean_env")]


@pytest.fixture
def world(tmp_path_factory: pytest.TempPathFactory):
    yield from ready_world(tmp_path_factory)

# --- 1 and 6: -l, --tags, --check; Docker's own words -----------------------------------------------------

def test_limit_tags_and_check_all_print_the_summary_and_fail_with_dockers_own_error(world, tmp_path: Path) -> None:
    """The user outside the docker group, and the command every `next:` line gives (`-l rtx3090 --tags docker`):
    the summary is printed and the run fails, with -l or without, with --check or without; the message quotes
    Docker ("permission denied"), and a daemon that does not answer reads differently."""
    host = world["host"]
    subprocess.run(["gpasswd", "-d", host.user, "docker"], check=True, capture_output=True)
    try:
        for args in (["-l", "rtx3090", "--tags", "docker"], ["-l", "rtx3090", "--tags", "docker", "--check"],
                     ["--tags", "docker"]):
            r = cli(world, tmp_path, *args)
            assert r.rc != 0, (args, r.out[-3000:])
            assert any(line.startswith("rtx3090 NOT READY: docker:") for line in r.summary), (args, r.out[-3000:])
            assert "permission denied" in r.text and "docker.sock" in r.text, r.text
            assert "next: " in r.text and "-l rtx3090 --tags docker" in r.text
    finally:
        subprocess.run(["gpasswd", "-a", host.user, "docker"], check=True, capture_output=True)
    # A Docker context pointing at a socket nothing serves: Docker's "Cannot connect", not the same sentence.
    dead = host.run(f"docker context create dead --docker host=unix://{host.home}/nothing.sock"
                    " && docker context use dead")
    assert dead.returncode == 0, dead.stderr
    try:
        r = cli(world, tmp_path, "-l", "rtx3090", "--tags", "docker")
        assert r.rc != 0 and "rtx3090 NOT READY: docker:" in r.text, r.out[-3000:]
        assert "Cannot connect to the Docker daemon" in r.text and "nothing.sock" in r.text, r.text
        assert "permission denied" not in r.text
    finally:
        host.run("docker context use default && docker context rm dead")


# --- 7: an unreadable reference file ----------------------------------------------------------------------

def test_an_unreadable_reference_file_is_named(world, tmp_path: Path) -> None:
    host = world["host"]
    ref = host.home / "ref-1.png"
    ref.write_bytes(b"\x89PNG not really")
    shutil.chown(ref, host.user, host.user)
    ref.chmod(0)
    # No -l: the summary is printed here whatever item 1 does, so this checks the message alone.
    r = cli(world, tmp_path, "--tags", "assets", ev={"assets_files": [{"path": str(ref), "sha256": "0" * 64}]})
    assert r.rc != 0, r.out[-3000:]
    expected = f"rtx3090 NOT READY: assets: assets: {ref} on rtx3090 is not readable by {host.user}"
    assert expected in r.text, r.out[-3000:]
    assert "has no attribute" not in r.out


# --- 4, 5, 8, 9, 10: the workstation's prometheus.yml --------------------------------------------------------

USER_PROM = """\
global:
  scrape_interval: 15s
rule_files:
  - rules.yml
scrape_configs:
  - job_name: node
    static_configs:
      - targets: ["127.0.0.1:9100"]
"""
# Answers --version like promtool, rejects every config.
FAILING_PROMTOOL = """#!/bin/sh
case "$1" in --version) echo "promtool 2.42.0";; *) echo "FAILED: bad config" >&2; exit 1;; esac
"""
BROKEN_RULES = "groups:\n  - name: desk\n    rules:\n      - alert: Broken\n        expr: 'up =='\n"


def _prom(world, text: str | bytes, name: str) -> Path:
    path = world["d"] / "prom" / name
    for old in path.parent.glob(name + "*"):
        old.unlink()
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def _monitoring(world, tmp_path: Path, path: Path, *args: str, ev: dict | None = None) -> Cli:
    return cli(world, tmp_path, "--tags", "monitoring", *args,
               ev={"monitoring_prometheus_config": str(path), **(ev or {})})


def _promtool(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True)


def _backups(path: Path) -> list[Path]:
    return sorted(path.parent.glob(path.name + ".*~"))


def test_a_config_left_unchecked_by_an_interrupted_run_is_validated(world, tmp_path: Path) -> None:
    """4a: SIGINT at the promtool task; the rerun changes nothing but validates anyway, and says NOT READY."""
    path = _prom(world, USER_PROM, "interrupted.yml")
    (path.parent / "rules.yml").write_text(BROKEN_RULES)  # the user's rule file: promtool rejects the config
    # promtool answers in a fraction of a second here, before a SIGINT read from the output could land: a
    # wrapper that waits first keeps the interruption inside the task, as on a loaded workstation.
    slow = tmp_path / "slow-promtool"
    executable(slow, f'#!/bin/sh\n[ "$1" = --version ] || sleep 20\nexec {shutil.which("promtool")} "$@"\n')
    interrupt_at(world, tmp_path, "Check the config (promtool check config)", "--tags", "monitoring",
                 "-e", f"monitoring_prometheus_config={path}", "-e", f"monitoring_promtool={slow}")
    assert BEGIN in path.read_text() and _promtool(path).returncode != 0  # written, never validated
    r = _monitoring(world, tmp_path, path)
    assert r.rc != 0, r.out[-3000:]
    assert "localhost NOT READY: monitoring:" in r.text and f"promtool rejects {path} as it is" in r.text, r.text
    assert "This run did not change it" in r.text and str(_backups(path)[-1]) in r.text, r.text
    # The same with --check: validated, NOT READY, non-zero.
    r = _monitoring(world, tmp_path, path, "--check")
    assert r.rc != 0 and f"promtool rejects {path} as it is" in r.text, r.out[-3000:]


def test_runners_block_twice_is_refused(world, tmp_path: Path) -> None:
    """4b: a config holding runner's block twice (promtool: multiple scrape configs with the same job name)."""
    path = _prom(world, USER_PROM.replace("  - rules.yml\n", ""), "twice.yml")
    r = _monitoring(world, tmp_path, path)
    assert r.rc == 0, r.out[-3000:]
    text = path.read_text()
    block = re.search(r"(?ms)^# BEGIN runner scrape jobs.*?^# END runner scrape jobs[^\n]*\n", text).group(0)
    twice = text + block
    path.write_text(twice)
    r = _monitoring(world, tmp_path, path)
    assert r.rc != 0 and "localhost NOT READY: monitoring:" in r.text, r.out[-3000:]
    assert "holds 2 `# BEGIN runner scrape jobs`" in r.text, r.text
    assert path.read_text() == twice


def test_a_created_config_promtool_rejects_is_removed(world, tmp_path: Path) -> None:
    """4c: a fresh path and a promtool that rejects it: the new file is removed, and the next run is not READY."""
    bad = tmp_path / "promtool"
    executable(bad, FAILING_PROMTOOL)
    path = world["d"] / "prom" / "fresh" / "prometheus.yml"
    for attempt in range(2):
        r = _monitoring(world, tmp_path, path, ev={"monitoring_promtool": str(bad)})
        assert r.rc != 0, (attempt, r.out[-3000:])
        assert "promtool rejects" in r.text and "FAILED: bad config" in r.text, r.text
        assert "The file this run created was removed" in r.text, r.text
        assert not path.exists()


def test_a_list_at_column_zero_gets_runners_jobs_at_column_zero(world, tmp_path: Path) -> None:
    """5: `scrape_configs:` then `- job_name:` at column 0 (valid YAML): runner's block follows that indentation."""
    mine = ("global:\n  scrape_interval: 15s\nscrape_configs:\n"
            "- job_name: node\n  static_configs:\n  - targets: ['127.0.0.1:9100']\n")
    path = _prom(world, mine, "column0.yml")
    r = _monitoring(world, tmp_path, path)
    assert r.rc == 0 and "localhost READY: monitoring" in r.text, r.out[-3000:]
    assert _promtool(path).returncode == 0
    jobs = [j["job_name"] for j in yaml.safe_load(path.read_text())["scrape_configs"]]
    assert sorted(jobs) == ["dcgm-exporter", "node", "runner", "runner-sidecar"]
    assert "\n- job_name: runner-sidecar\n" in path.read_text()


def test_a_config_without_scrape_configs_is_restored_exactly(world, tmp_path: Path) -> None:
    """8: no scrape_configs and promtool failing: the file is put back byte for byte, with one backup; with a
    working promtool the key and runner's jobs arrive in one write, and a rerun changes nothing."""
    mine = "# mine\nglobal:\n  scrape_interval: 15s\n"
    path = _prom(world, mine, "nokey.yml")
    bad = tmp_path / "promtool"
    executable(bad, FAILING_PROMTOOL)
    r = _monitoring(world, tmp_path, path, ev={"monitoring_promtool": str(bad)})
    assert r.rc != 0 and "The previous file was put back" in r.text, r.out[-3000:]
    assert path.read_text() == mine
    assert [b.read_text() for b in _backups(path)] == [mine]
    r = _monitoring(world, tmp_path, path)
    assert r.rc == 0 and "localhost READY: monitoring" in r.text, r.out[-3000:]
    assert _promtool(path).returncode == 0 and path.read_text().startswith(mine)
    assert len(_backups(path)) == 2
    r = _monitoring(world, tmp_path, path)
    assert r.rc == 0 and re.search(r"localhost\s+: ok=\d+\s+changed=0 ", r.out), r.out[-2000:]


def test_a_crlf_config_gets_runners_block_in_crlf(world, tmp_path: Path) -> None:
    """9: CRLF line endings (promtool accepts them): runner adds its block with the same endings."""
    mine = USER_PROM.replace("  - rules.yml\n", "").replace("rule_files:\n", "").replace("\n", "\r\n").encode()
    path = _prom(world, mine, "crlf.yml")
    assert _promtool(path).returncode == 0
    r = _monitoring(world, tmp_path, path)
    assert r.rc == 0 and "localhost READY: monitoring" in r.text, r.out[-3000:]
    data = path.read_bytes()
    assert BEGIN.encode() in data and data.count(b"\n") == data.count(b"\r\n")
    assert _promtool(path).returncode == 0
    assert "runner-sidecar" in [j["job_name"] for j in yaml.safe_load(data)["scrape_configs"]]


def test_a_users_job_inside_runners_block_is_not_dropped(world, tmp_path: Path) -> None:
    """10: a job of the user's inside runner's marked block: the run stops and says so, the job stays."""
    path = _prom(world, USER_PROM.replace("  - rules.yml\n", "").replace("rule_files:\n", ""), "inside.yml")
    r = _monitoring(world, tmp_path, path)
    assert r.rc == 0, r.out[-3000:]
    mine = "  - job_name: my-gpu-box\n    static_configs:\n      - targets: ['10.0.0.9:9100']\n"
    text = path.read_text().replace("  - job_name: runner\n", mine + "  - job_name: runner\n")
    path.write_text(text)
    r = _monitoring(world, tmp_path, path)
    assert r.rc != 0 and "localhost NOT READY: monitoring:" in r.text, r.out[-3000:]
    assert "holds job(s) my-gpu-box that runner did not write" in r.text, r.text
    assert path.read_text() == text
