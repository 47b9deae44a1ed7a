"""provision.yml the way its user runs it: over real SSH to a GPU host, from a workstation (sshworld.py). The
tests run in file order and share one host: a --check --diff on the fresh host first, then two real runs, then a
changed source. (dcgm-exporter's and the serving image's paths, which build on none of this, are
test_ansible_ssh_images.py's, each on a host of its own.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import run_playbook
from sshworld import USER_PROM, ssh_world

pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.usefixtures("clean_env")]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    yield from ssh_world(tmp_path_factory)

def test_check_diff_on_a_fresh_host_finishes_and_lists_the_changes(world, tmp_path: Path) -> None:
    host = world["host"]
    # This machine's dockerd has no --gpus: check Docker alone here, and let the image build be planned.
    ev = {**world["ev"], "docker_require_nvidia": False, "serving_image_build": True,
          "serving_image_build_dir": str(host.home / ".cache/runner/build/vllm-omni")}
    r = run_playbook(tmp_path, world["inv_one"], "all", ev, check=True, diff=True)
    # A fresh host is not ready, --check or not: what a real run would do is NOT READY, and the run fails.
    summary = "\n".join(r.summary)
    assert r.rc != 0, (r.failures, summary, r.stdout[-3000:])
    assert "rtx3090 READY: preflight, docker, assets" in summary, summary
    assert "rtx3090 NOT READY: meters_sidecar: meters: --check: runner-meter.service on rtx3090 is inactive" in summary
    assert "rtx3090 NOT READY: serving_image: serving_image: --check:" in summary, summary
    assert "localhost NOT READY: monitoring: monitoring: --check:" in summary, summary
    assert "next: this was --check, nothing was changed; to apply: ansible-playbook -i" in summary
    out = r.stdout
    # Every change is listed: the Prometheus block as a diff, the unit file, the archive, venv, systemd, build.
    assert "+# BEGIN runner scrape jobs" in out and "+  - job_name: runner-sidecar" in out
    assert "runner-meter.service" in out and "+ExecStart=" in out
    assert "runner-src.tar" in out
    assert "would install into" in out and "psutil" in out
    assert "would enable and start runner-meter.service" in out
    assert "would build (check mode)" in out
    # ...and nothing was changed.
    assert world["prom"].read_text() == USER_PROM
    assert not list(world["prom"].parent.glob("prometheus.yml.*"))  # no backup: nothing written
    assert not (host.home / ".local/share/runner-meter").exists()
    assert not (host.home / ".config/systemd/user/runner-meter.service").exists()
    assert not (host.home / ".cache/runner").exists()
    assert host.unit_state().get("ActiveState", "") in ("inactive", "")
    assert "Accepted publickey for " + host.user in host_log(world)


def host_log(world) -> str:
    return world["host"].sshd_log.read_text()


def test_real_run_sidecar_up_despite_dcgm_and_an_unreachable_host(world, tmp_path: Path) -> None:
    host = world["host"]
    r = run_playbook(tmp_path, world["inv_all"], "all", world["ev"])
    summary = "\n".join(r.summary)
    # Something required is not ready (no --gpus here, no serving image, rtx5080 off): a non-zero exit...
    assert r.rc != 0, summary
    # ...but every play ran to the summary, which names what is ready and what is not, with the next command.
    assert "rtx3090 READY: preflight, meters_sidecar, assets" in summary, summary
    assert "localhost READY: monitoring" in summary, summary
    assert "rtx5080 NOT READY: reach: unreachable" in summary, summary
    assert "rtx3090 NOT READY: docker:" in summary and "could not select device driver" in summary, summary
    assert "The hook is installed" in summary and "restart docker" in summary  # the stand-in hook is on PATH
    assert "rtx3090 NOT READY: serving_image:" in summary and "is missing" in summary
    assert "one to three hours" in summary and "GiB free" in summary and "-e serving_image_build=true" in summary
    assert "rtx3090 NOT READY (optional): meters_dcgm: meters: dcgm-exporter not started" in summary, summary
    assert "next: fix what the line above says, then: ansible-playbook -i" in summary
    assert "-l rtx3090 --tags docker" in summary

    # The sidecar runs as the user's systemd unit and answers, with psutil in its venv.
    unit = host.unit_state()
    assert unit["ActiveState"] == "active" and int(unit["MainPID"]) > 0
    info = httpx.get(f"http://127.0.0.1:{world['sidecar_port']}/info", timeout=5).json()
    assert info["gpu"]["uuid"] == "GPU-REPLAY-replay"
    assert host.run("~/.local/share/runner-meter/venv/bin/python -c 'import psutil'").returncode == 0
    assert not list((host.home / ".local/share/runner-meter/src").rglob("*.pyc"))
    # No dcgm container was created (--gpus does not work here); no ~/.ansible_async in the user's home.
    ps = subprocess.run(["docker", "ps", "-a", "--filter", f"name={world['ev']['meters_dcgm_container']}", "-q"],
                        capture_output=True, text=True, check=True)
    assert ps.stdout.strip() == ""
    assert not (host.home / ".ansible_async").exists()

    # The user's Prometheus config keeps everything and gains runner's jobs; promtool accepts it; a backup exists.
    prom = world["prom"]
    text = prom.read_text()
    assert text.startswith(USER_PROM.split("scrape_configs:")[0])  # comments, global, alerting, rule_files
    assert "# Prometheus itself" in text
    cfg = yaml.safe_load(text)
    assert cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["127.0.0.1:9093"]
    assert cfg["rule_files"] == ["rules/alerts.yml"] and cfg["global"]["external_labels"] == {"monitor": "desk"}
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) == {"prometheus", "node", "dcgm-exporter", "runner-sidecar", "runner"}
    port = world["sidecar_port"]  # the inventory's hosts, on the port the sidecar was given
    assert jobs["runner-sidecar"]["static_configs"] == [
        {"targets": [f"127.0.0.1:{port}"], "labels": {"card": "rtx3090"}},
        {"targets": [f"127.0.0.1:{port}"], "labels": {"card": "rtx5080"}}]
    assert jobs["runner-sidecar"]["scrape_interval"] == "1s" and jobs["runner-sidecar"]["scrape_timeout"] == "1s"
    check = subprocess.run(["promtool", "check", "config", str(prom)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    backups = list(prom.parent.glob("prometheus.yml.*~"))
    assert len(backups) == 1 and backups[0].read_text() == USER_PROM


def test_second_run_changes_nothing_even_after_bytecode(world, tmp_path: Path) -> None:
    host = world["host"]
    before_pid = host.unit_state()["MainPID"]
    prom_before = world["prom"].read_text()
    # What any `runner` command does to the workstation's runner/: bytecode next to the sources.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(world["src"])], check=True)
    assert list(world["src"].rglob("__pycache__"))
    r = run_playbook(tmp_path, world["inv_all"], "all", world["ev"])
    assert r.changed == 0, r.stdout[-4000:]
    unit = host.unit_state()
    assert (unit["ActiveState"], unit["MainPID"]) == ("active", before_pid)  # not restarted
    assert world["prom"].read_text() == prom_before
    assert len(list(world["prom"].parent.glob("prometheus.yml.*~"))) == 1  # no new backup
    assert "rtx3090 READY: preflight, meters_sidecar, assets" in "\n".join(r.summary)


def test_a_changed_source_restarts_the_sidecar_once(world, tmp_path: Path) -> None:
    host = world["host"]
    before_pid = host.unit_state()["MainPID"]
    (world["src"] / "meters" / "provision_marker.py").write_text("# a changed source tree\n")
    r = run_playbook(tmp_path, world["inv_one"], "meters_sidecar", world["ev"])
    assert r.ok, r.failures
    assert r.changed >= 1
    unit = host.unit_state()
    pid = unit["MainPID"]
    assert unit["ActiveState"] == "active" and pid != before_pid
    assert (host.home / ".local/share/runner-meter/src/runner/meters/provision_marker.py").exists()
    again = run_playbook(tmp_path, world["inv_one"], "meters_sidecar", world["ev"])
    assert again.ok and again.changed == 0 and host.unit_state()["MainPID"] == pid
