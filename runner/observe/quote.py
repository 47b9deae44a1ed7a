"""Server text made inert: the one place where what a server or exporter sent becomes text the runner keeps
or shows.

Whatever a server writes (its log, an HTTP body, an exception it raised) is untrusted. `server_text` is
applied where such text enters the runner (the log window of a request, the log tail of a start, a response
body): values the runner resolved itself (`${HF_TOKEN}`) are masked, control characters (terminal escapes,
OSC 8 links, bidi overrides) become visible `\\x1b`-style escapes, and the length is bounded — so records,
session.json, verdict.json and everything derived from them are clean. The two renderings apply it again on
the way out (records of an older run, or a crafted folder handed to `runner report`, did not pass through
it): `console` for a printed line, `markdown` for report.md, where HTML and Markdown syntax are escaped so
no `<script>`, `<img onerror>` or `javascript:` link can form.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MASK = "***"
MIN_SECRET = 4  # shorter resolved values ("0", "on") would mask ordinary digits and words, not secrets
LIMIT = 64_000  # characters of one quoted text (a log window, a body) kept in a record

# C0 controls but \n (kept: texts are split into lines), DEL, C1 controls (8-bit CSI/OSC), line/paragraph
# separators and the bidi embedding/override/isolate characters that reorder what a terminal shows.
_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_CONTROL_OR_NL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
# HTML syntax becomes character references, the Markdown characters that open links, images, code spans,
# emphasis (`*`, `_`, `~~`: Markdown reads them inside a <code> element too, so a site `__init__.py` would be
# bold) or a table cell are backslash-escaped: the text renders as itself and never as markup.
_HTML = {"<": "&lt;", ">": "&gt;", "&": "&amp;"}
_MARKUP = re.compile(r"[<>&\\`*_~\[\]|]")


def _visible(match: re.Match[str]) -> str:
    c = match.group()
    if c == "\t":
        return "\\t"
    if c == "\n":
        return "\\n"
    if c == "\r":
        return "\\r"
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def mask(text: str, secrets: Iterable[str]) -> str:
    """Every secret value replaced by ***, longest first (so a secret inside another goes too)."""
    for value in sorted({s for s in secrets if s and len(s) >= MIN_SECRET}, key=len, reverse=True):
        text = text.replace(value, MASK)
    return text


def inert(text: str) -> str:
    """Control characters as visible escapes; line breaks kept (\\r\\n and \\r become \\n)."""
    return _CONTROL.sub(_visible, text.replace("\r\n", "\n"))


def bound(text: str, limit: int = LIMIT) -> str:
    """At most `limit` characters: the end is kept (a log's last lines say why it failed)."""
    if len(text) <= limit:
        return text
    return f"[{len(text) - limit} earlier characters left out] " + text[-limit:]


def server_text(text: str | bytes, secrets: Iterable[str] = (), limit: int = LIMIT) -> str:
    """What a server sent → text safe to keep: masked, inert, bounded. Idempotent."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    return bound(inert(mask(text, secrets)), limit)


def console(text: object) -> str:
    """One printed line: every control character (line breaks too) as a visible escape."""
    return _CONTROL_OR_NL.sub(_visible, str(text))


def markdown(text: object) -> str:
    """Text for report.md: one line, no control characters, HTML and Markdown syntax escaped: it renders as
    itself, never as markup, a link or an image (`[x](javascript:…)` stays text)."""
    return _MARKUP.sub(lambda m: _HTML.get(m.group(), "\\" + m.group()), console(text))


def code(text: object) -> str:
    """A quoted server line in report.md: inert text in a <code> element (a Markdown code span would keep
    `<script>` and `javascript:` literally in the file)."""
    return f"<code>{markdown(text)}</code>"


__all__ = ["MASK", "bound", "code", "console", "inert", "markdown", "mask", "server_text"]
