"""A vLLM-Omni fork's flags asked of its own command at the run's preflight (runner.run.flag_help), for a local
command: a small argparse program stands for the fork's `vllm serve` (its --help is argparse's own, and like a
plain argparse program it refuses vLLM's `--help=all`, so the plain `--help` is asked next). It logs every
invocation, so the tests see that it was asked for its help and never started as a server."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from runner.app import check_flags
from runner.core.errors import UserError
from runner.plan.lanes import make_plan
from runner.plan.matrix import load_matrix
from runner.run import flag_help
from runner.run.pending import pending

ROOT = Path(__file__).resolve().parents[2]

FORK = """
import argparse, json, os, sys
with open(os.environ["FORK_LOG"], "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
ap = argparse.ArgumentParser(prog="vllm serve")
ap.add_argument("model_tag")
ap.add_argument("--omni", action="store_true")
ap.add_argument("--host")
ap.add_argument("--port", type=int)
ap.add_argument("--enable-cpu-offload", action="store_true")
ap.add_argument("--enable-layerwise-offload", action="store_true")
ap.add_argument("--quantization", "-q", choices=["fp8", "int8"])
ap.parse_args()
sys.exit("started as a server")
"""


def matrix(tmp_path: Path, args: str, command: str = '"{python}", "@FORK@"') -> Path:
    (tmp_path / "fork.py").write_text(FORK)
    text = textwrap.dedent(f"""
        [run]
        seeds = [1]
        steps = 1
        results_dir = "{tmp_path / 'results'}"

        [servers.fork]
        command = [{command}, "/weights/model", "--omni", "--host", "{{host}}", "--port", "{{port}}"]
        env = {{ FORK_LOG = "{tmp_path / 'fork.log'}" }}

        [cards.c]
        server = "fork"
        vram_mib = 64

        [flags.default]
        role = "default"
        args = ["--quantization", "fp8"]

        [flags.offload]
        role = "offload"
        args = {args}

        [fixtures.f]
        prompt = "p"
        references = ["{ROOT / 'examples' / 'refs' / 'ref-1.png'}"]
        """).replace("@FORK@", str(tmp_path / "fork.py"))
    path = tmp_path / "m.toml"
    path.write_text(text)
    return path


def run(path: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runner", str(path), "--no-progress"], capture_output=True,
                          text=True, timeout=120, cwd=path.parent,
                          env={**os.environ, "RUNNER_CACHE_DIR": str(cache)})


def test_a_misspelt_flag_of_a_local_fork_stops_the_run_before_anything_starts(tmp_path: Path) -> None:
    """Before: the fork named no release, nothing was checked, and the run started its servers."""
    path = matrix(tmp_path, '["--enable-cpu-offlaod", "--enable-layerwise-offload"]')
    proc = run(path, tmp_path / "cache")
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line == (f"runner: error: {path}: key 'flags.offload.args': --enable-cpu-offlaod is not a flag of "
                    f"`python {tmp_path / 'fork.py'} /weights/model` (its --help on this machine); did you mean "
                    f"--enable-cpu-offload?")
    asked = (tmp_path / "fork.log").read_text().splitlines()
    assert [a.rsplit(", ", 1)[1] for a in asked] == ['"--help=all"]', '"--help"]']  # asked, never started
    assert '"--port", "0"' in asked[0]  # a picked port is written as 0: a value, nothing bound
    assert not (tmp_path / "results").exists()
    # the answer is cached per program: a second run asks nothing and says where the answer came from
    again = run(path, tmp_path / "cache")
    assert again.returncode == 2 and "cached in " + str(tmp_path / "cache") in again.stderr
    assert (tmp_path / "fork.log").read_text().splitlines() == asked
    # a cache file that is not what the runner wrote (edited, truncated) is no answer: the fork is asked again
    (cached,) = (tmp_path / "cache" / "server-flags").glob("*.json")
    cached.write_text(cached.read_text().replace('"--enable-cpu-offload"', '"--enable-cpu-offload\\u001b[2J"'))
    third = run(path, tmp_path / "cache")
    assert third.returncode == 2 and "cached in" not in third.stderr and "\x1b" not in third.stderr
    assert len((tmp_path / "fork.log").read_text().splitlines()) == len(asked) + 2


def test_a_dashless_flag_after_a_flag_that_takes_none_is_refused(tmp_path: Path) -> None:
    """The --help says --enable-cpu-offload takes no value, so the next word is no value of it."""
    path = matrix(tmp_path, '["--enable-cpu-offload", "enable-layerwise-offload"]')
    m = load_matrix(path)
    with pytest.raises(UserError, match=r"'flags.offload.args': enable-layerwise-offload is a flag of `python "
                                        r".*fork.py /weights/model` without its dashes \(its --help on this "
                                        r"machine\); did you mean --enable-layerwise-offload\?"):
        flag_help.check(m, make_plan(m), ["c"])


def test_correct_flags_pass_and_say_nothing(tmp_path: Path) -> None:
    path = matrix(tmp_path, '["--enable-cpu-offload", "-q", "int8"]')
    m = load_matrix(path)
    assert flag_help.check(m, make_plan(m), ["c"]) == []


def test_a_fork_that_cannot_be_asked_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A command not on this machine (a Slurm node's venv, say): the flags are not checked, and one line says
    so and why."""
    path = matrix(tmp_path, '["--enable-cpu-offlaod"]', command='"/nonexistent/venv/bin/vllm", "serve"')
    m = load_matrix(path)
    plan = make_plan(m)
    check_flags(m, plan, pending(plan, (), ()), threading.Event())
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == ("runner: warning: server 'fork' names no vLLM-Omni release and its flag sets are not checked "
                    "against its own --help (card c: /nonexistent/venv/bin/vllm is not on this machine (the "
                    "preflight asks its --help where the runner runs)); a bad flag shows only when the server "
                    "fails to start")


def test_a_help_that_hangs_is_killed_and_said(tmp_path: Path) -> None:
    """A program that ignores --help (it would start serving) is stopped at the deadline, its whole group."""
    (tmp_path / "hang.py").write_text("import os, subprocess, sys, time\n"
                                      f"open({str(tmp_path / 'pids')!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
                                      "child = subprocess.Popen([sys.executable, '-c',\n"
                                      "                          'import time; time.sleep(60)'])\n"
                                      f"open({str(tmp_path / 'pids')!r}, 'a').write(f'{{child.pid}}\\n')\n"
                                      "time.sleep(60)\n")
    path = matrix(tmp_path, '["--enable-cpu-offload"]', command=f'"{{python}}", "{tmp_path / "hang.py"}"')
    m = load_matrix(path)
    (line,) = flag_help.check(m, make_plan(m), ["c"], timeout_s=1)
    assert "card c: `python " in line and "--help=all did not finish within 1 s" in line
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 2
    for pid in pids:  # the program and its child: the whole group was killed
        assert not running(pid), pid


def running(pid: int, wait_s: float = 5.0) -> bool:
    """Whether the process runs (a zombie no longer does: an orphan waits for a reaper that may be slow)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            return False
        time.sleep(0.05)
    return True
