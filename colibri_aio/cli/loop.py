"""The event loop a command's coroutine runs on, and SIGTERM inside it."""
from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Coroutine
from typing import Any


class Terminated(BaseException):
    """SIGTERM arrived: stop like Ctrl-C does (a BaseException so that nothing swallows it)."""


def run_loop(coro: Coroutine[Any, Any, int]) -> int:
    """Run ``coro`` on uvloop where it is installed (it is on Linux and macOS), else asyncio's loop.

    SIGTERM cancels it the way asyncio cancels it on Ctrl-C, so the same
    clean-up runs (``async with`` exits: reads drained, history saved); then
    :class:`Terminated` is raised. A second SIGTERM during that clean-up is
    ignored, so the clean-up is never cut short.
    """
    terminated = False

    async def main_task():
        loop, task = asyncio.get_running_loop(), asyncio.current_task()

        def terminate() -> None:
            nonlocal terminated
            if not terminated and task is not None:
                terminated = True
                task.cancel()

        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):  # not the main thread
            loop.add_signal_handler(signal.SIGTERM, terminate)
        try:
            return await coro
        finally:
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                loop.remove_signal_handler(signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    try:
        try:
            import uvloop
        except ImportError:
            status = asyncio.run(main_task())
        else:
            status = uvloop.run(main_task())
    except asyncio.CancelledError:
        if terminated:
            raise Terminated from None
        raise
    finally:
        with contextlib.suppress(ValueError, TypeError):
            signal.signal(signal.SIGTERM, before)
    if terminated:
        raise Terminated
    return status
