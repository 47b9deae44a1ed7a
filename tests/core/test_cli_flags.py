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


def test_plan_of_the_seed_says_in_one_line_that_its_fork_is_checked_at_preflight(tmp_path: Path) -> None:
    """The seed serves the fork 8484d85d1, which names no release: `runner plan` (nothing started) cannot know
    its flags, and said nothing (a typo planned with exit 0 and no word); now one line says where they are
    checked. The run's preflight asks the fork itself (tests/process/test_fork_flags_local.py, tests/docker)."""
    typo = SEED.replace('"--enable-cpu-offload"]', '"--enable-cpu-offlaod"]')
    proc = plan(write(tmp_path, typo))
    assert proc.returncode == 0, proc.stderr
    notes = [ln for ln in proc.stdout.splitlines() if ln.startswith("flags:")]
    assert notes == ["flags: server 'vllm-omni' is vLLM-Omni and image runner-vllm-omni:8484d85d1 names no "
                     "release: its flag sets are checked against the server's own --help at the run's preflight, "
                     "before any server starts"]


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


def test_a_release_without_a_vocabulary(tmp_path: Path) -> None:
    named = NAMED.replace('vllm_omni = "0.30.0"', 'vllm_omni = "0.9.9"')
    with pytest.raises(UserError, match=r"'servers.vllm-omni.vllm_omni': no flag vocabulary for vLLM-Omni 0.9.9 "
                                        r"\(shipped: 0.30.0"):
        cli_flags.check(load_matrix(write(tmp_path, named), check_files=False))
    # a tag: the image itself is asked at preflight, and the plan says so
    tagged = SEED.replace('image = "runner-vllm-omni:8484d85d1"', 'image = "vllm/vllm-omni:v0.9.9"', 1)
    (note,) = cli_flags.check(load_matrix(write(tmp_path, tagged), check_files=False))
    assert "no flag vocabulary for vLLM-Omni 0.9.9 is shipped (shipped: 0.30.0)" in note
    assert note.endswith("checked against the server's own --help at the run's preflight, before any server starts")


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


# --- dash look-alikes (issue 46, V-1) ----------------------------------------------------------------------------

LAYERWISE = 'args = ["--enable-cpu-offload", "--enable-layerwise-offload"]'


@pytest.mark.parametrize(("spelled_as", "what"), [
    ("\u2014enable-cpu-offload", "starts with an em dash (U+2014), not '--'"),  # copied from rendered docs
    ("\u2013enable-cpu-offload", "starts with an en dash (U+2013), not '--'"),
    ("-enable-cpu-offload", "has one dash"),
    ("enable-cpu-offload", "is a flag of vLLM-Omni 0.30.0 without its dashes"),
    ("enable_cpu_offload", "is a flag of vLLM-Omni 0.30.0 without its dashes"),
])
def test_a_flag_with_a_dash_look_alike_is_refused_naming_the_flag_meant(tmp_path: Path, spelled_as: str,
                                                                        what: str) -> None:
    """Each planned with exit 0 and no word: the check read only arguments starting with `--`."""
    bad = NAMED.replace('args = ["--enable-cpu-offload"]\n', f'args = ["{spelled_as}"]\n', 1)
    assert bad != NAMED
    proc = plan(write(tmp_path, bad))
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    (line,) = proc.stderr.strip().splitlines()
    assert "'flags.cpu-offload.args'" in line and spelled_as in line and what in line, line
    assert line.endswith("did you mean --enable-cpu-offload?"), line


def test_a_typographic_dash_is_refused_even_where_the_release_is_not_known(tmp_path: Path) -> None:
    """The fork's flags wait for its --help at preflight, but an em dash is never argparse's."""
    bad = SEED.replace(LAYERWISE, 'args = ["--enable-cpu-offload", "\u2014enable-layerwise-offload"]', 1)
    proc = plan(write(tmp_path, bad))
    assert proc.returncode == 2, proc.stdout
    (line,) = proc.stderr.strip().splitlines()
    assert "'flags.layerwise.args'" in line and line.endswith("did you mean --enable-layerwise-offload?")


@pytest.mark.parametrize("args", [
    '["--quantization", "fp8"]',  # a value, not a flag name
    '["--served-model-name", "host"]',  # a one-word flag name where a value may stand: a value
    '["--seed", "-1"]',  # a negative number
    '["-tp", "1", "-O3"]',  # vLLM's short flags
    '["--enable-cpu-offload", "--cache-backend", "tea_cache"]',
])
def test_values_and_short_flags_pass(tmp_path: Path, args: str) -> None:
    ok = NAMED.replace('args = ["--quantization", "int8"]', f"args = {args}", 1)
    assert ok != NAMED
    assert cli_flags.check(load_matrix(write(tmp_path, ok), check_files=False)) == []


def test_a_dashless_flag_name_after_a_flag_is_refused_when_it_cannot_be_its_value(tmp_path: Path) -> None:
    """A shipped release does not say which flags take a value: a hyphenated flag name after a flag is refused
    (no plausible value), with the `=` spelling for the case it is one; a one-word name may be a value."""
    bad = NAMED.replace(LAYERWISE, 'args = ["--enable-cpu-offload", "enable-layerwise-offload"]', 1)
    with pytest.raises(UserError, match=r"'flags.layerwise.args': enable-layerwise-offload is a flag of vLLM-Omni "
                                        r"0.30.0 without its dashes .*write --enable-cpu-offload="
                                        r"enable-layerwise-offload; did you mean --enable-layerwise-offload\?"):
        cli_flags.check(load_matrix(write(tmp_path, bad), check_files=False))
    # a server command's program and model are positionals, never read as flags
    assert cli_flags.problems(["vllm", "serve", "model", "--omni", "--port", "8000"], cli_flags.vocabulary("0.30.0"),
                              positionals=True) == []


def test_a_help_vocabulary_knows_which_flags_take_a_value() -> None:
    """From a --help the arity is known: a flag name after a flag taking none is refused, after one taking a
    value it is that value."""
    vocab = cli_flags.Vocabulary("x", frozenset({"--host", "--omni", "--served-model-name", "--enable-cpu-offload"}),
                                 "its --help", valued=frozenset({"--host", "--served-model-name"}))
    assert cli_flags.problems(["--served-model-name", "host"], vocab) == []
    (problem,) = cli_flags.problems(["--omni", "host"], vocab)
    assert problem.endswith("did you mean --host?") and "write" not in problem
    # a --help lists every --no-X it takes: none is assumed
    assert cli_flags.problems(["--no-omni"], vocab) == [
        "--no-omni is not a flag of x (its --help); did you mean --omni?"]


# --- the release in an image reference (issue 46, V-2) -----------------------------------------------------------

@pytest.mark.parametrize("image", ["vllm/vllm-omni:v0.30.0@sha256:" + "ab" * 32, "vllm/vllm-omni:0.30.0-cuda12",
                                   "localhost:5000/team/vllm-omni:v0.30.0"])
def test_the_release_of_a_digest_pinned_or_platform_tag(tmp_path: Path, image: str) -> None:
    """A digest after the tag, or a platform build's suffix, hid the release: the flags went unchecked."""
    tagged = SEED.replace('image = "runner-vllm-omni:8484d85d1"', f'image = "{image}"', 1)
    bad = tagged.replace('args = ["--quantization", "int8"]', 'args = ["--quantisation", "int8"]', 1)
    with pytest.raises(UserError, match=r"--quantisation is not a flag of vLLM-Omni 0.30.0 \(servers.vllm-omni."
                                        r"image\); did you mean --quantization\?"):
        cli_flags.check(load_matrix(write(tmp_path, bad), check_files=False))


@pytest.mark.parametrize(("image", "why"), [
    ("vllm/vllm-omni:v0.30.0rc1", "image tag v0.30.0rc1 is a pre-release of 0.30.0, not the release"),
    ("vllm/vllm-omni:0.30.0.post1", "image tag 0.30.0.post1 is a post-release of 0.30.0, not the release"),
    ("vllm/vllm-omni:latest", "image vllm/vllm-omni:latest names no release"),
    ("vllm/vllm-omni@sha256:" + "ab" * 32, "names no release"),
])
def test_an_image_named_like_vllm_omni_without_a_release_is_left_to_its_help(tmp_path: Path, image: str,
                                                                               why: str) -> None:
    """A pre-release may differ from the release in its flags: not checked against 0.30.0's vocabulary, nor
    silently skipped: its own --help decides at preflight, and the plan says so."""
    tagged = SEED.replace('image = "runner-vllm-omni:8484d85d1"', f'image = "{image}"', 1)
    bad = tagged.replace('args = ["--quantization", "int8"]', 'args = ["--quantisation", "int8"]', 1)
    (note,) = cli_flags.check(load_matrix(write(tmp_path, bad), check_files=False))
    assert why in note and "checked against the server's own --help at the run's preflight" in note


def test_a_server_that_is_not_vllm_omni_is_not_asked(tmp_path: Path) -> None:
    """No --omni, no vllm-omni image, no release: an arbitrary program, whose --help may start it."""
    other = SEED.replace('image = "runner-vllm-omni:8484d85d1"', 'image = "team/diffusion:1"', 1) \
        .replace('"--omni",', "", 1)
    assert cli_flags.check(load_matrix(write(tmp_path, other), check_files=False)) == []


# --- reading a --help ------------------------------------------------------------------------------------------

def test_parse_help_reads_argparse_option_lines_only() -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="vllm serve", description="Launch a server.\n\nExamples:\n  vllm serve M --omni",
                                 epilog="   --json-arg '{\"key1\": \"value1\"}'\n   --json-arg.key1 value1",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_tag", nargs="?")
    group = ap.add_argument_group("OmniConfig", "  - a bullet of a group's description")
    group.add_argument("--omni", action="store_true")
    group.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction)
    group.add_argument("-tp", "--tensor-parallel-size", type=int)
    group.add_argument("--quantization", "-q", choices=["fp8", "int8"])
    group.add_argument("--lora-path", nargs="+")
    group.add_argument("--a-very-long-flag-name-whose-help-starts-on-the-next-line", metavar="JSON", help="x")
    flags, valued = cli_flags.parse_help(ap.format_help())
    assert flags == {"-h", "--help", "--omni", "--enforce-eager", "--no-enforce-eager", "-tp",
                     "--tensor-parallel-size", "--quantization", "-q", "--lora-path",
                     "--a-very-long-flag-name-whose-help-starts-on-the-next-line"}
    assert valued == {"-tp", "--tensor-parallel-size", "--quantization", "-q", "--lora-path",
                      "--a-very-long-flag-name-whose-help-starts-on-the-next-line"}
    # Python 3.13's form (the seed's image): the metavar once, after the last option string
    flags, valued = cli_flags.parse_help("options:\n  -tp, --tensor-parallel-size TENSOR_PARALLEL_SIZE\n"
                                         "                        Number of tensor parallel groups.\n"
                                         "  --omni                Enable vLLM-Omni mode\n")
    assert flags == {"-tp", "--tensor-parallel-size", "--omni"} and valued == {"-tp", "--tensor-parallel-size"}
    # a server's --help is untrusted: an option string with control characters never reaches a refusal line
    assert cli_flags.parse_help("  --enable-cpu-offload\x1b[2J\n  --x\x07y Z\n")[0] == frozenset()
    # vLLM's plain --help lists its groups only: no flags (the preflight asks --help=all first)
    groups = ("usage: vllm serve [model_tag] [options]\n\nConfig Groups:\n"
              "  ModelConfig    Configuration for the model.\n")
    assert cli_flags.from_help(groups, "x", "y") is None


def test_the_real_help_of_vllm_omni_0_30_reads_as_the_shipped_vocabulary() -> None:
    """Recorded from the real vLLM-Omni 0.30.0 (tests/core/fixtures/vllm-omni-0.30.0-help-all.txt says how):
    every flag of the shipped vocabulary (read from the wheel's source) is among its option lines, and the
    rest are the --no-X of its boolean flags and -h/--help. Before the metavars of choices were read whole
    ("--config-format ['auto', 'hf', 'mistral']"), four flags went missing and would have been refused."""
    text = (ROOT / "tests" / "core" / "fixtures" / "vllm-omni-0.30.0-help-all.txt").read_text()
    vocab = cli_flags.from_help(text, "vllm serve", "its --help=all")
    shipped = cli_flags.vocabulary("0.30.0")
    assert vocab is not None and shipped is not None and vocab.valued is not None
    assert shipped.flags <= vocab.flags
    assert {f for f in vocab.flags - shipped.flags if not f.startswith("--no-")} == {"-h", "--help"}
    assert {"--quantization", "-q", "-tp", "--config-format", "--diffusion-offload-config",
            "--served-model-name", "--lora-path"} <= vocab.valued
    assert not {"--enable-cpu-offload", "--enable-layerwise-offload", "--enforce-eager", "--no-enforce-eager",
                "--omni"} & vocab.valued
    assert "--json-arg" not in vocab.flags  # the epilog's example, not an option line


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
