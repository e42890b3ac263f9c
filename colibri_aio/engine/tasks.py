"""The engine's background work, owned by one :class:`asyncio.TaskGroup` from open to close.

Besides the calls it serves, an engine runs the worker threads that read its
trunk, load its kernels and build its tokenizer while it opens
(:mod:`colibri_aio.engine.opening`), and then the monitor that samples its
disk (:mod:`colibri_aio.engine.device`). They are all tasks of one group,
entered when the engine starts opening and exited when it closes: none
outlives the engine, and what failed among them is raised when it closes
(or by the open that was waiting for it) instead of being lost.

The group runs in a task of its own. A ``TaskGroup`` belongs to the task that
entered it (it cancels that task when a child fails, and must be exited there),
while an engine is opened by one task and used and closed by others: a
:class:`~colibri_aio.SyncEngine`'s calls, a server's requests.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from colibri_aio.logs import get_logger

log = get_logger("colibri_aio.engine")

T = TypeVar("T")


async def _thread_outcome(future: asyncio.Future[T]) -> T:
    """What the worker thread behind ``future`` returns or raises, cancelled or not.

    A thread cannot be stopped: cancelling the task that waits for it only
    waits until it ends, so that nothing it does outlives the group and a
    result that must be released (opened kernels) reaches whoever cleans up.
    """
    while True:
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if future.cancelled():  # the executor itself gave it up: there is nothing left to wait for
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # declined: the task ends with the thread, just below


class EngineTasks:
    """One engine's background tasks and worker threads: start with :meth:`start`, end with :meth:`aclose`."""

    def __init__(self) -> None:
        self._group: asyncio.TaskGroup | None = None
        self._owner: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls) -> EngineTasks:
        """A running group, its owner task on the running loop."""
        tasks = cls()
        loop = asyncio.get_running_loop()
        entered: asyncio.Future[None] = loop.create_future()
        tasks._owner = loop.create_task(tasks._own(entered), name="colibri-aio engine tasks")
        try:
            await entered
        except BaseException:
            tasks._owner.cancel()
            raise
        return tasks

    async def _own(self, entered: asyncio.Future[None]) -> None:
        async with asyncio.TaskGroup() as group:
            self._group = group
            if not entered.done():
                entered.set_result(None)
            # Until aclose cancels this task, or the group does because a child failed; either way
            # leaving the block cancels the children still running and waits for them.
            await asyncio.get_running_loop().create_future()

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str | None = None) -> asyncio.Task[T]:
        """Run ``coro`` as a task of the group until it ends or the group closes."""
        if self._group is None or self._owner is None or self._owner.done():
            coro.close()
            raise RuntimeError("the engine's tasks are closed")
        try:
            return self._group.create_task(coro, name=name)
        except RuntimeError:  # the group is winding down after a failure
            coro.close()
            raise

    def thread(self, func: Callable[..., T], *args: Any, name: str | None = None) -> asyncio.Task[T]:
        """Call ``func(*args)`` in a worker thread, started now, as a task of the group.

        The task ends when the thread does, with its result or its error,
        even when cancelled (see :func:`_thread_outcome`).
        """
        if self._group is None or self._owner is None or self._owner.done():
            raise RuntimeError("the engine's tasks are closed")
        future = asyncio.get_running_loop().run_in_executor(None, func, *args)
        return self.spawn(_thread_outcome(future), name=name)

    async def aclose(self, *, raising: BaseException | None = None) -> None:
        """Cancel the tasks still running, wait for every one (threads to their end), exit the group; then
        raise what failed in it, one failure as itself, several as an exception group.

        ``raising``: the exception the caller is on its way to raise (an open
        that failed, often because of a task of the group): it is not raised
        again here, and any other failure is logged instead of hiding it.
        Closing twice is harmless.
        """
        owner, self._owner = self._owner, None
        if owner is None:
            return
        owner.cancel()
        await asyncio.wait([owner])
        if owner.cancelled():
            return
        error = owner.exception()
        if error is None:
            return
        failures = list(error.exceptions) if isinstance(error, BaseExceptionGroup) else [error]
        if raising is not None:
            for failure in failures:
                if failure is not raising:
                    log.warning(f"engine task failed too: {type(failure).__name__}: {failure}")
            return
        if len(failures) == 1:
            raise failures[0]
        raise error
