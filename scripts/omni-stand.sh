#!/usr/bin/env bash
# Sets up the vLLM-Omni test stand (stand/README.md): the released vLLM-Omni 0.30.0 on vLLM's CPU build in a venv of
# its own, our CPU platform plugin with its accounted card, and the tiny Qwen-Image pipelines it serves. A test
# stand, not a way to serve. Cached per machine (RUNNER_STAND_HOME, default ~/.cache/runner/stand): the venv by the
# pin list, so a rerun or a fresh clone on the same machine installs only what changed; `.stand/` in the checkout
# links to it. Safe to rerun. Exit 3 when the package index cannot be reached (the caller decides what that means).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/torch-cpu.sh
home="${RUNNER_STAND_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/runner/stand}"
key="$( (python3 --version; echo "torch $torch_version"; cat stand/requirements.txt) | sha256sum | cut -c1-12)"
venv="$home/vllm-omni-0.30.0-$key"
say() { echo "omni-stand: $*"; }
quiet() { grep -v "^WARNING: Location '" || true; }  # pip's notes about configured find-links folders absent here
mkdir -p "$home"
exec 9>"$home/.lock" && flock 9  # two checkouts setting up at once share one cache

started=$SECONDS
if [ ! -e "$venv/.complete" ]; then
    rm -rf "$venv"
    say "installing vLLM-Omni 0.30.0 (CPU) into $venv"
    python3 -m venv "$venv"
    install_cpu_torch "$venv" 2>&1 | quiet
    # --no-deps from one pin list: the packages that resolve together, without the CUDA-only ones (stand/README.md)
    if ! "$venv/bin/pip" install -q --disable-pip-version-check --no-compile --no-deps -r stand/requirements.txt \
            > "$home/install.log" 2>&1; then
        say "the packages could not be installed (is the package index reachable?): $(quiet < "$home/install.log" | tail -1)"
        rm -rf "$venv"
        exit 3
    fi
    # torchaudio 2.11.1 on PyPI is a CUDA build that vllm-omni imports unconditionally: without its compiled
    # libraries its Python side imports (it checks for them), and nothing the stand runs calls them.
    rm -f "$venv"/lib/python3*/site-packages/torchaudio/lib/*.so
    # Bytecode once, on every core: a server start imports thousands of modules, and where PYTHONDONTWRITEBYTECODE
    # is set nothing is written at import.
    "$venv/bin/python" -m compileall -q -j 0 "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
        > /dev/null 2>&1 || true
    touch "$venv/.complete"
    say "installed in $((SECONDS - started)) s"
fi

# Ours, reinstalled whenever it changes (seconds): the plugin, and the runner package whose tensor ledger it uses.
ours="$(find stand/plugin runner -name '*.py' -o -name '*.toml' -o -name '*.json' | grep -v __pycache__ | sort \
        | xargs sha256sum | sha256sum | cut -c1-12)"
if [ "$(cat "$venv/.ours" 2>/dev/null)" != "$ours" ]; then
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "$venv/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation --force-reinstall \
        ./stand/plugin . 2>&1 | quiet
    echo "import runner_vllm_omni_cpu.fixes as f; f.install()" > "$site/runner_vllm_omni_cpu_fixes.pth"
    "$venv/bin/python" -m compileall -q "$site/runner_vllm_omni_cpu" "$site/runner" > /dev/null 2>&1 || true
    echo "$ours" > "$venv/.ours"
fi

models="$home/models"
"$venv/bin/python" stand/tiny_models.py "$models"

mkdir -p .stand
ln -sfn "$venv" .stand/venv
ln -sfn "$models" .stand/models
# The whole chain imports: vLLM, vLLM-Omni (with the fixes), our platform.
if ! out="$("$venv/bin/python" -c "import vllm_omni.entrypoints.cli.main, runner_vllm_omni_cpu.platform" 2>&1)"; then
    echo "$out" | tail -20
    say "the stand does not import (above)"
    exit 1
fi
say "ready: .stand/venv/bin/vllm-omni, .stand/models/{tiny-qwen-image,tiny-qwen-image-edit-plus} ($((SECONDS - started)) s)"
