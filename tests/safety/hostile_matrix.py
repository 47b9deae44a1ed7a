"""One matrix of hostile servers (hostile.py, one card per mode) for the safety tests."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOSTILE = Path(__file__).with_name("hostile.py")
REF = ROOT / "examples" / "refs" / "ref-1.png"


def hostile_matrix(tmp: Path, name: str, cards: Mapping[str, str], *, request_timeout_s: float = 10,
                   ready_timeout_s: float = 20, token_env: bool = False, script: Path = HOSTILE) -> Path:
    """tmp/matrix.toml: card (and server) NAME -> `script` (hostile.py) --mode MODE, one seed, one reference,
    results under tmp/results; `token_env` passes HF_TOKEN through to the servers (for the masking tests)."""
    env = '\nenv = { HF_TOKEN = "${HF_TOKEN}" }' if token_env else ""
    parts = [f"""
        [run]
        name = "{name}"
        seeds = [1]
        repeats = 1
        determinism_check = false
        restarts = 0
        steps = 2
        size = "64x64"
        request_timeout_s = {request_timeout_s}
        ready_timeout_s = {ready_timeout_s}
        results_dir = "{tmp / 'results'}"

        [flags.default]
        role = "default"

        [fixtures.one]
        prompt = "a cat"
        references = ["{REF}"]

        [matrix]
        references = [1]
        """]
    parts += [textwrap.dedent(f"""
        [servers.{card}]
        command = ["{{python}}", "{script}", "--port", "{{port}}", "--mode", "{mode}"]""") + env + textwrap.dedent(f"""

        [cards.{card}]
        server = "{card}"
        vram_gib = 1
        meters = ["host"]
        """) for card, mode in cards.items()]
    path = tmp / "matrix.toml"
    path.write_text(textwrap.dedent(parts[0]) + "".join(parts[1:]))
    return path
