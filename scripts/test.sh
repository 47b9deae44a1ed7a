#!/usr/bin/env bash
# Sets up a fresh machine and runs the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --dev
scripts/services.sh
.venv/bin/ruff check .
.venv/bin/mypy                                # strict on the pure core ([tool.mypy] in pyproject.toml)
.venv/bin/python -m pytest -q --durations=15   # the 15 slowest tests, to keep the suite fast
