"""Flag sets checked against the named vLLM-Omni release's command line (runner.plan.cli_flags), and the
maintainer script that writes the vocabularies (scripts/vllm_omni_flags.py) run on a real wheel."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from runner.core.errors import UserError
from runner.plan import cli_flags
from runner.plan.matrix import load_matrix

ROOT = Path(__file__).resolve().parents[2]
SEED = (ROOT / "matrix.toml").read_text()
NAMED = SEED.replace('image = "runner-vllm-omni:8484d85d1"\n',
                     'image = "runner-vllm-omni:8484d85d1"\nvllm_omni = "0.30.0"\n', 1)


def write(tmp: Path, text: str) -> Path:
    path = tmp / "m.toml"
    path.write_text(text)
    return path


def plan(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runner", "plan", str(path)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_plan_stops_on_a_typo_with_one_line_and_the_nearest_flag(tmp_path: Path) -> None:
    typo = NAMED.replace('args = ["--enable-cpu-offload", "--enable-layerwise-offload"]',
                         'args = ["--enable-cpu-offlaod", "--enable-layerwise-offload"]', 1)
    assert typo != NAMED
    proc = plan(write(tmp_path, typo))
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "'flags.layerwise.args'" in lines[0] and "--enable-cpu-offlaod" in lines[0]
    assert "vLLM-Omni 0.30.0" in lines[0] and lines[0].endswith("did you mean --enable-cpu-offload?")


def test_plan_of_a_correct_matrix_says_nothing_about_flags(tmp_path: Path) -> None:
    proc = plan(write(tmp_path, NAMED))
    assert proc.returncode == 0 and proc.stderr == "" and "session(s)" in proc.stdout


def test_the_seed_matrix_names_no_release_and_is_not_checked(tmp_path: Path) -> None:
    matrix = load_matrix(write(tmp_path, SEED.replace('"--enable-cpu-offload"]', '"--enable-cpu-offlaod"]')),
                         check_files=False)
    cli_flags.check(matrix)  # the fork 8484d85d1 is no release: nothing to check against


def test_the_json_forms_and_vllm_serve_spellings_pass(tmp_path: Path) -> None:
    forms = NAMED.replace('args = ["--quantization", "int8"]', 'args = ["--diffusion-offload-config", '
                          '\'{{"mode": "layer"}}\', "--diffusion-quantization-config", \'{{"method": "fp8"}}\', '
                          '"--max_num_seqs=1", "--no-enforce-eager", "--compilation-config.level", "3", '
                          '"--cache-backend", "tea_cache", "--vae-use-tiling", "--log-stats"]', 1)
    assert forms != NAMED
    cli_flags.check(load_matrix(write(tmp_path, forms), check_files=False))


def test_a_typo_in_the_server_command_is_found_too(tmp_path: Path) -> None:
    bad = NAMED.replace('"--enforce-eager"', '"--enforce-eagre"', 1)
    with pytest.raises(UserError, match=r"'servers.vllm-omni.command': --enforce-eagre .*did you mean --enforce-eager"):
        cli_flags.check(load_matrix(write(tmp_path, bad), check_files=False))


def test_the_release_from_the_image_tag(tmp_path: Path) -> None:
    tagged = SEED.replace('image = "runner-vllm-omni:8484d85d1"', 'image = "vllm/vllm-omni:v0.30.0"', 1)
    bad = tagged.replace('args = ["--quantization", "int8"]', 'args = ["--quantisation", "int8"]', 1)
    with pytest.raises(UserError, match=r"--quantisation is not a flag of vLLM-Omni 0.30.0 "
                                        r"\(servers.vllm-omni.image\); did you mean --quantization\?"):
        cli_flags.check(load_matrix(write(tmp_path, bad), check_files=False))


def test_a_release_without_a_vocabulary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    named = NAMED.replace('vllm_omni = "0.30.0"', 'vllm_omni = "0.9.9"')
    with pytest.raises(UserError, match=r"'servers.vllm-omni.vllm_omni': no flag vocabulary for vLLM-Omni 0.9.9 "
                                        r"\(shipped: 0.30.0"):
        cli_flags.check(load_matrix(write(tmp_path, named), check_files=False))
    tagged = SEED.replace('image = "runner-vllm-omni:8484d85d1"', 'image = "vllm/vllm-omni:v0.9.9"', 1)
    cli_flags.check(load_matrix(write(tmp_path, tagged), check_files=False))  # a tag: a warning, not a stop
    assert "flag sets not checked" in capsys.readouterr().err


def test_the_preflight_of_a_run_stops_before_anything_starts(tmp_path: Path) -> None:
    text = f"""
[run]
seeds = [1]
steps = 1
results_dir = "{tmp_path / 'results'}"

[servers.omni]
command = ["{{python}}", "-m", "runner.refserver", "--port", "{{port}}"]
vllm_omni = "0.30.0"

[cards.c]
server = "omni"
vram_mib = 64

[flags.offload]
role = "offload"
args = ["--enable-cpu-offlaod"]

[fixtures.f]
prompt = "p"
references = ["{ROOT / 'examples' / 'refs' / 'ref-1.png'}"]
"""
    proc = subprocess.run([sys.executable, "-m", "runner", str(write(tmp_path, text)), "--no-progress"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "did you mean --enable-cpu-offload?" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").iterdir())


# --- the maintainer script --------------------------------------------------------------------------------------

def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_omni_flags", ROOT / "scripts" / "vllm_omni_flags.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_parser_reads_literal_and_dataclass_flags_without_running_anything() -> None:
    source = '''
import sys; sys.exit("imported!")  # never run: the parser only reads
class FrontendArgs:
    host: str | None = None
    max_log_len: int = 0
    _private: int = 1
def add(parser, kwargs):
    parser.add_argument("--omni", "-o", action="store_true")
    group.add_argument("model_tag", nargs="?")
    for key, value in kwargs.items():
        group.add_argument(f"--{key.replace('_', '-')}", **value)
'''
    assert script().flags_in_source(source) == {"--omni", "-o", "--host", "--max-log-len"}


def test_the_shipped_vocabularies_name_how_they_were_made() -> None:
    for version in cli_flags.shipped():
        doc = json.loads((cli_flags.VOCAB_DIR / f"{version}.json").read_text())
        assert doc["generated_by"].startswith(f"scripts/vllm_omni_flags.py {version}")
        assert doc["vllm_omni"] == version and len(doc["wheel"]["sha256"]) == 64
        assert {"--enable-cpu-offload", "--diffusion-offload-config"} <= set(doc["flags"]["vllm-omni"])
        assert {"--enforce-eager", "--quantization", "--max-num-seqs"} <= set(doc["flags"]["vllm"])


@pytest.fixture(scope="session")
def wheel_030(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """vLLM-Omni 0.30.0's wheel, fetched once with pip (kept in pytest's cache); skips when the index does not
    answer (an offline machine is no failure of the runner)."""
    cache = getattr(pytestconfig, "cache", None)  # absent under -p no:cacheprovider: a folder of this session
    folder = Path(cache.mkdir("vllm-omni-0.30.0")) if cache else tmp_path_factory.mktemp("vllm-omni-0.30.0")
    cached = sorted(folder.glob("vllm_omni-0.30.0-*.whl"))
    if cached:
        return cached[0]
    try:
        return Path(script().download_wheel("0.30.0", folder, timeout_s=90))
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, FileNotFoundError) as exc:
        why = (getattr(exc, "stderr", "") or str(exc)).strip().splitlines()
        pytest.skip(f"the package index did not give vllm-omni==0.30.0 ({why[-1] if why else exc}): "
                    "the parser was not run on a real wheel")


def test_the_parser_on_the_real_wheel_gives_the_shipped_vocabulary(wheel_030: Path) -> None:
    flags, counts = script().omni_flags(wheel_030)
    shipped = json.loads((cli_flags.VOCAB_DIR / "0.30.0.json").read_text())
    assert sorted(flags) == shipped["flags"]["vllm-omni"]
    assert counts == shipped["wheel"]["modules"]
