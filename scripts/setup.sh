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
# The reference server needs torch: its CPU build unless --gpu (scripts/torch-cpu.sh says how it is found).
source scripts/torch-cpu.sh
if [ "$gpu" = 1 ]; then
    "${pip[@]}" "torch==$torch_version"
else
    install_cpu_torch .venv
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
