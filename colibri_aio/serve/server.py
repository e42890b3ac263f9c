"""``python -m colibri_aio serve``: open the engine, bind, and run the ASGI app on uvicorn (uvloop, httptools)."""
from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path
from typing import Any

import uvicorn

from colibri_aio.errors import UserError
from colibri_aio.serve.app import Service, build_app
from colibri_aio.serve.session import Session
from colibri_aio.engine.sync import SyncEngine, new_loop

# Seconds uvicorn waits for open requests on shutdown before cancelling them (streams end at once).
GRACEFUL_SHUTDOWN_S = 10


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
          open_options: dict[str, Any], slot_save_path: Path | None = None) -> int:
    """Serve until SIGINT or SIGTERM; the engine is closed (reads drained, history saved) on the way out.
    ``slot_save_path``: the folder ``POST /slots/{id}?action=save|restore`` keeps slot files in (None: off)."""
    if max_queue < 0:
        raise UserError(f"--max-queue must be >= 0, got {max_queue}")
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
                          slot_save_path=slot_save_path)
        config = uvicorn.Config(build_app(service), lifespan="off", log_level="warning", access_log=False,
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        server = uvicorn.Server(config)
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
