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
    if ! stand/venv.sh pins "$venv" > "$home/install.log" 2>&1; then
        say "the packages could not be installed (is the package index reachable?): $(quiet < "$home/install.log" | tail -1)"
        rm -rf "$venv"
        exit 3
    fi
    stand/venv.sh finish "$venv"
    touch "$venv/.complete"
    say "installed in $((SECONDS - started)) s"
fi

# Ours, reinstalled whenever it changes (seconds): the plugin, and the runner package whose tensor ledger it uses.
ours="$(stand/venv.sh ours-key)"
if [ "$(cat "$venv/.ours" 2>/dev/null)" != "$ours" ]; then
    stand/venv.sh ours "$venv" ./stand/plugin .
    echo "$ours" > "$venv/.ours"
fi

models="$home/models"
"$venv/bin/python" stand/tiny_models.py "$models"

mkdir -p .stand
ln -sfn "$venv" .stand/venv
ln -sfn "$models" .stand/models
if ! out="$(stand/venv.sh check "$venv" 2>&1)"; then
    echo "$out" | tail -20
    say "the stand does not import (above)"
    exit 1
fi
say "ready: .stand/venv/bin/vllm-omni, .stand/models/{tiny-qwen-image,tiny-qwen-image-edit-plus} ($((SECONDS - started)) s)"
