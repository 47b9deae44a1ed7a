"""Secret values never leave the process: env values whose key looks secret are masked in every file and
every printed line (run.json, `runner plan`, logs of what was started). The real value is passed only to the
server process itself.

A matrix can also name a variable of the runner's own environment instead of holding the value: "${HF_TOKEN}"
(resolved at start, never stored).
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable, Mapping

MASK = "***"
_SECRET_KEY = re.compile(r"TOKEN|SECRET|PASSW|API_?KEY|CREDENTIAL|PRIVATE|AUTH|COOKIE|SESSION_KEY", re.I)


def is_secret(key: str) -> bool:
    return bool(_SECRET_KEY.search(key))


def mask_env(env: Mapping[str, str]) -> dict[str, str]:
    """The env as it may be shown or stored: secret-looking keys keep their name, lose their value."""
    return {k: (MASK if is_secret(k) and v else v) for k, v in env.items()}


# After a key: `= "basic"`, `= 'literal'` or a bare number, up to the end of the value.
_VALUE = r"""["']?\s*=\s*)(?!"{3}|'{3})("(?:[^"\\\n]|\\.)*"|'[^'\n]*'|[^\s,}#]+)"""
_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class MissingVariable(Exception):
    """A "${VAR}" names a variable the runner's environment does not hold."""


def missing_refs(env: Mapping[str, str], environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """(key, VAR) for every "${VAR}" in env values that `environ` does not hold."""
    return [(k, name) for k, v in env.items() for name in _REF.findall(v) if name not in environ]


def resolve_env(env: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """The env with "${VAR}" replaced by the runner's own variable: done only when the server starts."""
    missing = missing_refs(env, environ)
    if missing:
        key, name = missing[0]
        raise MissingVariable(f"env {key} references ${{{name}}}, which is not set in the runner's environment")
    return {k: _REF.sub(lambda m: environ[m.group(1)], v) for k, v in env.items()}


def mask_text(text: str, env: Iterable[tuple[str, str]]) -> str:
    """A matrix text with the values of secret-looking env keys masked, for run.json.

    The value is replaced where its key assigns it (so the text stays valid TOML that loads again). If the
    masked text still parses to an unmasked secret (a value written some other way, e.g. a multi-line
    string), the value is replaced wherever it appears: a leak is worse than a stored text that no longer
    loads.
    """
    secrets = [(k, v) for k, v in env if is_secret(k) and v and not _REF.fullmatch(v)]
    out = text
    for key, _ in secrets:
        assign = re.compile(r"""((?<![\w-])["']?""" + re.escape(key) + _VALUE)
        out = assign.sub(lambda m: m.group(1) + f'"{MASK}"', out)
    if _unmasked(out):
        for _, value in secrets:
            out = out.replace(value, MASK)
    return out


def _unmasked(text: str) -> bool:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return True

    def walk(node: object) -> bool:
        if isinstance(node, dict):
            return any((is_secret(k) and isinstance(v, (str, int, float)) and not isinstance(v, bool)
                        and str(v) not in (MASK, "") and not _REF.fullmatch(str(v))) or walk(v)
                       for k, v in node.items())
        if isinstance(node, list):
            return any(walk(x) for x in node)
        return False

    return walk(doc)


def resolved_values(env: Mapping[str, str], environ: Mapping[str, str]) -> tuple[str, ...]:
    """Every value the runner puts into a server's environment itself: what each "${VAR}" resolved to, and
    the whole value of a secret-looking key. A server may print any of them (a traceback, an HTTP 500 body);
    quote.server_text masks them wherever such text is kept or shown."""
    out: list[str] = []
    for key, value in env.items():
        names = _REF.findall(value)
        out += [environ[n] for n in names if environ.get(n)]
        if is_secret(key) or names:
            out.append(_REF.sub(lambda m: environ.get(m.group(1), m.group(0)), value))
    return tuple(v for v in dict.fromkeys(out) if v and not _REF.fullmatch(v))
