"""The engine without an event loop of your own: :class:`SyncEngine` and :func:`generate`.

A :class:`SyncEngine` opens the model once and keeps it, with its own event
loop running in a daemon thread (a blocking portal, as anyio calls it): every
call hands a coroutine to that loop and waits for its result. So it works the
same in a plain script, inside a running event loop (Jupyter, a web handler:
the caller's loop is never used) and from several threads at once (calls
queue on the one engine, which computes for one caller at a time).

    with SyncEngine.open("model.gguf") as engine:
        for piece in engine.generate("The list type", max_tokens=32):
            print(piece.text, end="", flush=True)

A server, whose own loop must never wait on compute, uses
:meth:`SyncEngine.submit` instead: the generation runs on the engine's loop
and pushes each piece to a callback, then one :class:`Finished`.

Closing (``with``, :meth:`SyncEngine.close`) cancels submitted generations,
drains the reads in flight, saves the usage history and stops the thread. An engine still open when the
interpreter exits is closed then, before Python tears its modules down.
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import os
import signal
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from colibri_aio.engine.engine import Engine, GenerationPiece, Prompt
from colibri_aio.errors import EngineBusyError

T = TypeVar("T")

_open_engines: weakref.WeakSet["SyncEngine"] = weakref.WeakSet()


def new_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's where it is installed, else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class _LoopThread:
    """An event loop running forever in a daemon thread; coroutines run on it, callers wait for them."""

    def __init__(self) -> None:
        self.loop = new_loop()
        self.thread = threading.Thread(target=self._run, name="colibri-aio-engine", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        # Ctrl-C and SIGTERM belong to the main thread: delivered here (and to the kernel threads this one
        # starts, which inherit the mask), they would not wake a main thread blocked in a read (input()).
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        self.loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and return its result.

        If the caller is interrupted (Ctrl-C) while waiting, the coroutine is
        cancelled and waited for, so its clean-up (reads drained, the stream
        closed) is over before the interrupt goes on.
        """
        started, finished = threading.Event(), threading.Event()
        running: list[asyncio.Task[T]] = []

        async def tracked() -> T:
            running.append(asyncio.current_task())  # type: ignore[arg-type]
            started.set()
            try:
                return await coro
            finally:
                finished.set()

        wrapper = tracked()
        future: concurrent.futures.Future[T] | None = None
        try:
            # Inside the try: an interrupt can land while the coroutine is being handed to the loop,
            # before ``future`` exists, and the coroutine may then start anyway.
            future = asyncio.run_coroutine_threadsafe(wrapper, self.loop)
            return future.result()
        except BaseException:
            if future is None or not future.done():
                if future is not None:
                    future.cancel()
                # One more round trip through the loop runs after the hand-over and the cancellation: by
                # then the coroutine has either never started or is running; stop it and wait for its end.
                asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self.loop).result()
                if started.is_set():
                    if future is None:
                        self.loop.call_soon_threadsafe(running[0].cancel)
                    finished.wait()
                else:
                    wrapper.close()
                    coro.close()
            raise

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


@dataclass(frozen=True)
class Finished:
    """The last event of a submitted generation: the engine's turn is over and its reads drained.

    ``error``: what ended it early (None when it ran to its end); ``cancelled``: :meth:`Job.cancel` or close.
    """

    error: BaseException | None = None
    cancelled: bool = False


Event = GenerationPiece | Finished
Sink = Callable[[Event], None]


class Job:
    """A generation started by :meth:`SyncEngine.submit`; :meth:`cancel` may be called from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._task: asyncio.Task[None] | None = None
        self._cancelled = False

    def cancel(self) -> None:
        """Stop the generation: its reads drain, then the sink hears :class:`Finished`. Safe to repeat."""
        try:
            self._loop.call_soon_threadsafe(self._cancel)
        except RuntimeError:  # the engine is closed: nothing runs any more
            pass

    def _cancel(self) -> None:  # on the engine's loop
        self._cancelled = True
        if self._task is not None:
            self._task.cancel()


class SyncEngine:
    """An :class:`~colibri_aio.Engine` for code without an event loop: open once, call from anywhere."""

    def __init__(self, engine: Engine, portal: _LoopThread) -> None:
        self.engine, self._portal = engine, portal
        self._jobs: set[Job] = set()  # submitted and not finished (touched on the engine's loop only)
        self._lock = threading.Lock()
        self._streaming: set[int] = set()  # threads with a stream open: waiting there would never end
        self.closed = False
        _open_engines.add(self)

    @classmethod
    def open(cls, path: str | os.PathLike[str] | None = None, **options: Any) -> "SyncEngine":
        """Load ``path`` (default: the shipped model); ``options`` are :meth:`Engine.open`'s."""
        portal = _LoopThread()
        try:
            engine = portal.call(Engine.open(path, **options))
        except BaseException:
            portal.stop()
            raise
        return cls(engine, portal)

    @property
    def model(self):  # noqa: ANN201 - the gguf Model
        return self.engine.model

    @property
    def tokenizer(self):  # noqa: ANN201
        return self.engine.tokenizer

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self.closed:
            coro.close()
            raise RuntimeError("the engine is closed")
        return self._portal.call(coro)

    def _not_streaming_here(self) -> None:
        """A thread whose own stream holds the engine would wait for itself forever: say so instead."""
        if threading.get_ident() in self._streaming:
            raise EngineBusyError("this thread has a generation still open on this engine: finish or close it "
                                  "(break out of its loop, or call .close() on it) first")

    def generate(self, prompt: Prompt, **options: Any) -> Iterator[GenerationPiece]:
        """Stream a continuation, piece by piece; ``options`` are :meth:`Engine.generate`'s.

        Leaving the loop early (``break``) ends the stream and lets the next
        caller in; other callers (threads) wait for this stream to end, or
        with ``wait=False`` fail at once with ``EngineBusyError``.
        """
        self._not_streaming_here()
        stream: AsyncIterator[GenerationPiece] = self.engine.generate(prompt, **options)
        me = threading.get_ident()
        self._streaming.add(me)
        try:
            while True:
                try:
                    yield self._call(anext(stream))  # type: ignore[arg-type]
                except StopAsyncIteration:
                    return
        finally:
            self._streaming.discard(me)
            if self.closed:
                pass  # closed first (at exit, or by another thread): nothing is left to end
            elif threading.current_thread() is self._portal.thread:  # collected on the loop's own thread
                self._portal.loop.create_task(stream.aclose())  # type: ignore[attr-defined]
            else:
                self._portal.call(stream.aclose())  # type: ignore[attr-defined]

    def submit(self, prompt: Prompt, sink: Sink, **options: Any) -> Job:
        """Generate on the engine's loop, pushing each piece to ``sink``, then exactly one :class:`Finished`.

        ``sink`` is called on the engine's thread and must return at once
        (hand the event over, e.g. with ``loop.call_soon_threadsafe``). The
        caller never waits: this suits a server, whose own loop must stay
        free. Generations queue for the engine's turn like :meth:`generate`
        calls. ``options`` are :meth:`Engine.generate`'s.
        """
        if self.closed:
            raise RuntimeError("the engine is closed")
        job = Job(self._portal.loop)
        self._portal.loop.call_soon_threadsafe(self._start, job, prompt, sink, options)
        return job

    def _start(self, job: Job, prompt: Prompt, sink: Sink, options: dict[str, Any]) -> None:  # on the loop
        if job._cancelled or self.closed:
            sink(Finished(cancelled=True))
            return
        job._task = self._portal.loop.create_task(self._push(prompt, sink, options))
        self._jobs.add(job)

        def finished(task: asyncio.Task[None]) -> None:
            self._jobs.discard(job)
            sink(Finished(cancelled=True) if task.cancelled() else Finished(error=task.exception()))

        job._task.add_done_callback(finished)

    async def _push(self, prompt: Prompt, sink: Sink, options: dict[str, Any]) -> None:
        stream: AsyncIterator[GenerationPiece] = self.engine.generate(prompt, **options)
        async with contextlib.aclosing(stream):  # type: ignore[type-var]  # an early end drains the reads
            async for piece in stream:
                sink(piece)
                # A step whose experts are all cached never waits on a read, so the task would not
                # suspend: let the loop run here, so that a cancel (and the device watch) gets in.
                await asyncio.sleep(0)

    def cancel_all(self) -> None:
        """Cancel every submitted generation that has not finished (any thread; returns at once): each sink then
        hears :class:`Finished` with ``cancelled`` once its reads drained. A server stopping uses it."""
        def cancel() -> None:  # on the engine's loop
            for job in list(self._jobs):
                job._cancel()

        try:
            self._portal.loop.call_soon_threadsafe(cancel)
        except RuntimeError:  # the engine is closed: nothing runs any more
            pass

    async def _cancel_jobs(self) -> None:
        tasks = [job._task for job in self._jobs if job._task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def text(self, prompt: Prompt, **options: Any) -> str:
        """The whole continuation as one string."""
        return "".join(piece.text for piece in self.generate(prompt, **options))

    def logits(self, ids: Sequence[int], **options: Any) -> np.ndarray:
        """Teacher-forced logits (len(ids), vocab): row i follows ids[0..i]."""
        self._not_streaming_here()
        return self._call(self.engine.logits(ids, **options))

    def save_slot(self, path: str | os.PathLike[str], slot: int = 0) -> int:
        """:meth:`Engine.save_slot`: the slot's KV cache and token ids to ``path``; the bytes written."""
        self._not_streaming_here()
        return self._call(self.engine.save_slot(path, slot))

    def restore_slot(self, path: str | os.PathLike[str], slot: int = 0) -> int:
        """:meth:`Engine.restore_slot`: the slot filled from ``path``; the positions restored."""
        self._not_streaming_here()
        return self._call(self.engine.restore_slot(path, slot))

    def stats(self):  # noqa: ANN201 - EngineStats
        return self.engine.stats()

    def describe(self) -> str:
        return self.engine.describe()

    def close(self) -> None:
        """Drain reads, save the usage history, stop the engine's thread; closing twice is harmless."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        try:
            self._portal.call(self._cancel_jobs())
            self._portal.call(self.engine.aclose())
        finally:
            self._portal.stop()
            _open_engines.discard(self)

    def __enter__(self) -> "SyncEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@atexit.register
def _close_open_engines() -> None:
    """At exit, before modules are torn down: close what the program left open (reads drained, history saved)."""
    for engine in list(_open_engines):
        with contextlib.suppress(Exception):
            engine.close()


def generate(prompt: Prompt, model: str | os.PathLike[str] | None = None, *, max_tokens: int = 128,
             placement: dict[str, Any] | None = None, **sampling: Any) -> Iterator[GenerationPiece]:
    """Stream one continuation of ``prompt`` (text or chat messages) piece by piece.

    Opens the model for this one call and closes it at the end (leaving the
    loop early with ``break`` closes it too); for several generations open a
    :class:`SyncEngine` once instead. ``model``: a GGUF path (default: the
    shipped model). ``placement``: keyword arguments of :meth:`Engine.open`
    (``io``, ``ram_budget``, ...). ``sampling``: ``temperature``, ``top_k``,
    ``top_p``, ``min_p``, ``seed``, ``stop``, ``chat``.

    >>> for piece in generate("The list type", max_tokens=8):
    ...     print(piece.text, end="")
    """
    with SyncEngine.open(model, **(placement or {})) as engine:
        yield from engine.generate(prompt, max_tokens=max_tokens, **sampling)
