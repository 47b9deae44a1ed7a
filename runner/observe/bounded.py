"""HTTP answers bounded in time and size: a total deadline (not a gap between bytes) and a cap on the body.

httpx's timeouts bound each phase and each gap between bytes: a server that drips one byte a second keeps a
60-s read "alive" forever. Here the exchange runs on a worker thread and the caller waits for it at most
`deadline_s`; the worker reads the body in chunks and gives up as soon as the deadline passed or the body
grew past `max_bytes`, so an abandoned exchange ends at its next chunk (or its next gap timeout) on its own.
Every timeout the matrix names and every meter scrape goes through `exchange`.
"""

from __future__ import annotations

import functools
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from runner.core.units import MIB

GRACE_S = 0.25  # beyond the deadline, for the worker to hand over an answer that arrived just in time


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()  # httpx's default verification (certifi, or SSL_CERT_FILE/SSL_CERT_DIR)


def client(**kwargs: Any) -> httpx.Client:
    """An httpx.Client with the process's one TLS context: httpx parses the CA bundle again for every Client
    (33 ms of CPU), and a run makes one per server start, session and meter."""
    return httpx.Client(verify=_tls_context(), **kwargs)


class Overdue(Exception):
    """No whole answer within the total deadline."""


class TooLarge(Exception):
    """The body grew past the cap (the rest was not read)."""


@dataclass(frozen=True)
class Answer:
    status: int
    content: bytes
    headers: httpx.Headers

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        import json

        return json.loads(self.content)


def _read(client: httpx.Client, method: str, url: str, end: float, max_bytes: int, kwargs: dict[str, Any]) -> Answer:
    with client.stream(method, url, **kwargs) as response:
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            raise TooLarge(f"body of {int(declared)} bytes declared, over the cap of {max_bytes} bytes")
        chunks, size = [], 0
        for chunk in response.iter_raw():  # raw: the cap holds for what arrives, before any decompression
            size += len(chunk)
            if size > max_bytes:
                raise TooLarge(f"body over the cap of {max_bytes} bytes")
            if time.monotonic() > end:
                raise Overdue("answer still arriving at the deadline")
            chunks.append(chunk)
        raw = b"".join(chunks)
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        content = raw if encoding in ("", "identity") else _decompress(raw, encoding, max_bytes)
        return Answer(response.status_code, content, response.headers)


def _decompress(raw: bytes, encoding: str, max_bytes: int) -> bytes:
    """gzip/deflate bodies, inflated at most to the cap (a decompression bomb is TooLarge, not memory)."""
    import zlib

    if encoding not in ("gzip", "deflate", "x-gzip"):
        raise TooLarge(f"content-encoding {encoding!r} is not accepted")
    d = zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip or zlib header, detected
    out = d.decompress(raw, max_bytes + 1)
    if len(out) > max_bytes or d.unconsumed_tail:
        raise TooLarge(f"body inflates past the cap of {max_bytes} bytes")
    return out


def exchange(client: httpx.Client, method: str, url: str, *, deadline_s: float, max_bytes: int,
             connect_s: float = 10.0, **kwargs: Any) -> Answer:
    """One request whose whole answer (connect, headers, body) arrives within `deadline_s`, its body within
    `max_bytes`; else Overdue or TooLarge. httpx.HTTPError for what fails on the way (refused, reset)."""
    end = time.monotonic() + deadline_s
    kwargs["timeout"] = httpx.Timeout(deadline_s, connect=min(connect_s, deadline_s))
    # Only encodings inflated here under the cap (httpx would offer br/zstd when those packages are present).
    kwargs["headers"] = {**dict(kwargs.get("headers") or {}), "Accept-Encoding": "gzip, deflate"}
    box: dict[str, Any] = {}
    done = threading.Event()

    def work() -> None:
        try:
            box["answer"] = _read(client, method, url, end, max_bytes, kwargs)
        except BaseException as exc:  # handed to the caller
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=work, name="http-exchange", daemon=True).start()
    if not done.wait(deadline_s + GRACE_S):
        raise Overdue(f"no whole answer within {deadline_s:g} s")
    if "error" in box:
        error = box["error"]
        if isinstance(error, httpx.TimeoutException):
            raise Overdue(f"no whole answer within {deadline_s:g} s ({type(error).__name__})") from None
        raise error
    answer: Answer = box["answer"]
    return answer


DEFAULT_SIDE = 2048  # when the matrix requests no size: the largest side vLLM-Omni's Qwen-Image serves by default


def body_cap(size: tuple[int, int] | None) -> int:
    """The largest response body taken for one image request: 8× the requested image as uncompressed RGBA in
    base64 (an honest PNG is far smaller), at least 16 MiB."""
    w, h = size or (DEFAULT_SIDE, DEFAULT_SIDE)
    return max(16 * MIB, 8 * w * h * 4 * 4 // 3)


def pixel_cap(size: tuple[int, int] | None) -> int:
    """The most pixels an answer's image may decode to: 4× the requested size (a 420 KB PNG can declare
    12000×12000, 3.8 GiB decoded)."""
    w, h = size or (DEFAULT_SIDE, DEFAULT_SIDE)
    return 4 * w * h
