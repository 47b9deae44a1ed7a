#!/usr/bin/env bash
# Creates .venv with runner and the reference server; `--dev` adds the test and lint tools, `--gpu` takes
# PyPI's default (CUDA) torch instead of the CPU build. Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="refserver"
gpu=0
for arg in "$@"; do
    case "$arg" in
        --dev) extras="refserver,dev" ;;
        --gpu) gpu=1 ;;
        *) echo "setup.sh: unknown option $arg (use --dev, --gpu)" >&2; exit 2 ;;
    esac
done
python3 -m venv .venv
# --no-compile: the bytecode is made below, on every core (pip compiles one file at a time: half of setup on 2 cores).
pip=(.venv/bin/pip install -q --disable-pip-version-check --no-compile)
# The reference server needs torch, and on Linux PyPI's torch is a multi-GB CUDA build. Without --gpu the CPU
# build is installed first (the `refserver` extra then keeps it): from PyTorch's CPU index when it answers
# within seconds, else torch==2.13.0 from the configured sources (a local CPU wheel where a machine keeps one;
# plain PyPI has no CPU build for Linux, so there pip falls back to the CUDA one, with a warning below).
torch_version="2.13.0"
cpu_index="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
if [ "$gpu" = 1 ]; then
    "${pip[@]}" "torch==$torch_version"
elif .venv/bin/python -c "import torch" 2>/dev/null; then
    :  # keep whatever torch is already there (rerun, or one installed by hand for this machine's CUDA)
elif .venv/bin/python -c "import urllib.request as u; u.urlopen('$cpu_index/torch/', timeout=5)" 2>/dev/null \
    && "${pip[@]}" --timeout 15 --retries 1 --extra-index-url "$cpu_index" "torch==$torch_version"; then
    :  # the index's 2.13.0+cpu sorts above the configured index's 2.13.0, so pip takes the CPU build
else
    "${pip[@]}" "torch==$torch_version"
fi
"${pip[@]}" -e ".[$extras]"
# Bytecode for every installed module and runner's own source. Where PYTHONDONTWRITEBYTECODE is set (as on CI
# machines) nothing is written at import, so without it every process would compile again what it imports:
# about 0.7 CPU-s per runner or server process. Errors are pip's to ignore too (torch ships a file in Python
# 3.12 syntax among its test helpers); the imports below and the run would fail on a file that matters.
.venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    runner > /dev/null || true
GPU="$gpu" .venv/bin/python - <<'EOF'
import os

import torch

cuda = torch.version.cuda
print(f"setup: torch {torch.__version__} ({'CUDA ' + cuda if cuda else 'CPU build'})")
if cuda and os.environ["GPU"] != "1":
    print("setup: warning: no CPU build of torch was reachable (PyTorch's CPU index, a local wheel), so pip took "
          "PyPI's CUDA build; the reference server runs on the CPU with it all the same")
EOF
.venv/bin/runner --version
