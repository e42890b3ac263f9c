"""The line in front of the engine: as many requests generate as it holds sequences, a bounded number wait.

Turns are handed out first come, first served. A waiter that leaves (its
client disconnected) gives up its place, and if it was handed the turn just
as it left, passes the turn on, so no request is lost or served twice.
"""
from __future__ import annotations

import asyncio
import math
from collections import deque


class QueueFull(Exception):
    """The line is full: the request should come back later (HTTP 429 with Retry-After)."""

    def __init__(self, waiting: int, retry_after: int) -> None:
        self.waiting, self.retry_after = waiting, retry_after
        super().__init__(f"the server is busy: {waiting} request(s) are waiting; retry in {retry_after} s")


class RequestLine:
    """At most ``capacity`` holders of the engine at a time (its sequence slots, ``--parallel``); at most
    ``max_waiting`` others wait in order.

    ``await acquire()`` returns when it is the caller's turn (or raises
    :class:`QueueFull` at once); :meth:`release` hands the place to the next.
    Runs on one event loop; :meth:`release` may be scheduled from another
    thread with ``call_soon_threadsafe``.
    """

    def __init__(self, max_waiting: int, capacity: int = 1) -> None:
        if max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.max_waiting, self.capacity = max_waiting, capacity
        self.holders = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._mean_turn_s = 1.0  # what one turn takes, for Retry-After; learnt from finished turns

    @property
    def busy(self) -> bool:
        """Every place is taken."""
        return self.holders >= self.capacity

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    async def acquire(self) -> None:
        """Wait for the turn; raise :class:`QueueFull` without waiting when the line is full."""
        if not self.busy and not self._waiters:
            self.holders += 1
            return
        if len(self._waiters) >= self.max_waiting:
            raise QueueFull(len(self._waiters), self.retry_after(len(self._waiters)))
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.release()  # handed the turn as we left: pass it on
            else:
                self._waiters.remove(turn)
            raise

    def release(self) -> None:
        """A holder is done: its place goes to the next waiter, or is free."""
        while self._waiters:
            turn = self._waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.holders -= 1

    def fail_waiting(self, exc: BaseException) -> None:
        """Every waiter gets ``exc`` instead of a turn (what they wait for is gone)."""
        while self._waiters:
            turn = self._waiters.popleft()
            if not turn.done():
                turn.set_exception(exc)

    def record_turn(self, seconds: float) -> None:
        """How long a finished turn held the engine (a moving average feeds Retry-After)."""
        self._mean_turn_s = 0.8 * self._mean_turn_s + 0.2 * max(seconds, 0.0)

    def retry_after(self, waiting: int) -> int:
        """Whole seconds until a place is likely free: the mean turn times the turns ahead of each place."""
        return max(1, min(3600, math.ceil(self._mean_turn_s * (waiting // self.capacity + 1))))
