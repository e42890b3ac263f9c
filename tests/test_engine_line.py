"""The line in front of the engine, without sockets: order, bound, leaving, and handing the turn on."""
from __future__ import annotations

import asyncio

import pytest

from colibri_aio.engine.line import QueueFull, RequestLine


async def test_turns_go_in_arrival_order_and_the_line_is_bounded() -> None:
    line = RequestLine(max_waiting=2)
    order: list[int] = []

    async def client(i: int) -> None:
        await line.acquire()
        order.append(i)
        await asyncio.sleep(0.01)
        line.release()

    await line.acquire()                      # the engine is busy
    waiting = [asyncio.create_task(client(i)) for i in range(2)]
    await asyncio.sleep(0)
    assert line.waiting == 2
    with pytest.raises(QueueFull) as full:
        await line.acquire()                  # a third waiter does not fit
    assert full.value.retry_after >= 1 and full.value.waiting == 2
    line.release()
    await asyncio.gather(*waiting)
    assert order == [0, 1]
    assert not line.busy and line.waiting == 0


async def test_no_room_to_wait_refuses_at_once() -> None:
    line = RequestLine(max_waiting=0)
    await line.acquire()
    with pytest.raises(QueueFull):
        await line.acquire()
    line.release()
    await line.acquire()                      # free again: served without waiting


async def busy_line_with_two_waiters() -> tuple[RequestLine, asyncio.Task[None], asyncio.Task[None]]:
    line = RequestLine(max_waiting=2)
    await line.acquire()
    first, second = asyncio.create_task(line.acquire()), asyncio.create_task(line.acquire())
    await asyncio.sleep(0)
    return line, first, second


async def test_a_waiter_that_leaves_gives_up_its_place() -> None:
    line, leaver, stayer = await busy_line_with_two_waiters()
    leaver.cancel()
    await asyncio.gather(leaver, return_exceptions=True)
    assert line.waiting == 1
    line.release()
    await asyncio.wait_for(stayer, 1)         # the turn skips the one who left
    line.release()
    assert not line.busy


async def test_a_turn_handed_to_a_waiter_as_it_leaves_passes_on() -> None:
    line, leaver, stayer = await busy_line_with_two_waiters()
    line.release()                            # the turn goes to the leaver's future ...
    leaver.cancel()                           # ... which is cancelled before it runs
    await asyncio.gather(leaver, return_exceptions=True)
    await asyncio.wait_for(stayer, 1)         # nothing is lost: the stayer gets the engine
    assert line.busy and line.waiting == 0
    line.release()
    assert not line.busy


def test_retry_after_grows_with_the_line_and_the_turn_time() -> None:
    line = RequestLine(max_waiting=4)
    for _ in range(20):
        line.record_turn(3.0)
    assert line.retry_after(0) == 3 and line.retry_after(3) == 12
    assert RequestLine(0).retry_after(0) == 1
