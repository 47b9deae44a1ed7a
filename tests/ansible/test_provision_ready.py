"""READY means the host is ready as it is: issue 22's ten cases, each over real SSH to a throwaway user.

The GPU host is sshhost.py's (a new user, its own sshd on 127.0.0.1, its own `systemd --user`, the real Docker
Engine); the workstation is localhost with a Prometheus config in a temp dir. Each case puts the host into the
untidy state a user's machine can be in (another server on the sidecar's port, a run interrupted by a real
SIGINT at a named task, an odd prometheus.yml, an unreadable file, a user outside the docker group) and checks
that the summary says NOT READY, names why and exits non-zero, or says READY only where the host is. The tests
share one host and run in file order.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import ANSIBLE_DIR, PLAYBOOK, ROOT, VENV_BIN
from sshhost import free_port, skip_reason, ssh_host

pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.usefixtures("clean_env")]

GPU = {"gpu_index": 0, "gpu_name": "NVIDIA GeForce RTX 3090", "gpu_arch": "sm_86", "gpu_vram_gib": 24}
UNIT = "runner-meter.service"
BEGIN = "# BEGIN runner scrape jobs"


def _exe(path: Path, text: str, owner: str | None = None) -> None:
    path.write_text(text)
    path.chmod(0o755)
    if owner:
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
    d = tmp_path_factory.mktemp("ready-world")
    with ssh_host(d / "sshd") as host:
        bin_dir = host.home / "bin"
        bin_dir.mkdir()
        shutil.chown(bin_dir, host.user, host.user)
        replay = host.home / "replay.txt"
        replay.write_text("0 1000000000 1100000000\n0.5 3000000000 3100000000\n1 1000000000 1100000000\n")
        shutil.chown(replay, host.user, host.user)
        src = d / "ws" / "runner"
        shutil.copytree(ROOT / "runner", src, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        (d / "prom").mkdir()
        inventory = {
            "gpu_hosts": {"vars": {"assets_manifests": [], "assets_files": []},
                          "hosts": {"rtx3090": {**host.hostvars(), **GPU}}},
            "monitor": {"hosts": {"localhost": {"ansible_connection": "local",
                                                "ansible_python_interpreter": sys.executable}}},
        }
        inv = d / "inventory.yml"
        inv.write_text(yaml.safe_dump(inventory))
        port = free_port()
        extravars = {
            "meters_sidecar_host": "127.0.0.1", "meters_sidecar_port": port,
            "meters_sidecar_args": f"--fake-replay {replay} --loop", "meters_sidecar_src": str(src),
            "monitoring_become": False, "monitoring_manage_services": False, "monitoring_install_packages": False,
            "monitoring_grafana": False, "monitoring_prometheus_config": str(d / "prom" / "prometheus.yml"),
        }
        yield {"host": host, "d": d, "inv": inv, "ev": extravars, "src": src, "port": port}


# --- running the playbook the way its user does: ansible-playbook on the command line ------------------------

def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "ANSIBLE_CONFIG": str(ANSIBLE_DIR / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp"), "ANSIBLE_SSH_CONTROL_PATH_DIR": str(tmp_path / "cp"),
            "ANSIBLE_PYTHON_INTERPRETER": sys.executable, "PYTHONUNBUFFERED": "1",
            "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def _argv(world, tmp_path: Path, args: list[str], ev: dict | None) -> list[str]:
    evfile = tmp_path / f"ev-{len(list(tmp_path.glob('ev-*')))}.json"
    evfile.write_text(json.dumps({**world["ev"], **(ev or {})}))
    return [str(VENV_BIN / "ansible-playbook"), "-i", str(world["inv"]), str(PLAYBOOK), "-e", f"@{evfile}", *args]


class Cli:
    def __init__(self, rc: int, out: str) -> None:
        self.rc, self.out = rc, out
        # The summary task's result as ansible.cfg prints it (YAML): `ok: [host] =>` and then `msg:` with the lines.
        block = out.split("TASK [What is ready, what is not]", 1)
        self.summary = []
        if len(block) > 1:
            result = re.split(r"\n(?:TASK \[|PLAY RECAP)", block[1], maxsplit=1)[0]
            self.summary = (yaml.safe_load(result.split("=>", 1)[1]) or {}).get("msg", [])

    @property
    def text(self) -> str:
        return "\n".join(self.summary)


def cli(world, tmp_path: Path, *args: str, ev: dict | None = None) -> Cli:
    p = subprocess.run(_argv(world, tmp_path, list(args), ev), capture_output=True, text=True, timeout=600,
                       env=_env(tmp_path))
    return Cli(p.returncode, p.stdout + p.stderr)


def interrupt_at(world, tmp_path: Path, task: str, *args: str, ev: dict | None = None) -> str:
    """A real SIGINT to ansible-playbook as soon as it starts `task`, repeated every 0.2 s until it exits.

    To ansible-playbook itself, not its process group: Ctrl-C would also kill the task's own child (promtool),
    failing the task so that its rescue runs before Ansible stops. Repeated: Ansible's handler raises
    KeyboardInterrupt wherever the main thread is, and one raised inside a weakref callback is swallowed
    ("Exception ignored") and the run goes on, as a person pressing Ctrl-C once can see. The callers check the
    state the interruption left before they rely on it."""
    proc = subprocess.Popen(_argv(world, tmp_path, list(args), ev), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_env(tmp_path), start_new_session=True)
    out, hit = [], threading.Event()

    def keep_interrupting() -> None:
        hit.wait()
        while proc.poll() is None:  # not reaped yet: the PID is still this process's
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGINT)
            time.sleep(0.2)

    threading.Thread(target=keep_interrupting, daemon=True).start()
    assert proc.stdout is not None
    for line in proc.stdout:
        out.append(line)
        if not hit.is_set() and line.startswith("TASK [") and task in line:
            hit.set()
    proc.wait(120)
    hit.set()
    text = "".join(out)
    assert any(line.startswith("TASK [") and task in line for line in out), f"never reached {task!r}:\n{text[-3000:]}"
    assert proc.returncode != 0, text[-3000:]
    return text


def unit_state(host) -> dict[str, str]:
    p = host.run(f"systemctl --user show {UNIT} --property=ActiveState --property=MainPID "
                 "--property=UnitFileState --property=NeedDaemonReload")
    return dict(line.split("=", 1) for line in p.stdout.split())


def proc_of(pid: str) -> tuple[list[str], dict[str, str]]:
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    env = dict(e.split(b"=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in e)
    return [a.decode() for a in cmdline if a], {k.decode(): v.decode() for k, v in env.items()}


def unit_build(host) -> str:
    text = (host.home / ".config/systemd/user" / UNIT).read_text()
    return re.search(r"^Environment=RUNNER_METER_BUILD=(\S+)$", text, re.M).group(1)


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


# --- 2: somebody else's server on the sidecar's port ------------------------------------------------------

FOREIGN = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        code = int(sys.argv[2])
        self.send_response(code); self.send_header("Content-Type", "application/json"); self.end_headers()
        self.wfile.write(b"{}")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _serve(port: int, code: int, host, as_user: bool) -> subprocess.Popen:
    """Somebody else's HTTP server on the port: root's, or the sidecar user's own but outside the unit (its
    process is then visible to that user, so it is named by PID and command)."""
    script = host.home / "foreign.py"
    script.write_text(FOREIGN)
    script.chmod(0o644)
    ids = {"user": host.uid, "group": pwd.getpwnam(host.user).pw_gid, "extra_groups": []} if as_user else {}
    proc = subprocess.Popen(["/usr/bin/python3", str(script), str(port), str(code)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, **ids)
    deadline = time.monotonic() + 10
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/info", timeout=1)
            return proc
        except httpx.HTTPError:
            assert proc.poll() is None and time.monotonic() < deadline, "the foreign server did not start"
            time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(10)


def test_a_foreign_server_on_the_sidecar_port_is_named_and_nothing_loops(world, tmp_path: Path) -> None:
    host, port = world["host"], world["port"]
    for code, as_user in ((200, False), (404, True)):
        foreign = _serve(port, code, host, as_user)
        try:
            r = cli(world, tmp_path, "--tags", "meters_sidecar")  # no -l: only this item is under test
        finally:
            _stop(foreign)
        assert r.rc != 0, r.out[-3000:]
        assert "rtx3090 NOT READY: meters_sidecar:" in r.text, r.out[-3000:]
        assert f"port {port} on 127.0.0.1 (rtx3090) is not runner-meter's" in r.text, r.text
        if not as_user:
            assert "a process of user root (uid 0)" in r.text, r.text
        else:
            assert "foreign.py" in r.text and f"of user {host.user}" in r.text, r.text
        # Left stopped and disabled, not restarting every 5 s.
        time.sleep(6)
        state = unit_state(host)
        assert state["ActiveState"] in ("inactive", "failed") and state["MainPID"] == "0", state
        assert state["UnitFileState"] == "disabled", state
    # The port free again: READY, and /info comes from the unit's own process.
    r = cli(world, tmp_path, "-l", "rtx3090", "--tags", "meters_sidecar")
    assert r.rc == 0 and "rtx3090 READY: meters_sidecar" in r.text, r.out[-3000:]
    state = unit_state(host)
    assert state["ActiveState"] == "active" and int(state["MainPID"]) > 0
    assert httpx.get(f"http://127.0.0.1:{port}/info", timeout=5).json()["gpu"]["uuid"] == "GPU-REPLAY-replay"
    # ...and a run with --check changes nothing and says READY too: the host is as it should be.
    r = cli(world, tmp_path, "-l", "rtx3090", "--tags", "meters_sidecar", "--check")
    assert r.rc == 0 and "rtx3090 READY: meters_sidecar" in r.text, r.out[-3000:]
    assert unit_state(host)["MainPID"] == state["MainPID"]


# --- 3: interrupted runs ------------------------------------------------------------------------------------

def _sidecar_running(world, tmp_path: Path) -> dict[str, str]:
    """The sidecar as a plain run leaves it (started here if an earlier test left none)."""
    state = unit_state(world["host"])
    if state["ActiveState"] != "active":
        r = cli(world, tmp_path, "-l", "rtx3090", "--tags", "meters_sidecar")
        state = unit_state(world["host"])
        assert state["ActiveState"] == "active", (state, r.out[-3000:])
    return state


def test_new_code_runs_after_a_run_interrupted_before_the_restart(world, tmp_path: Path) -> None:
    host = world["host"]
    before = _sidecar_running(world, tmp_path)
    assert before["ActiveState"] == "active", before
    (world["src"] / "meters" / "interrupted_marker.py").write_text("# new code, shipped by an interrupted run\n")
    interrupt_at(world, tmp_path, "Create the sidecar's venv", "-l", "rtx3090", "--tags", "meters_sidecar")
    # The interruption came after the new code was unpacked and before any restart: the old process still runs.
    assert (host.home / ".local/share/runner-meter/src/runner/meters/interrupted_marker.py").exists()
    assert unit_state(host)["MainPID"] == before["MainPID"]

    r = cli(world, tmp_path, "-l", "rtx3090", "--tags", "meters_sidecar")
    # What runs first (the point of the item), then what the run says.
    after = unit_state(host)
    assert after["ActiveState"] == "active" and after["MainPID"] != before["MainPID"], (before, after, r.out[-3000:])
    assert proc_of(after["MainPID"])[1]["RUNNER_METER_BUILD"] == unit_build(host)
    assert r.rc == 0 and "rtx3090 READY: meters_sidecar" in r.text, r.out[-3000:]


def test_a_new_unit_runs_after_a_run_interrupted_at_the_restart(world, tmp_path: Path) -> None:
    host = world["host"]
    before = _sidecar_running(world, tmp_path)
    assert "--hz" in proc_of(before["MainPID"])[0] and "500" in proc_of(before["MainPID"])[0]
    out = interrupt_at(world, tmp_path, "Enable and start the user unit", "-l", "rtx3090", "--tags", "meters_sidecar",
                       ev={"meters_sidecar_hz": 250})
    # The unit file says 250, the process still runs with 500: the restart never happened.
    assert "--hz 250" in (host.home / ".config/systemd/user" / UNIT).read_text(), out[-2000:]
    argv = proc_of(unit_state(host)["MainPID"])[0]
    assert argv[argv.index("--hz") + 1] == "500"

    r = cli(world, tmp_path, "-l", "rtx3090", "--tags", "meters_sidecar", ev={"meters_sidecar_hz": 250})
    state = unit_state(host)
    argv = proc_of(state["MainPID"])[0]
    assert argv[argv.index("--hz") + 1] == "250" and state["NeedDaemonReload"] == "no", (argv, state, r.out[-3000:])
    assert r.rc == 0 and "rtx3090 READY: meters_sidecar" in r.text, r.out[-3000:]
    # And back to the default, so a rerun of the module starts from a plain sidecar.
    r = cli(world, tmp_path, "-l", "rtx3090", "--tags", "meters_sidecar")
    assert r.rc == 0, r.out[-3000:]


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
    _exe(slow, f'#!/bin/sh\n[ "$1" = --version ] || sleep 20\nexec {shutil.which("promtool")} "$@"\n')
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
    _exe(bad, FAILING_PROMTOOL)
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
    _exe(bad, FAILING_PROMTOOL)
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
