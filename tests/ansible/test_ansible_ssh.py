"""provision.yml the way its user runs it: over real SSH to a GPU host, from a workstation.

The GPU host is a throwaway user on this machine behind its own sshd on 127.0.0.1 (sshhost.py), with its own
systemd user manager and the real Docker Engine; a second inventory host points at a closed port and is
unreachable. The workstation is localhost, with a Prometheus config in a temp dir (never /etc/prometheus).
Stand-ins only for what needs a GPU: nvidia-smi and the container hook are scripts, the sidecar replays a
recorded series instead of NVML. The tests run in file order and share one host: a --check --diff on the fresh
host first, then two real runs.
"""

from __future__ import annotations

import shutil
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import ROOT, run_playbook
from sshhost import free_port, skip_reason, ssh_host

pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.usefixtures("clean_env")]

GPU = {"gpu_index": 0, "gpu_name": "NVIDIA GeForce RTX 3090", "gpu_arch": "sm_86", "gpu_vram_gib": 24}

# The user's own Prometheus config: jobs, alerting, rule files (relative, as Debian's are), external labels
# and comments, none of which runner may drop.
USER_PROM = """\
# my workstation's Prometheus (hand-written)
global:
  scrape_interval: 15s
  evaluation_interval: 15s
  external_labels:
    monitor: desk

alerting:
  alertmanagers:
    - static_configs:
        - targets: ["127.0.0.1:9093"]

rule_files:
  - rules/alerts.yml

scrape_configs:
  # Prometheus itself
  - job_name: prometheus
    static_configs:
      - targets: ["127.0.0.1:9090"]

  - job_name: node
    static_configs:
      - targets: ["127.0.0.1:9100"]
"""
RULES = """\
groups:
  - name: desk
    rules:
      - alert: NodeDown
        expr: up{job="node"} == 0
        for: 5m
"""


def _exe(path: Path, text: str, owner: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    shutil.chown(path, owner, owner)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    if shutil.which("promtool") is None:
        pytest.skip("promtool is missing (Debian: apt-get install -y prometheus)")
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        pytest.skip("no Docker Engine answers here")
    d = tmp_path_factory.mktemp("ssh-world")
    with ssh_host(d / "sshd") as host:
        bin_dir = host.home / "bin"
        bin_dir.mkdir()
        shutil.chown(bin_dir, host.user, host.user)
        _exe(bin_dir / "nvidia-smi", """#!/bin/sh
case "$*" in
  *--query-gpu=*) echo "NVIDIA GeForce RTX 3090, 615.71.09, 24576, 8.6, GPU-00000000-0000-0000-0000-fake00003090" ;;
  *--query-compute-apps=*) ;;
  "") echo "| NVIDIA-SMI 615.71.09    Driver Version: 615.71.09    CUDA Version: 13.4 |" ;;
  *) exit 2 ;;
esac
""", host.user)
        # The toolkit's hook on the user's PATH: what the role looks for. dockerd here was not started with it,
        # so the decisive `docker run --gpus all` probe still fails, as it would on a host without the toolkit.
        _exe(bin_dir / "nvidia-container-runtime-hook", "#!/bin/sh\nexit 0\n", host.user)
        replay = host.home / "replay.txt"
        replay.write_text("0 1000000000 1100000000\n0.5 3000000000 3100000000\n1 1000000000 1100000000\n")
        shutil.chown(replay, host.user, host.user)

        # The workstation's runner/ as the sidecar's source, without bytecode (the second run adds some).
        src = d / "ws" / "runner"
        shutil.copytree(ROOT / "runner", src, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        prom = d / "prom" / "prometheus.yml"
        (prom.parent / "rules").mkdir(parents=True)
        prom.write_text(USER_PROM)
        (prom.parent / "rules" / "alerts.yml").write_text(RULES)

        sidecar_port, dcgm_port = free_port(), free_port()
        unreachable = {**host.hostvars(), "ansible_port": free_port()}  # nothing listens there
        inventory = {
            "gpu_hosts": {"vars": {"assets_manifests": [], "assets_files": []},
                          "hosts": {"rtx3090": {**host.hostvars(), **GPU}, "rtx5080": {**unreachable, **GPU}}},
            "monitor": {"hosts": {"localhost": {"ansible_connection": "local",
                                                "ansible_python_interpreter": sys.executable}}},
        }
        inv_all = d / "inventory.yml"
        inv_all.write_text(yaml.safe_dump(inventory))
        inventory["gpu_hosts"]["hosts"].pop("rtx5080")
        inv_one = d / "inventory-reachable.yml"
        inv_one.write_text(yaml.safe_dump(inventory))
        extravars = {
            "preflight_nvidia_smi": str(bin_dir / "nvidia-smi"),
            "docker_nvidia_hook": str(bin_dir / "nvidia-container-runtime-hook"),
            "meters_sidecar_host": "127.0.0.1", "meters_sidecar_port": sidecar_port,
            "meters_sidecar_args": f"--fake-replay {replay} --loop",
            "meters_sidecar_src": str(src),
            "meters_dcgm_port": dcgm_port, "meters_dcgm_container": f"runner-test-dcgm-{uuid.uuid4().hex[:6]}",
            "serving_image_name": f"runner-test/absent:{uuid.uuid4().hex[:6]}", "serving_image_build": False,
            "monitoring_become": False, "monitoring_manage_services": False, "monitoring_install_packages": False,
            "monitoring_prometheus_config": str(prom),
            "monitoring_grafana_provisioning_dir": str(d / "grafana/provisioning"),
            "monitoring_grafana_dashboards_dir": str(d / "grafana/dashboards"),
        }
        yield {"host": host, "d": d, "inv_all": inv_all, "inv_one": inv_one, "ev": extravars, "prom": prom,
               "src": src, "sidecar_port": sidecar_port}
        subprocess.run(["docker", "rm", "--force", extravars["meters_dcgm_container"]], capture_output=True)


def _unit_state(host) -> tuple[str, str]:
    p = host.run("systemctl --user show runner-meter.service --property=ActiveState --property=MainPID")
    props = dict(line.split("=", 1) for line in p.stdout.split())
    return props.get("ActiveState", ""), props.get("MainPID", "")


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
    assert _unit_state(host)[0] in ("inactive", "")
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
    state, pid = _unit_state(host)
    assert state == "active" and int(pid) > 0
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
    before_pid = _unit_state(host)[1]
    prom_before = world["prom"].read_text()
    # What any `runner` command does to the workstation's runner/: bytecode next to the sources.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(world["src"])], check=True)
    assert list(world["src"].rglob("__pycache__"))
    r = run_playbook(tmp_path, world["inv_all"], "all", world["ev"])
    assert r.changed == 0, r.stdout[-4000:]
    assert _unit_state(host) == ("active", before_pid)  # not restarted
    assert world["prom"].read_text() == prom_before
    assert len(list(world["prom"].parent.glob("prometheus.yml.*~"))) == 1  # no new backup
    assert "rtx3090 READY: preflight, meters_sidecar, assets" in "\n".join(r.summary)


def test_a_changed_source_restarts_the_sidecar_once(world, tmp_path: Path) -> None:
    host = world["host"]
    before_pid = _unit_state(host)[1]
    (world["src"] / "meters" / "provision_marker.py").write_text("# a changed source tree\n")
    r = run_playbook(tmp_path, world["inv_one"], "meters_sidecar", world["ev"])
    assert r.ok, r.failures
    assert r.changed >= 1
    state, pid = _unit_state(host)
    assert state == "active" and pid != before_pid
    assert (host.home / ".local/share/runner-meter/src/runner/meters/provision_marker.py").exists()
    again = run_playbook(tmp_path, world["inv_one"], "meters_sidecar", world["ev"])
    assert again.ok and again.changed == 0 and _unit_state(host)[1] == pid


def local_base_image() -> str:
    """An image on the local engine no other test removes: the offline base scripts/services.sh builds. The newest
    tagged image may be a test's short-lived one (test_ansible_runs imports and removes its pinned image while a
    build here used it: a clean-clone failure, 2026-12-03)."""
    base = "runner-base:bookworm"
    if subprocess.run(["docker", "image", "inspect", base], capture_output=True).returncode != 0:
        pytest.skip(f"no {base} image: scripts/services.sh builds it (docker/refserver/build.sh)")
    return base


def test_dcgm_that_cannot_start_leaves_no_container(world, tmp_path: Path) -> None:
    """dcgm-exporter run on its own (the docker step did not say --gpus is unusable): `docker run --gpus all`
    fails here, and the container it created is removed, not left Created with a restart policy."""
    name = world["ev"]["meters_dcgm_container"]
    image, tag = local_base_image().rsplit(":", 1)
    ev = {**world["ev"], "meters_dcgm_image": image, "meters_dcgm_tag": tag}
    r = run_playbook(tmp_path, world["inv_one"], "meters_dcgm", ev)
    summary = "\n".join(r.summary)
    assert r.rc == 0, summary  # optional: not ready, but not a failed run
    assert "rtx3090 NOT READY (optional): meters_dcgm: meters: dcgm-exporter did not start" in summary, summary
    assert "The container was removed" in summary
    ps = subprocess.run(["docker", "ps", "-a", "--filter", f"name={name}", "-q"], capture_output=True, text=True)
    assert ps.stdout.strip() == ""

    # A registry the host cannot reach: the message says how to bring the image over instead.
    ev = {**world["ev"], "meters_dcgm_image": f"127.0.0.1:{free_port()}/dcgm-exporter"}
    r = run_playbook(tmp_path, world["inv_one"], "meters_dcgm", ev)
    summary = "\n".join(r.summary)
    assert "could not pull" in summary and "cannot reach the registry" in summary, summary
    assert "docker save" in summary and "docker load" in summary


def test_serving_image_build_over_ssh_leaves_no_async_files(world, tmp_path: Path) -> None:
    """The build path for real, with a stand-in build context (a one-layer Dockerfile that labels the pins it is
    given; the real one needs CUDA, torch and hours): async over SSH, the image carries the pins, and the async
    job files went to runner's build directory and were removed, not to ~/.ansible_async."""
    host = world["host"]
    base = local_base_image()
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    pins = {"vllm": "VLLM_VERSION", "transformers": "TRANSFORMERS_VERSION", "diffusers": "DIFFUSERS_REF",
            "vllm-omni": "VLLM_OMNI_REF", "python": "PYTHON_VERSION"}
    (ctx / "Dockerfile").write_text(
        f"FROM {base}\nARG {' '.join(pins.values())} TORCH_VERSION TORCH_CUDA\n"
        + "".join(f"LABEL runner.pins.{k}=${v}\n" for k, v in pins.items())
        + "LABEL runner.pins.torch=${TORCH_VERSION}+${TORCH_CUDA}\n")
    name = f"runner-test/serving:{uuid.uuid4().hex[:6]}"
    build_dir = host.home / ".cache/runner/build/vllm-omni"
    ev = {**world["ev"], "serving_image_name": name, "serving_image_build": True,
          "serving_image_context_src": f"{ctx}/", "serving_image_min_free_gib": 0}
    try:
        r = run_playbook(tmp_path, world["inv_one"], "serving_image", ev)
        assert r.ok, (r.failures, r.summary)
        assert "rtx3090 READY: serving_image" in "\n".join(r.summary)
        labels = subprocess.run(["docker", "image", "inspect", "--format", "{{json .Config.Labels}}", name],
                                capture_output=True, text=True, check=True).stdout
        assert '"runner.pins.vllm-omni":"8484d85d1"' in labels
        assert (build_dir / "Dockerfile").exists() and not (build_dir / ".async").exists()
        assert not (host.home / ".ansible_async").exists()
        again = run_playbook(tmp_path, world["inv_one"], "serving_image", ev)
        assert again.ok and again.changed == 0 and "present with the expected pins; no build" in again.stdout
    finally:
        subprocess.run(["docker", "image", "rm", "--force", name], capture_output=True)
