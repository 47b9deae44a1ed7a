#!/usr/bin/env bash
# The steps that turn a venv into the test stand (stand/README.md), written once for both places it is made:
# scripts/omni-stand.sh (a venv on this machine, packages from the index) and docker/omni-stand/ (/opt/venv in the
# image, packages from a wheelhouse made on the host). Extra pip arguments say where the packages come from.
#
#   stand/venv.sh pins VENV [PIP ARGS]         the pinned packages (requirements.txt beside this file), --no-deps
#   stand/venv.sh finish VENV                  torchaudio's CUDA libraries removed; bytecode compiled
#   stand/venv.sh ours VENV [PIP ARGS] SRC...  our platform plugin and the runner package; the import fixes' .pth
#   stand/venv.sh check VENV                   the whole chain imports: vLLM, vLLM-Omni (with the fixes), our platform
#   stand/venv.sh ours-key                     the content hash of what `ours` installs (run from the repository root;
#                                              the sources only: an in-tree build/ copy of them is not content)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
quiet() { grep -v "^WARNING: Location '" || true; }  # pip's notes about configured find-links folders absent here
site() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

step="${1:?usage: stand/venv.sh pins|finish|ours|check|ours-key ...}"
shift
case "$step" in
pins)
    venv="$1"; shift
    # --no-deps from one pin list: the packages that resolve together, without the CUDA-only ones (stand/README.md)
    "$venv/bin/pip" install -q --disable-pip-version-check --no-compile --no-deps -r "$here/requirements.txt" "$@"
    ;;
finish)
    venv="$1"
    # torchaudio 2.11.1 on PyPI is a CUDA build that vllm-omni imports unconditionally: without its compiled
    # libraries its Python side imports (it checks for them), and nothing the stand runs calls them.
    rm -f "$venv"/lib/python3*/site-packages/torchaudio/lib/*.so
    # Bytecode once, on every core: a server start imports thousands of modules, and where PYTHONDONTWRITEBYTECODE
    # is set nothing is written at import.
    "$venv/bin/python" -m compileall -q -j 0 "$(site "$venv")" > /dev/null 2>&1 || true
    ;;
ours)
    venv="$1"; shift
    "$venv/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation --force-reinstall "$@" 2>&1 \
        | quiet
    lib="$(site "$venv")"
    echo "import runner_vllm_omni_cpu.fixes as f; f.install()" > "$lib/runner_vllm_omni_cpu_fixes.pth"
    "$venv/bin/python" -m compileall -q "$lib/runner_vllm_omni_cpu" "$lib/runner" > /dev/null 2>&1 || true
    ;;
check)
    "$1/bin/python" -c "import vllm_omni.entrypoints.cli.main, runner_vllm_omni_cpu.platform"
    ;;
ours-key)
    find stand/plugin/runner_vllm_omni_cpu stand/plugin/pyproject.toml runner pyproject.toml -name '*.py' -o -name '*.toml' -o -name '*.json' | grep -v __pycache__ | LC_ALL=C sort \
        | xargs sha256sum | sha256sum | cut -c1-12
    ;;
*)
    echo "stand/venv.sh: no step $step" >&2
    exit 2
    ;;
esac
