"""A cap on what a request body may make the server hold: an ASGI middleware in front of the app.

A POST body is read here, before any route sees it, up to `limit` bytes: one that declares more
(Content-Length) is refused before a byte is read, one that sends more is refused at the first chunk past
the limit. Either way the answer is a 413 in vLLM-Omni's error body, never the whole body in memory. A body
within the cap is handed on whole, so each route still reads it as before (`request.body()`, `request.form()`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

TOO_LARGE = 413


def declared_length(scope: Scope) -> int | None:
    """The body length a request declares (Content-Length), None when it declares none or garbage."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            text = value.decode("latin-1").strip()
            return int(text) if text.isdigit() and len(text) <= 18 else None
    return None


class BodyCap:
    def __init__(self, app: App, limit: int, refusal: Callable[[str, int], dict[str, Any]]) -> None:
        """`refusal(path, limit)` is the error body of a refused request to `path`."""
        self.app, self.limit, self.refusal = app, limit, refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        declared = declared_length(scope)
        if declared is not None and declared > self.limit:
            await self._refuse(scope, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client went away: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                chunks.clear()
                await self._refuse(scope, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: bytes | None = b"".join(chunks)
        chunks.clear()

        async def replay() -> Message:
            nonlocal body
            if body is None:  # after the body: what the server says next (a disconnect)
                return await receive()
            whole, body = body, None
            return {"type": "http.request", "body": whole, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, send: Send) -> None:
        payload = json.dumps(self.refusal(scope.get("path", ""), self.limit)).encode()
        await send({"type": "http.response.start", "status": TOO_LARGE,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})
