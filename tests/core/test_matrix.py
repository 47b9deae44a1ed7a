"""matrix.toml validation: every bad input is one line naming file, key and value; exit code 2."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from runner.backends.base import Attempt
from runner.backends.local import LocalServer
from runner.core.errors import UserError
from runner.plan.lanes import describe, make_plan
from runner.plan.matrix import load_matrix


def edit(d: Path, old: str, new: str) -> Path:
    path = d / "matrix.toml"
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))
    return path


def test_minimal_matrix_loads_with_defaults(matrix_dir: Path) -> None:
    m = load_matrix(matrix_dir / "matrix.toml")
    assert m.run.seeds == (1, 2) and m.run.size == (64, 64) and m.run.steps == 4
    assert m.axes.cards == ("small",) and m.axes.flags == ("default", "host-cache")
    assert m.fixtures["pair"].references[0] == (matrix_dir / "refs" / "a.png").resolve()
    assert m.cards["small"].meters == ("server", "host")
    assert m.verdict.target_references == 2
    assert len(m.sha256) == 64


@pytest.mark.parametrize(("old", "new", "expected"), [
    ('steps = 4', 'steps = "4"', "key 'run.steps' must be an integer, got '4'"),
    ('steps = 4', 'steps = true', "key 'run.steps' must be an integer, got True"),
    ('steps = 4', 'stepz = 4', "unknown key 'run.stepz'"),
    ('size = "64x64"', 'size = "64by64"', "key 'run.size' must look like '1024x1024'"),
    ('server = "ref"', 'server = "nope"', "key 'cards.small.server' names unknown server profile 'nope'"),
    ('vram_gib = 0.5', 'vram_gib = -1', "key 'cards.small.vram_gib' must be > 0, got -1"),
    ('role = "offload"', 'role = "turbo"', "key 'flags.host-cache.role' must be one of"),
    ('references = [1, 2]', 'references = [1, 2]\ncards = ["big"]', "key 'matrix.cards' names unknown card 'big'"),
    ('references = [1, 2]', 'references = [1, 2]\nflags = ["x"]', "key 'matrix.flags' names unknown flag set 'x'"),
    ('references = [1, 2]', 'references = [1, 2, 3]', "key 'fixtures.pair.references' holds 2 image(s)"),
    ('"--port", "{port}"', '"--port", "{prot}"', "uses unknown placeholder {prot}"),
    ('[run]', '[run\n', "TOML syntax error"),
    ('"refs/b.png"', '"refs/missing.png"', "key 'fixtures.pair.references[1]': reference image not found"),
    # declared models (issue 16): strict TOML types, both bounds named, derived keys not settable
    ('vram_gib = 0.5', 'vram_gib = true', "key 'cards.small.vram_gib' must be a number, got True"),
    ('seeds = [1, 2]', 'seeds = [1, "2"]', "key 'run.seeds[1]' must be an integer, got '2'"),
    ('steps = 4', 'steps = 4\nsample_hz = 1e-300', "key 'run.sample_hz' must be between 0.1 and 1000, got 1e-300"),
    ('steps = 4', 'steps = 4\nrequest_timeout_s = 0', "key 'run.request_timeout_s' must be > 0 and <= 604800, got 0"),
    ('vram_gib = 0.5', 'vram_gib = 0.5\nname = "other"', "unknown key 'cards.small.name'"),
    ('vram_gib = 0.5', 'vram_gib = 0.5\noptions = {}', "unknown key 'cards.small.options'"),
    ('vram_gib = 0.5', 'vram_gib = 0.5\nvram_mib = 512', "key 'cards.small.vram_gib' is required (or vram_mib), "
                                                       "exactly one of the two"),
    ('[matrix]', '[verdict]\nlatency_looks = 3\n\n[matrix]', "unknown key 'verdict.latency_looks'"),
    ('[matrix]', '[baseline]\n\n[matrix]', "[baseline] needs exactly one of 'dir' or 'cell'"),
    ('[matrix]', '[baseline]\ncell = "small/nope"\n\n[matrix]', "key 'baseline.cell' must be 'CARD/FLAGS'"),
    ('command = [', 'command = 3\nx = [', "key 'servers.ref.command' must be a list, got 3"),
    ('[cards.small]', '[cards.small]\ndocker_host = "ssh://h"', "key 'cards.small.docker_host' applies to "
                                                             "backend 'docker' only"),
    # issue 30 M-4: a capacity that rounds to nothing (or beyond any device) is refused at load
    ('vram_gib = 0.5', 'vram_mib = 0.0000001', "key 'cards.small.vram_mib' must be a device's capacity, at least "
                                               "1 MiB and below 1 PiB, got 1e-07"),
    ('vram_gib = 0.5', 'vram_gib = 1e30', "key 'cards.small.vram_gib' must be a device's capacity, at least "
                                          "1 MiB and below 1 PiB, got 1e+30"),
])
def test_bad_input_is_one_clear_line(matrix_dir: Path, old: str, new: str, expected: str) -> None:
    path = edit(matrix_dir, old, new)
    with pytest.raises(UserError) as info:
        load_matrix(path)
    message = str(info.value)
    assert expected in message
    assert str(path) in message
    assert "\n" not in message


def test_empty_matrix_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "m.toml").write_text('[run]\nname = "x"\n')
    with pytest.raises(UserError, match="the matrix is empty: no cards"):
        load_matrix(tmp_path / "m.toml")


def test_missing_baseline_file(matrix_dir: Path) -> None:
    path = edit(matrix_dir, "[matrix]", '[baseline]\ndir = "sealed"\n\n[matrix]')
    with pytest.raises(UserError, match=r"key 'baseline.dir': baseline file not found: .*sealed/samples\.json"):
        load_matrix(path)


def test_cli_bad_input_exit_2_no_traceback(matrix_dir: Path) -> None:
    path = edit(matrix_dir, 'steps = 4', 'steps = "many"')
    proc = subprocess.run([sys.executable, "-m", "runner", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "run.steps" in lines[0] and "'many'" in lines[0]


def test_cli_missing_matrix_file(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "runner", str(tmp_path / "none.toml")], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "cannot read matrix" in proc.stderr and "Traceback" not in proc.stderr


def test_plan_orders_steps_and_puts_baseline_cell_first(matrix_dir: Path) -> None:
    path = edit(matrix_dir, "[matrix]", '[baseline]\ncell = "small/host-cache"\n\n[matrix]')
    m = load_matrix(path)
    plan = make_plan(m)
    assert [s.flags for s in plan.sessions] == ["host-cache", "default"]
    steps = plan.sessions[0].steps
    assert [(s.references, s.seed) for s in steps] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert steps[0].key == "small/host-cache/refs-1/pair-seed-1"
    text = describe(plan, m)
    assert "2 session(s), 8 step(s) × 1 timed send (repeats = auto: up to 8 where" in text
    assert "--cond-cache host" in text


def test_plan_renders_each_sessions_full_server_command_and_masked_env(matrix_dir: Path) -> None:
    path = edit(matrix_dir, 'args = ["--cond-cache", "host"]',
                'args = ["--cond-cache", "host"]\nenv = {HF_TOKEN = "hf_secret123", CACHE_DIR = "/c/{card}"}')
    m = load_matrix(path)
    session = make_plan(m).sessions[1]
    assert session.server is not None and session.server.backend == "local" and session.server.profile.port == 0
    assert session.server.argv == (sys.executable, "-m", "runner.refserver", "--port", "{port}", "--vram-gib",
                                   "0.5", "--cond-cache", "host")
    assert session.server.env == {"HF_TOKEN": "hf_secret123", "CACHE_DIR": "/c/small"}
    assert session.server.labels["runner.flags"] == "host-cache"
    argv, env = LocalServer(session.server, Attempt("t", matrix_dir / "server.log")).command(41234)
    assert argv[4] == "41234" and env["CACHE_DIR"] == "/c/small"
    proc = subprocess.run([sys.executable, "-m", "runner", "plan", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert f"{sys.executable} -m runner.refserver --port '{{port}}' --vram-gib 0.5 --cond-cache host" in proc.stdout
    assert "env HF_TOKEN=*** CACHE_DIR=/c/small" in proc.stdout and "hf_secret123" not in proc.stdout
    assert "a free port picked at each start" in proc.stdout


def test_exclude_removes_sessions(matrix_dir: Path) -> None:
    path = edit(matrix_dir, "references = [1, 2]",
                'references = [1, 2]\nexclude = [{card = "small", flags = "default"}]')
    plan = make_plan(load_matrix(path))
    assert [s.flags for s in plan.sessions] == ["host-cache"]


def test_shipped_matrices_are_valid() -> None:
    root = Path(__file__).resolve().parents[2]
    for path in [root / "matrix.toml", *sorted((root / "examples").glob("*.toml"))]:
        m = load_matrix(path, check_files=False)
        assert make_plan(m).steps, path


def test_cards_on_one_gpu_share_a_lane(matrix_dir: Path) -> None:
    path = edit(matrix_dir, "vram_gib = 0.5", 'vram_gib = 0.5\ngpu = "0"\n\n[cards.other]\nserver = "ref"\n'
                                              'vram_mib = 300\ngpu = 0')
    plan = make_plan(load_matrix(path))
    assert len(plan.lanes) == 1 and plan.lanes[0].cards == ("small", "other")
    assert [s.card for s in plan.lanes[0].sessions] == ["small", "small", "other", "other"]
    assert "share this device" in describe(plan, load_matrix(path))


def test_baseline_cell_per_card(matrix_dir: Path) -> None:
    path = edit(matrix_dir, "[matrix]", '[baseline]\ncell = "host-cache"\n\n[matrix]')
    m = load_matrix(path)
    assert m.baseline.cell == (None, "host-cache")
    assert [s.flags for s in make_plan(m).sessions] == ["host-cache", "default"]
    assert "each card's own 'host-cache'" in describe(make_plan(m), m)


def test_remote_docker_card_must_publish_where_the_runner_can_reach(matrix_dir: Path) -> None:
    path = edit(matrix_dir, 'command = ["{python}"', 'image = "img:1"\ncommand = ["{python}"')
    path = edit(matrix_dir, 'vram_gib = 0.5', 'vram_gib = 0.5\nbackend = "docker"\ndocker_host = "ssh://u@10.0.0.9"')
    with pytest.raises(UserError, match=re.escape("key 'cards.small.publish_host' is '127.0.0.1' but docker_host")):
        load_matrix(path)


@pytest.mark.parametrize(("value", "problem"), [
    ('"lots"', 'must be a size such as "512m" or "4g" (b, k, m, g), or a number of bytes, got \'lots\''),
    ('"1m"', "must be at least 6m (the engine's smallest memory limit), got '1m'"),
    ("true", 'must be a size such as "512m"'),
])
def test_docker_mem_limit_is_checked_at_load_in_one_line(matrix_dir: Path, value: str, problem: str) -> None:
    path = edit(matrix_dir, 'command = ["{python}"', 'image = "img:1"\ncommand = ["{python}"')
    path = edit(matrix_dir, 'vram_gib = 0.5', f'vram_gib = 0.5\nbackend = "docker"\nmem_limit = {value}')
    with pytest.raises(UserError, match=re.escape(f"key 'cards.small.mem_limit' {problem}")) as info:
        load_matrix(path)
    assert "\n" not in str(info.value)


def test_docker_mem_limit_in_dockers_notation_or_bytes(matrix_dir: Path) -> None:
    path = edit(matrix_dir, 'command = ["{python}"', 'image = "img:1"\ncommand = ["{python}"')
    path = edit(matrix_dir, 'vram_gib = 0.5', 'vram_gib = 0.5\nbackend = "docker"\nmem_limit = "1.5g"')
    m = load_matrix(path)
    assert m.cards["small"].options.mem_limit == 1536 * 2**20
    assert "host memory limited to 1536 MiB" in describe(make_plan(m), m)
    path = edit(matrix_dir, 'mem_limit = "1.5g"', "mem_limit = 268435456")
    assert load_matrix(path).cards["small"].options.mem_limit == 256 * 2**20
