"""One engine on its own thread and event loop, running one generation at a time.

The HTTP server and the terminal chat reach the engine through an
:class:`EngineWorker`. The decode loop's compute (NumPy, numba) then never
holds up the server's event loop or the chat's input, and the engine's
io_uring reactor stays on the loop that opened it.

A generation is a :class:`Job`: its pieces go to a *sink* called on the
engine thread, always followed by exactly one :class:`Finished` once the
engine is idle again (reads drained), whether the job ended, failed or was
cancelled.
"""
from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from colibri_aio.engine.engine import Engine, GenerationPiece
from colibri_aio.text.sampling import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate: prompt ids, a token budget (None: to the end of the context), how to choose tokens."""

    ids: list[int]
    max_tokens: int | None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    logprobs: int | None = None   # n: each piece carries its log-probability and the n most likely tokens
    reuse: bool = True            # start from the longest prefix the KV cache holds


@dataclass(frozen=True)
class Finished:
    """The last event of every job: the engine is idle. ``error``: what ended it early (None if it ran out)."""

    error: BaseException | None = None
    cancelled: bool = False


Event = GenerationPiece | Finished
Sink = Callable[[Event], None]


class Job:
    """A generation submitted to the worker; :meth:`cancel` may be called from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._task: asyncio.Task[None] | None = None
        self._cancelled = False

    def cancel(self) -> None:
        """Stop the generation: its reads drain, then the sink hears :class:`Finished`. Idempotent."""
        try:
            self._loop.call_soon_threadsafe(self._cancel)
        except RuntimeError:  # the worker is closed: nothing runs any more
            pass

    def _cancel(self) -> None:  # on the engine thread
        self._cancelled = True
        if self._task is not None:
            self._task.cancel()


class EngineWorker:
    """An :class:`Engine` opened and driven on a thread of its own.

    ``start`` opens the engine (raising what :meth:`Engine.open` raises);
    ``submit`` runs one generation; ``close`` cancels what runs, drains the
    reads and closes the engine. Callers keep to one job at a time (the
    server's queue, the chat's turns); a second job would wait for the
    engine inside the loop.
    """

    def __init__(self, model: str | os.PathLike[str] | None = None, **open_options: Any) -> None:
        self._model, self._options = model, open_options
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock: asyncio.Lock | None = None
        self._current: Job | None = None
        self.engine: Engine | None = None

    def start(self) -> Engine:
        """Open the engine on the worker thread; return it once it is ready."""
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="colibri-engine", daemon=True)
        self._thread.start()
        try:
            self.engine = self._call(self._open())
        except BaseException:
            self._stop_loop()
            raise
        return self.engine

    async def _open(self) -> Engine:
        self._lock = asyncio.Lock()
        return await Engine.open(self._model, **self._options)

    def _call(self, coro: Any) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def submit(self, request: GenerationRequest, sink: Sink) -> Job:
        """Start generating ``request``; pieces and then one :class:`Finished` go to ``sink`` (engine thread)."""
        if self._loop is None or self.engine is None:
            raise RuntimeError("the worker is not started")
        job = Job(self._loop)
        self._loop.call_soon_threadsafe(self._start, job, request, sink)
        return job

    def _start(self, job: Job, request: GenerationRequest, sink: Sink) -> None:  # on the engine thread
        if job._cancelled:
            sink(Finished(cancelled=True))
            return
        assert self._loop is not None
        job._task = self._loop.create_task(self._run(request, sink))
        self._current = job

        def finished(task: asyncio.Task[None]) -> None:
            if self._current is job:
                self._current = None
            if task.cancelled():
                sink(Finished(cancelled=True))
            else:
                sink(Finished(error=task.exception()))

        job._task.add_done_callback(finished)

    async def _run(self, request: GenerationRequest, sink: Sink) -> None:
        assert self.engine is not None and self._lock is not None
        async with self._lock:
            stream = self.engine.generate(request.ids, max_tokens=request.max_tokens, stop=request.stop,
                                          logprobs=request.logprobs, reuse=request.reuse, sampling=request.sampling)
            async with aclosing(stream):  # an early exit still drains the reads in flight
                async for piece in stream:
                    sink(piece)
                    # A step whose experts are all cached never waits on a read, so the task would not
                    # suspend: let the loop run here, so that a cancel (and the device watch) gets in.
                    await asyncio.sleep(0)

    def close(self) -> None:
        """Cancel the running job, drain its reads, close the engine and stop the thread."""
        if self._loop is None:
            return
        try:
            if self.engine is not None:
                self._call(self._aclose())
        finally:
            self._stop_loop()

    async def _aclose(self) -> None:
        job = self._current
        if job is not None and job._task is not None:
            job._task.cancel()
            await asyncio.gather(job._task, return_exceptions=True)
        assert self.engine is not None
        await self.engine.aclose()

    def _stop_loop(self) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join()
        loop.close()

    def __enter__(self) -> "EngineWorker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it is installed (as the CLI runs), else asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
