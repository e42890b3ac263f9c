"""What every request passes before a route sees it: its Host, its Content-Type, the size and pace of its body.

Read as an attacker would send it:

- Host (only when no API key is set, so that anyone who reaches the port may
  use it): a page on another site whose name the attacker points at this
  machine (DNS rebinding) sends its own name as Host. Allowed: IP literals
  (rebinding needs a name), ``localhost`` and ``*.localhost``, the name the
  server is bound to, and ``--allowed-hosts`` (``*``: any). Anything else is
  421, before the body is read.
- A body (POST, PUT, PATCH) must be ``application/json`` (415 otherwise): a
  cross-site form post from a browser (``text/plain``, no preflight) cannot
  start a generation.
- The body's size: a Content-Length past the limit is 413 at once, unread; a
  body that grows past it as it arrives (chunked) is 413 after at most the
  limit is held. The body must arrive whole within the read timeout (408
  otherwise), so a client that trickles it holds no place for long.

The body is read here, whole, and handed on: a route never waits on a slow
client. Every refusal closes the connection (what is left of the body would
otherwise be read as the next request).
"""
from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from colibri_aio.serve.errors import APIError

DEFAULT_MAX_BODY = 16 << 20
DEFAULT_READ_TIMEOUT = 30.0  # seconds for a request's headers, and again for its body
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
JSON = "application/json"


class HostAllowList:
    """The Host names a server without a key answers (module docstring)."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        self.names = frozenset(n for n in (_bare(name) for name in names) if n)
        self.any = "*" in self.names

    @classmethod
    def for_server(cls, bound: str, extra: Iterable[str] = ()) -> HostAllowList:
        """The default list of a server bound to ``bound`` (a name or an address), with ``extra`` names."""
        return cls(["localhost", bound, *extra])

    def allows(self, host: str | None) -> bool:
        """Whether a request with this Host header (None: none sent) is answered."""
        if host is None or self.any:
            return True
        name = _bare(host)
        return name in self.names or name.endswith(".localhost") or _is_address(name)


def _bare(host: str) -> str:
    """``Example.COM.:8080`` -> ``example.com``, ``[::1]:80`` -> ``::1``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":")[0]
    return host.rstrip(".")


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Limits:
    """What :class:`RequestGuard` enforces; ``hosts`` None: any Host (an API key is set, or a trusted front)."""

    max_body: int = DEFAULT_MAX_BODY
    read_timeout: float = DEFAULT_READ_TIMEOUT
    hosts: HostAllowList | None = None

    def __post_init__(self) -> None:
        if self.max_body < 1:
            raise ValueError(f"max_body must be >= 1 byte, got {self.max_body}")
        if not self.read_timeout > 0:
            raise ValueError(f"read_timeout must be > 0 s, got {self.read_timeout}")


class ClientLeft(Exception):
    """The client disconnected while its body was read: nobody to answer."""


def openai_error(path: str, error: APIError) -> Response:
    """An error in OpenAI's shape, whatever the path."""
    return error.response()


class RequestGuard:
    """ASGI middleware enforcing :class:`Limits` (module docstring); ``respond`` shapes a refusal for the path it
    was made on (an API of another shape on some paths)."""

    def __init__(self, app: ASGIApp, limits: Limits,
                 respond: Callable[[str, APIError], Response] = openai_error) -> None:
        self.app, self.limits, self.respond = app, limits, respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self.check_head(scope["method"], Headers(scope=scope))
            if scope["method"] in BODY_METHODS:
                body = await read_body(receive, self.limits.max_body, self.limits.read_timeout)
                receive = _replay(body, receive)
        except APIError as exc:
            exc.headers.setdefault("Connection", "close")
            await self.respond(scope["path"], exc)(scope, receive, send)
            return
        except ClientLeft:
            return
        await self.app(scope, receive, send)

    def check_head(self, method: str, headers: Headers) -> None:
        """Refuse on the headers alone: a Host not allowed, a body that is not JSON or is too large."""
        hosts = self.limits.hosts
        if hosts is not None and not hosts.allows(headers.get("host")):
            raise APIError(421, f"Host {headers.get('host')!r} is not served here (no API key is set, so only "
                                f"this machine's names are; add it with --allowed-hosts)", code="host_not_allowed")
        if method not in BODY_METHODS:
            return
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        if media != JSON:
            raise APIError(415, f"Content-Type must be {JSON}, got {media or 'none'!r}",
                           code="unsupported_media_type")
        length = headers.get("content-length")
        if length is not None:
            if not length.strip().isascii() or not length.strip().isdigit():
                raise APIError(400, f"Content-Length is not a number: {length!r}")
            if int(length) > self.limits.max_body:
                raise _too_large(self.limits.max_body)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes (the server's --max-body)",
                    code="body_too_large")


async def read_body(receive: Receive, limit: int, timeout: float) -> bytes:
    """The whole body: 413 past ``limit`` bytes (no more is held), 408 when it takes longer than ``timeout``
    seconds; :class:`ClientLeft` when the client goes away."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    chunks: list[bytes] = []
    size = 0
    while True:
        try:
            async with asyncio.timeout_at(deadline):
                message = await receive()
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {timeout:g} s",
                           code="request_timeout") from None
        if message["type"] == "http.disconnect":
            raise ClientLeft()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` once, then what the client sends (its disconnect)."""
    given = False

    async def replayed() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
