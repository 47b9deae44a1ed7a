"""The shipped 0.30.0 flag vocabulary (runner/plan/vllm_omni_flags/0.30.0.json, read from the wheel's source by
scripts/vllm_omni_flags.py) is exactly what the real `vllm-omni serve --omni` parser accepts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.stand.conftest import BASE_ENV, ROOT, STAND, require_stand

VOCAB = ROOT / "runner" / "plan" / "vllm_omni_flags" / "0.30.0.json"


def test_vocabulary_is_the_real_parsers() -> None:
    require_stand()
    proc = subprocess.run([str(STAND / "venv" / "bin" / "python"), str(Path(__file__).with_name("serve_flags.py"))],
                          capture_output=True, text=True, timeout=300, env=BASE_ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    real = {line for line in proc.stdout.splitlines() if line.startswith("--")}
    # argparse's BooleanOptionalAction adds --no-X beside --X; the runner accepts --no- of any known flag
    real = {f for f in real if not (f.startswith("--no-") and "--" + f[5:] in real)}
    shipped = {f for group in json.loads(VOCAB.read_text())["flags"].values() for f in group if f.startswith("--")}
    assert len(real) > 300  # the parser was really built (393 long flags in 0.30.0)
    assert sorted(shipped - real) == [], "flags the shipped vocabulary has and the real parser refuses"
    assert sorted(real - shipped) == [], "flags the real parser takes and the shipped vocabulary lacks"
