"""The engine's background work has one owner: nothing outlives the engine, and no failure is lost."""
from __future__ import annotations

import asyncio
import threading

import pytest

from colibri_aio.engine.engine import Engine
from colibri_aio.engine.tasks import EngineTasks
from colibri_aio.errors import UserError

from support import fixture


def _others() -> set[asyncio.Task]:
    return asyncio.all_tasks() - {asyncio.current_task()}


async def test_close_cancels_what_still_runs_and_leaves_no_task() -> None:
    tasks = await EngineTasks.start()
    forever = tasks.spawn(asyncio.Event().wait())
    await asyncio.sleep(0)
    await tasks.aclose()
    assert forever.cancelled() and not _others()
    await tasks.aclose()  # twice: harmless
    with pytest.raises(RuntimeError, match="closed"):
        tasks.spawn(asyncio.sleep(0))


async def test_a_failure_is_raised_at_close_as_itself() -> None:
    tasks = await EngineTasks.start()

    async def fail() -> None:
        raise OSError("the device went away")

    sibling = tasks.spawn(asyncio.Event().wait())
    tasks.spawn(fail())
    await asyncio.sleep(0.01)
    assert sibling.cancelled()  # the group stopped the others at once
    with pytest.raises(OSError, match="went away"):
        await tasks.aclose()
    assert not _others()


async def test_a_failure_the_caller_already_raises_is_not_raised_again(capsys) -> None:
    """An open that failed raises its own error; another failure of the group is said, not dropped."""
    async def fail(exc: BaseException) -> None:
        raise exc

    failure = ValueError("the trunk is short")
    for raising, said in ((failure, False), (UserError("budget too small"), True)):
        tasks = await EngineTasks.start()
        tasks.spawn(fail(failure))
        await asyncio.sleep(0.01)
        await tasks.aclose(raising=raising)
        heard = capsys.readouterr()  # stderr, or stdout where another test configured structlog
        assert ("failed too: ValueError: the trunk is short" in heard.err + heard.out) == said


async def test_a_cancelled_thread_task_ends_with_its_thread_and_keeps_its_result() -> None:
    tasks = await EngineTasks.start()
    release, finished = threading.Event(), threading.Event()

    def work() -> str:
        release.wait(10)
        finished.set()
        return "opened"

    thread = tasks.thread(work)
    await asyncio.sleep(0.01)
    thread.cancel()
    await asyncio.sleep(0.01)
    assert not thread.done()  # a thread cannot be stopped: its task waits for it
    release.set()
    await asyncio.wait([thread])
    assert finished.is_set() and thread.result() == "opened"
    await tasks.aclose()
    assert not _others()


async def test_an_open_that_fails_leaves_no_task_and_raises_its_own_error() -> None:
    with pytest.raises(UserError, match="too small"):
        await Engine.open(fixture("tiny_q8_0.gguf"), ram_budget="1M", history=False)
    assert not _others()


async def test_a_closed_engine_leaves_no_task() -> None:
    """The device watch (where the model's file is on a block device) runs in the group until close."""
    engine = await Engine.open(fixture("tiny_q8_0.gguf"), io="pread", history=False)
    names = {t.get_name() for t in _others()}
    assert "colibri-aio engine tasks" in names and ("device monitor" in names) == (engine.device is not None)
    await engine.aclose()
    assert not _others()
