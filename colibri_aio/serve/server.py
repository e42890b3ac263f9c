"""``python -m colibri_aio serve``: open the engine, bind, and run the ASGI app on uvicorn (uvloop, httptools).

What a client may hold of the server is bounded: its request's head must
arrive within the read timeout and be at most :data:`MAX_HEAD` bytes (uvicorn
bounds neither on httptools: :func:`deadline_protocol` adds both), its body
is bounded by :class:`~colibri_aio.serve.guard.RequestGuard`, an idle
keep-alive connection is closed after :data:`KEEP_ALIVE_S`, and past
``max_connections`` open connections a request gets 503. On SIGINT or SIGTERM
every generation stops at once: a stream ends with an error event whose code
is ``shutting_down``, a whole answer and a request still waiting in the line
get 503 ``shutting_down``.
"""
from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvicorn
from sse_starlette.sse import AppStatus
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from colibri_aio.errors import UserError
from colibri_aio.serve.app import Service, build_app
from colibri_aio.serve.errors import APIError
from colibri_aio.serve.guard import DEFAULT_MAX_BODY, DEFAULT_READ_TIMEOUT, HostAllowList, Limits
from colibri_aio.serve.session import Session
from colibri_aio.engine.sync import SyncEngine, new_loop

# Seconds uvicorn waits for open requests on shutdown before cancelling them (generations are stopped at once).
GRACEFUL_SHUTDOWN_S = 10
KEEP_ALIVE_S = 5                 # an idle keep-alive connection is closed after this
MAX_HEAD = 64 << 10              # bytes of a request line and its headers
DEFAULT_MAX_CONNECTIONS = 256    # open connections (and requests) before a request gets 503
STOP_POLL_S = 0.2                # how often, while stopping, new generations are cancelled too


class HeadTooLarge(Exception):
    """A request line and headers past :data:`MAX_HEAD` bytes."""


def deadline_protocol(head_timeout: float, max_head: int = MAX_HEAD) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a deadline and a size cap on each request's head: a connection whose
    request line and headers are not all in within ``head_timeout`` seconds (from the connection, or from the
    request's first byte) is closed; a head past ``max_head`` bytes is refused (400) and the connection closed."""

    class DeadlineProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _head_bytes = 0

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_bytes = 0
            if self._head_timer is None:
                self._arm()

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value))
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _count(self, n: int) -> None:
            self._head_bytes += n
            if self._head_bytes > max_head:
                raise HeadTooLarge()  # httptools stops parsing; uvicorn answers 400 and closes

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(head_timeout, self._too_slow)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _too_slow(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return DeadlineProtocol


class StoppingServer(uvicorn.Server):
    """uvicorn's server that, once told to stop, stops every generation of ``service`` before it waits for the
    open requests (:func:`stop_generating`)."""

    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self.service = service

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        stopper = asyncio.ensure_future(stop_generating(self.service))
        try:
            await super().shutdown(sockets)
        finally:
            stopper.cancel()


async def stop_generating(service: Service) -> None:
    """Until cancelled: every request waiting in the line gets 503 ``shutting_down`` and every generation is
    cancelled (its stream ends with that error; a whole answer is that 503). Repeated, because a request whose
    prompt was being prepared starts its generation afterwards. The telemetry streams end too (``stopping``)."""
    service.stopping.set()
    while True:
        service.line.fail_waiting(APIError(503, "the server is shutting down", code="shutting_down"))
        service.session.engine.cancel_all()
        await asyncio.sleep(STOP_POLL_S)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free one); a clear error if that fails."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(model: Any, *, host: str, port: int, api_key: str | None, max_queue: int, model_id: str | None,
          open_options: dict[str, Any], slot_save_path: Path | None = None, reasoning_budget: int = -1,
          max_body: int = DEFAULT_MAX_BODY, read_timeout: float = DEFAULT_READ_TIMEOUT,
          max_connections: int = DEFAULT_MAX_CONNECTIONS, allowed_hosts: Sequence[str] = ()) -> int:
    """Serve until SIGINT or SIGTERM; the engine is closed (reads drained, history saved) on the way out.
    ``slot_save_path``: the folder ``POST /slots/{id}?action=save|restore`` keeps slot files in (None: off).
    ``max_body`` bytes a request body may hold; ``read_timeout`` seconds for a request's head, and again for its
    body; ``max_connections`` open at once; ``allowed_hosts``: Host names answered besides this machine's when
    no ``api_key`` is set (``*``: any)."""
    limits = _limits(host, api_key, max_body, read_timeout, max_connections, allowed_hosts)
    if max_queue < 0:
        raise UserError(f"--max-queue must be >= 0, got {max_queue}")
    if reasoning_budget < -1:
        raise UserError(f"--reasoning-budget must be >= -1 (-1: no limit), got {reasoning_budget}")
    if slot_save_path is not None and not slot_save_path.is_dir():
        raise UserError(f"--slot-save-path {slot_save_path}: no such folder")
    sock = bind(host, port)
    try:
        engine = SyncEngine.open(model, **open_options)
    except BaseException:
        sock.close()
        raise
    try:
        service = Service(Session(engine), max_queue=max_queue, api_key=api_key, model_id=model_id,
                          slot_save_path=slot_save_path,
                          reasoning_budget=None if reasoning_budget < 0 else reasoning_budget)
        config = uvicorn.Config(build_app(service, limits), lifespan="off", log_level="warning", access_log=False,
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                                http=deadline_protocol(read_timeout), timeout_keep_alive=KEEP_ALIVE_S,
                                h11_max_incomplete_event_size=MAX_HEAD, limit_concurrency=max_connections)
        server = StoppingServer(config, service)
        # The streams end when their generations are stopped (with the shutting_down event), not when
        # sse-starlette sees the signal: its own drain would cut them first, without a word.
        AppStatus.disable_automatic_graceful_drain()
        print(f"[{engine.describe()}]", file=sys.stderr)
        slots = service.line.capacity
        print(f"[serving {service.model_id} at {url_of(sock)}/v1 ("
              f"{'one stream at a time' if slots == 1 else f'{slots} streams decoded together'}, {max_queue} may wait"
              f"{'; API key required' if api_key else ''}); Ctrl-C stops]", file=sys.stderr, flush=True)
        # uvicorn's own signal handlers stop it gracefully (no new connections, streams ended, open
        # requests given GRACEFUL_SHUTDOWN_S); then it raises the signal again, and the CLI's error path
        # turns it into its exit status (130 for SIGINT, 143 for SIGTERM) after the engine is closed below.
        with asyncio.Runner(loop_factory=new_loop) as runner:
            runner.run(server.serve(sockets=[sock]))
    finally:
        engine.close()  # cancels what still runs, drains the reads, saves the usage history
        sock.close()
    return 0


def _limits(host: str, api_key: str | None, max_body: int, read_timeout: float, max_connections: int,
            allowed_hosts: Sequence[str]) -> Limits:
    """The request limits of :func:`serve`'s options; a UserError naming the first out of range."""
    if api_key == "":
        raise UserError("the API key is empty (--api-key or COLIBRI_API_KEY): give a key, or none for no key")
    if max_body < 1:
        raise UserError(f"--max-body must be at least 1 byte, got {max_body}")
    if not read_timeout > 0:
        raise UserError(f"--read-timeout must be > 0 seconds, got {read_timeout}")
    if max_connections < 1:
        raise UserError(f"--max-connections must be >= 1, got {max_connections}")
    hosts = None if api_key else HostAllowList.for_server(host, allowed_hosts)
    return Limits(max_body=max_body, read_timeout=read_timeout, hosts=hosts)
