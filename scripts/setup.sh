#!/usr/bin/env bash
# Creates .venv with runner and the reference server; `--dev` adds the test and lint tools. Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="refserver"
[ "${1:-}" = "--dev" ] && extras="refserver,dev"
python3 -m venv .venv
# torch is pinned so pip takes the CPU build (on this project's machines it lies on local disk) instead of
# pulling a multi-GB CUDA build as a dependency of the `refserver` extra.
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/pip install -q --disable-pip-version-check -e ".[$extras]"
.venv/bin/runner --version
