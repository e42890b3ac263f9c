"""One generation request's life on the server's loop: its turn in the line, its start, its answer.

:func:`open_run` waits for the request's turn in the :class:`RequestLine`
first (429 when the line is full) and only then prepares the prompt (the chat
template, which may take up to its time limit, and the tokenizer) on a worker
thread: a request that is refused costs no rendering. A :class:`Run` then
gives the answer whole (:meth:`Run.whole`) or as chunk objects
(:meth:`Run.chunks`), which the OpenAI and Anthropic routes shape into their
own responses. A client that goes away, while waiting or generating, gives up
its place or cancels its generation.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive

from colibri_aio.engine.engine import GenerationPiece
from colibri_aio.engine.line import QueueFull
from colibri_aio.errors import EngineBusyError, ExpertReadError, UserError
from colibri_aio.logs import get_logger
from colibri_aio.serve.errors import APIError
from colibri_aio.serve.responses import ChatShape, CompletionShape
from colibri_aio.serve.session import AsyncGeneration, ContextFull, GenerationCancelled, GenerationRequest

T = TypeVar("T")
log = get_logger("colibri_aio.serve")
Shape = ChatShape | CompletionShape


class ClientGone(Exception):
    """The client disconnected before the work it waited for was done."""


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first: then cancel it and raise :class:`ClientGone`.

    The request body must have been read: ``receive`` then only ever
    reports the disconnect.
    """
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        raise ClientGone()
    return task.result()


def error_for(exc: BaseException) -> APIError:
    """The API error a failure is answered with."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextFull):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, EngineBusyError):
        return APIError(409, str(exc), code="slot_busy")
    if isinstance(exc, UserError):
        return APIError(400, str(exc))
    if isinstance(exc, ExpertReadError):
        return APIError(500, f"I/O error: {exc}", code="io_error")
    if isinstance(exc, GenerationCancelled):
        return APIError(503, "the server is shutting down", code="shutting_down")
    return APIError(500, f"internal error: {exc.__class__.__name__}")


class Run:
    """A started generation: its first piece is in; :meth:`whole` or :meth:`chunks` takes the rest."""

    def __init__(self, request: Request, service: Any, generation: AsyncGeneration, first: GenerationPiece,
                 shape: Shape, *, with_logprobs: bool) -> None:
        self.request, self.service, self.generation = request, service, generation
        self.first, self.shape, self.with_logprobs = first, shape, with_logprobs

    def cancel(self) -> None:
        """Stop generating (the engine drains, then the turn passes on). Safe to call twice."""
        self.generation.cancel()

    async def whole(self) -> dict[str, Any]:
        """The whole response object; raises :class:`ClientGone` when the client leaves first."""
        try:
            pieces = [self.first, *await until_disconnect(self.request.receive, self._rest())]
        finally:
            self.cancel()
        record_speed(self.service, pieces[-1])
        return self.shape.response(pieces, self.with_logprobs)

    async def _rest(self) -> list[GenerationPiece]:
        pieces = []
        while (piece := await self.generation.next()) is not None:
            pieces.append(piece)
        return pieces

    async def chunks(self, include_usage: bool) -> AsyncIterator[dict[str, Any]]:
        """Chunk objects: the head, one per piece that carries something, the usage chunk when asked; an error
        mid-stream is yielded as an error body and ends the stream."""
        try:
            head = self.shape.first_chunk(include_usage)
            if head is not None:
                yield head
            piece: GenerationPiece | None = self.first
            last = self.first
            while piece is not None:
                last = piece
                chunk = self.shape.chunk(piece, self.with_logprobs, include_usage)
                if chunk is not None:
                    yield chunk
                piece = await self.generation.next()
            record_speed(self.service, last)
            if include_usage:
                yield self.shape.usage_chunk(last)
        except Exception as exc:  # the status line is sent: the error goes in the stream, and the stream ends
            if not isinstance(exc, (UserError, ExpertReadError, GenerationCancelled)):
                log.exception("generation failed mid-stream")
            yield error_for(exc).body()
        finally:
            self.cancel()


def record_speed(service: Any, last: GenerationPiece) -> None:
    service.metrics.last_decode_tps.set(last.decode_tps)
    service.metrics.last_prefill_tps.set(last.prefill_tps)


async def open_run(request: Request, service: Any, prepare: Callable[[], tuple[GenerationRequest, Shape]], *,
                   with_logprobs: bool) -> Run | Response:
    """Wait for the turn, then ``prepare`` the generation (on a worker thread) and start it: a :class:`Run`,
    or a 499 response when the client left first."""
    arrival = time.perf_counter()
    try:
        await until_disconnect(request.receive, service.line.acquire())
    except QueueFull as exc:
        raise APIError(429, str(exc), code="queue_full", headers={"Retry-After": str(exc.retry_after)}) from None
    except ClientGone:
        return Response(status_code=499)
    turn = time.perf_counter()
    service.metrics.queue_wait.observe(turn - arrival)

    def on_idle() -> None:
        now = time.perf_counter()
        service.line.record_turn(now - turn)
        service.metrics.duration.observe(now - arrival)
        service.line.release()

    try:
        gen, shape = await run_in_threadpool(prepare)
        generation = AsyncGeneration(service.session, gen, on_idle)
    except BaseException:
        service.line.release()
        raise
    try:
        first = await until_disconnect(request.receive, generation.next())
    except ClientGone:
        generation.cancel()
        return Response(status_code=499)
    except BaseException:
        generation.cancel()
        raise
    assert first is not None  # a generation yields at least one piece
    ttft = time.perf_counter() - arrival
    service.metrics.ttft.observe(ttft)
    service.metrics.last_ttft.set(ttft)
    return Run(request, service, generation, first, shape, with_logprobs=with_logprobs)
