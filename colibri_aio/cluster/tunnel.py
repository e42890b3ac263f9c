"""One HTTP exchange carried between the gateway and a replica, as plain picklable values.

The replica runs ``colibri_aio.serve``'s own ASGI application on each
request (:func:`exchange`): the same validation, queue, generation,
response shapes and SSE framing as ``serve`` on one machine. What crosses
the wire is an :class:`HTTPRequest` one way, and a :class:`Head` then body
chunks (bytes) the other. When the caller stops iterating (its client left),
the application hears ``http.disconnect`` as it would from a socket, and
gives up the request's place or cancels its generation; the iteration ends
once the application has.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message

# How long an application gets to wind up after its caller left, before it is cancelled.
WIND_UP_S = 30.0
REPLICA_HEADER = "x-colibri-replica"  # on every answer a replica gives: its id


@dataclass(frozen=True)
class HTTPRequest:
    """What the application needs of a request; ``headers`` as ASGI has them (lower-case names, bytes)."""

    method: str
    path: str
    query: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""

    def header(self, name: str) -> str | None:
        key = name.lower().encode()
        return next((v.decode("latin-1") for k, v in self.headers if k == key), None)

    def scope(self) -> dict[str, Any]:
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": self.method, "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
                "root_path": "", "query_string": self.query, "headers": list(self.headers),
                "server": ("replica", 0), "client": ("gateway", 0), "state": {}}


@dataclass(frozen=True)
class Head:
    """The status line and headers of a response."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...] = field(default=())

    def header(self, name: str) -> str | None:
        key = name.lower().encode()
        return next((v.decode("latin-1") for k, v in self.headers if k == key), None)

    @property
    def is_event_stream(self) -> bool:
        return (self.header("content-type") or "").startswith("text/event-stream")


Part = Head | bytes
_END = object()


async def exchange(app: ASGIApp, request: HTTPRequest) -> AsyncIterator[Part]:
    """Run ``app`` on ``request``; yield its :class:`Head`, then its body chunks as they are sent.

    Chunks sent while the caller was busy come out joined. Closing the
    iteration early tells the application its client disconnected and waits
    (at most :data:`WIND_UP_S`) for it to finish.
    """
    parts: deque[Any] = deque()
    ready = asyncio.Event()
    gone = asyncio.Event()
    body_given = False

    def put(part: Any) -> None:
        parts.append(part)
        ready.set()

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            put(Head(message["status"], tuple((bytes(k), bytes(v)) for k, v in message.get("headers", ()))))
        elif message["type"] == "http.response.body" and message.get("body"):
            put(bytes(message["body"]))

    async def run() -> None:
        try:
            await app(request.scope(), receive, send)
        finally:
            put(_END)

    task = asyncio.ensure_future(run())
    try:
        while True:
            await ready.wait()
            ready.clear()
            batch = list(parts)
            parts.clear()
            for part in _joined(batch):
                if part is _END:
                    await task  # the application's own error, if it raised one
                    return
                yield part
    finally:
        if not task.done():
            gone.set()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(task), WIND_UP_S)
            task.cancel()


def _joined(batch: list[Any]) -> list[Any]:
    """Consecutive body chunks joined into one (fewer, larger messages across the wire)."""
    out: list[Any] = []
    for part in batch:
        if isinstance(part, bytes) and out and isinstance(out[-1], bytes):
            out[-1] += part
        else:
            out.append(part)
    return out


async def answer_as(replica: str, app: ASGIApp, request: HTTPRequest) -> AsyncIterator[Part]:
    """:func:`exchange`, with the answer's head naming ``replica`` (the :data:`REPLICA_HEADER`)."""
    async with contextlib.aclosing(exchange(app, request)) as parts:
        async for part in parts:
            if isinstance(part, Head):
                part = Head(part.status, (*part.headers, (REPLICA_HEADER.encode(), replica.encode())))
            yield part
