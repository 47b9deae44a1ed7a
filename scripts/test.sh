#!/usr/bin/env bash
# Sets up a fresh machine and runs the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --dev
scripts/services.sh
.venv/bin/ruff check .
.venv/bin/mypy                                # strict on the pure core ([tool.mypy] in pyproject.toml)
# In parallel (pytest-xdist): much of the suite waits on servers, timers and daemons, so two workers per core;
# `loadgroup` keeps the tests that share one costly or exclusive thing on one worker (tests/conftest.py).
.venv/bin/python -m pytest -q -n "$(( 2 * $(nproc) ))" --dist loadgroup --durations=15   # the 15 slowest tests
