"""Secret values never leave the process: env values whose key looks secret are masked in every file and
every printed line (run.json, `runner plan`, logs of what was started). The real value is passed only to the
server process itself.

A matrix can also name a variable of the runner's own environment instead of holding the value: "${HF_TOKEN}"
(resolved at start, never stored).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

MASK = "***"
_SECRET_KEY = re.compile(r"TOKEN|SECRET|PASSW|API_?KEY|CREDENTIAL|PRIVATE|AUTH|COOKIE|SESSION_KEY", re.I)


def is_secret(key: str) -> bool:
    return bool(_SECRET_KEY.search(key))


def mask_env(env: Mapping[str, str]) -> dict[str, str]:
    """The env as it may be shown or stored: secret-looking keys keep their name, lose their value."""
    return {k: (MASK if is_secret(k) and v else v) for k, v in env.items()}
