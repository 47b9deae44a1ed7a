"""Static checks of the image recipes (no engine needed; hadolint is not available here).

The vLLM-Omni image cannot be built on this machine, so its Dockerfile is parsed and held to the seed's
pins, to its build script's defaults, and to "no weights inside"."""

from __future__ import annotations

import ast
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from runner.plan.matrix import load_matrix

ROOT = Path(__file__).resolve().parents[2]
VLLM = ROOT / "docker" / "vllm-omni"
REFSERVER = ROOT / "docker" / "refserver"

SEED_PINS = {  # the seed's validated recipe (issue #1, used unchanged by issue #2)
    "PYTHON_VERSION": "3.13",
    "VLLM_VERSION": "0.31.0",
    "TORCH_VERSION": "2.13.0",
    "TORCH_CUDA": "cu130",
    "TRANSFORMERS_VERSION": "5.14.1",
    "DIFFUSERS_REF": "122b1e11",
    "VLLM_OMNI_REF": "8484d85d1",
}
INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
                "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or (line.startswith("#") and not pending):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        pending += (" " if pending else "") + line.removesuffix("\\").strip()
        if not line.endswith("\\"):
            word, _, rest = pending.partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    assert not pending, f"{path}: dangling line continuation"
    return out


def arg_defaults(items: list[tuple[str, str]]) -> dict[str, str]:
    return dict(rest.split("=", 1) for word, rest in items if word == "ARG" and "=" in rest)


def script_defaults(path: Path) -> dict[str, str]:
    return dict(re.findall(r'^([A-Z_]+)="\$\{\1:-([^}]*)\}"', path.read_text(), re.M))


@pytest.fixture(scope="module")
def vllm() -> list[tuple[str, str]]:
    return instructions(VLLM / "Dockerfile")


def test_vllm_dockerfile_is_well_formed(vllm):
    assert vllm[0][0] in ("ARG", "FROM")
    unknown = {w for w, _ in vllm} - INSTRUCTIONS
    assert not unknown, f"unknown instructions {unknown}"
    for word, rest in vllm:
        if word in ("ENTRYPOINT", "CMD"):
            assert isinstance(json.loads(rest), list), f"{word} must use the exec form"
        if word == "RUN" and "apt-get install" in rest:
            assert "rm -rf /var/lib/apt/lists" in rest and "--no-install-recommends" in rest
    ast.parse((VLLM / "check_pins.py").read_text())


def test_vllm_pins_match_the_seed(vllm):
    args = arg_defaults(vllm)
    for key, value in SEED_PINS.items():
        assert args.get(key) == value, f"ARG {key}={args.get(key)}, seed pins {value}"
    base = args["CUDA_IMAGE"]
    assert re.fullmatch(r"nvidia/cuda:13\.\d+\.\d+-[a-z-]+-ubuntu\d+\.\d+", base), base
    froms = [rest for word, rest in vllm if word == "FROM"]
    assert froms == ["${CUDA_IMAGE}"]


def test_vllm_install_steps_follow_the_recipe(vllm):
    runs = " ;; ".join(rest for word, rest in vllm if word == "RUN")
    assert '"torch==${TORCH_VERSION}+${TORCH_CUDA}"' in runs
    assert "download.pytorch.org/whl/${TORCH_CUDA}" in runs
    assert '"vllm==${VLLM_VERSION}"' in runs and '"transformers==${TRANSFORMERS_VERSION}"' in runs
    assert 'python${PYTHON_VERSION}" -m venv /opt/venv' in runs
    assert 'checkout --detach "$DIFFUSERS_REF"' in runs and "pip install -c /opt/constraints.txt /opt/diffusers" in runs
    assert 'checkout --detach "$VLLM_OMNI_REF"' in runs and "pip install --no-deps -e /opt/vllm-omni" in runs
    # requirements/common.txt goes in without its diffusers line, so the git pin stays.
    assert "requirements/common.txt > /opt/common-no-diffusers.txt" in runs
    assert "-r /opt/common-no-diffusers.txt" in runs
    grep = re.search(r"grep -viE '([^']+)'", runs)
    assert grep
    pattern = re.compile(grep.group(1).replace("[[:space:]]", r"\s"), re.I)
    assert pattern.search("diffusers==0.36.0") and pattern.search("diffusers>=0.35")
    assert not pattern.search("diffusers-extra==1") and not pattern.search("transformers==5.14.1")
    # Every pip install after the first is held by the constraints (or installs no deps at all).
    for cmd in re.split(r"&&|;;", runs):
        torch_only = "--index-url" in cmd.replace("--extra-index-url", "")  # the first: torch alone
        if "pip install" in cmd and "--upgrade pip" not in cmd and not torch_only:
            assert "-c /opt/constraints.txt" in cmd or "--no-deps" in cmd, cmd


def test_vllm_runs_offline_with_vllm_serve_and_no_weights_inside(vllm):
    env = " ".join(rest for word, rest in vllm if word == "ENV")
    assert "HF_HUB_OFFLINE=1" in env
    assert [json.loads(rest) for word, rest in vllm if word == "ENTRYPOINT"] == [["vllm", "serve"]]
    copied = [shlex.split(rest) for word, rest in vllm if word in ("COPY", "ADD")]
    assert copied == [["check_pins.py", "/opt/check_pins.py"]], copied
    assert not [w for w, _ in vllm if w == "VOLUME"]
    text = (VLLM / "Dockerfile").read_text() + (VLLM / "build.sh").read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    for baked in ("huggingface-cli", "hf download", "snapshot_download", "from_pretrained", ".safetensors",
                  "Qwen/", "git lfs", "/weights"):
        assert baked not in code, f"weights must be mounted at run time, found {baked!r}"
    ignore = (VLLM / ".dockerignore").read_text().split()
    assert ignore[0] == "*" and set(ignore[1:]) == {"!Dockerfile", "!check_pins.py"}


def test_vllm_build_script_passes_every_pin(vllm):
    args = arg_defaults(vllm)
    script = (VLLM / "build.sh").read_text()
    defaults = script_defaults(VLLM / "build.sh")
    for key, value in args.items():
        assert defaults.get(key) == value, f"build.sh default {key}={defaults.get(key)} != Dockerfile {value}"
        assert f'--build-arg "{key}=${key}"' in script, f"build.sh does not pass {key}"


def test_refserver_image_installs_from_the_wheelhouse_only():
    items = instructions(REFSERVER / "Dockerfile")
    for word, rest in items:
        if word == "RUN" and "pip install" in rest:
            assert "--no-index" in rest, rest
    assert arg_defaults(items)["BASE"] == "runner-base:bookworm"
    assert "wheelhouse/" in (REFSERVER / ".gitignore").read_text().split()


def test_local_docker_example_mirrors_local():
    """examples/local-docker.toml is examples/local.toml with every card in a container."""
    docker_m = load_matrix(ROOT / "examples" / "local-docker.toml")
    assert {c.backend for c in docker_m.cards.values()} == {"docker"}
    profile = docker_m.servers["refserver"]
    assert profile.image == "runner-refserver:dev" and profile.port == 8000
    assert profile.command[:3] == ("python", "-m", "runner.refserver") and "{host}" in profile.command
    local_path = ROOT / "examples" / "local.toml"
    if not local_path.exists():
        pytest.skip("examples/local.toml not present")
    local_m = load_matrix(local_path)
    assert {n: c.vram_gib for n, c in local_m.cards.items()} == {n: c.vram_gib for n, c in docker_m.cards.items()}
    assert local_m.flags == docker_m.flags and local_m.fixtures == docker_m.fixtures
    assert local_m.axes == docker_m.axes and local_m.verdict == docker_m.verdict
    assert local_m.baseline == docker_m.baseline
    local_raw = tomllib.loads(local_path.read_text())["servers"]["refserver"]["command"]
    assert [a for a in local_raw if a != "{python}"] == list(profile.command[1:])
