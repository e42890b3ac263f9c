"""The io_uring reactor: a ring (:mod:`colibri_aio.io.ring`) whose completions wake the running asyncio loop
through an eventfd.

Reads are submitted with a ``user_data`` token; a table maps the token to the
completion callback that waits for it, the ``Iovec`` the kernel
writes through (it must outlive the read) and the bytes it accounts for. A one-piece read into a
registered buffer needs no iovec at all (``READ_FIXED``, Linux 5.1); a read in several pieces into one
is ``READV_FIXED`` where the kernel has it (6.15), else a plain ``READV``. The eventfd is registered
with the ring and watched with ``loop.add_reader``; eventfd wake-ups coalesce,
so every wake-up drains the completion queue until it is empty.

:meth:`UringReactor.submit` hands its reads to the kernel before it returns
(one ``io_uring_submit`` for the reads of one call), so a caller that goes on
computing without yielding to the loop still overlaps them. In-flight reads
are bounded by the ring size and by bytes; reads over the bound wait in a FIFO
and are submitted as completions free room.
"""
from __future__ import annotations

import asyncio
import errno
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from colibri_aio.io.ring import (IORING_OP_READ_FIXED, IORING_OP_READV, IORING_OP_READV_FIXED, IOSQE_ASYNC, Iovecs,
                                 Ring)

DEFAULT_RING_ENTRIES = 256
DEFAULT_MAX_INFLIGHT_BYTES = 512 << 20


class ReactorClosedError(RuntimeError):
    """A read was asked of a reactor that is closing or closed."""


@dataclass(eq=False, slots=True)
class RingRead:
    """One (vectored) read for the ring: the file bytes at ``offset`` of ``fd``, in order, into ``segments``."""

    fd: int
    segments: tuple[tuple[int, int], ...]  # (address, nbytes) where the bytes go, back to back in the file
    offset: int             # file offset
    buf_index: int | None   # registered buffer holding every segment, or None for a plain readv
    on_complete: Callable[[int], None]  # called once with bytes read or -errno, from the loop
    iovec: Iovecs | None = None  # alive (and not reused) until the completion is reaped
    nbytes: int = 0         # set from the segments

    def __post_init__(self) -> None:
        self.nbytes = sum(n for _, n in self.segments)


class UringReactor:
    """An io_uring ring driven by the running event loop.

    ``submit`` calls back with the raw result, bytes read (>= 0) or
    ``-errno``, once the completion is reaped. A read cannot be taken back:
    the kernel keeps writing into the destination until the completion is
    reaped, and the destination's owner waits for the callback (or
    :meth:`drained`) before reusing the memory.
    """

    def __init__(self, ring: Ring, eventfd: int, loop: asyncio.AbstractEventLoop,
                 max_inflight_bytes: int, punt: bool = False) -> None:
        self._ring: Ring | None = ring
        # IOSQE_ASYNC: the kernel's worker threads issue each read, so io_uring_submit returns at once
        # instead of doing the block-layer work (and the first faults of the destination pages) inline.
        self._sqe_flags = IOSQE_ASYNC if punt else 0
        self.entries = ring.entries  # what the kernel granted (it clamps a larger ask)
        self._readv_fixed = False
        self._eventfd = eventfd
        self._loop = loop
        self.max_inflight_bytes = max_inflight_bytes
        self.registered = False
        self._table: dict[int, RingRead] = {}
        self._pending: deque[RingRead] = deque()
        self._next_token = 1
        self._inflight_bytes = 0
        self._resubmit = False    # SQEs left in the ring by a submit the kernel refused for now
        self._closing = False
        self._broken: BaseException | None = None
        self._idle = asyncio.Event()  # set while nothing is in the kernel or queued for it
        self._idle.set()
        self._iovecs = [Iovecs() for _ in range(self.entries)]  # one per possible in-flight read
        self.submits = 0          # io_uring_submit calls
        self.completions = 0
        self.busy_s = 0.0         # time with at least one read in the kernel
        self._busy_since = 0.0
        loop.add_reader(eventfd, self._on_wake)

    @classmethod
    def create(cls, entries: int = DEFAULT_RING_ENTRIES,
               max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES, punt: bool = False) -> "UringReactor":
        """Set up a ring on the running loop; raises OSError (or RuntimeError) when io_uring is unavailable.
        ``punt``: every read goes to the kernel's io-wq workers (IOSQE_ASYNC) instead of being issued inline."""
        loop = asyncio.get_running_loop()
        ring = Ring(entries)
        eventfd = -1
        try:
            eventfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            ring.register_eventfd(eventfd)
        except BaseException:
            if eventfd >= 0:
                os.close(eventfd)
            ring.close()
            raise
        return cls(ring, eventfd, loop, max_inflight_bytes, punt)

    # -- registration -------------------------------------------------------

    def register_buffers(self, buffers: list[tuple[int, int]]) -> None:
        """Register ``(address, nbytes)`` arenas as fixed buffers (index = position); raises OSError if refused."""
        assert self._ring is not None
        self._ring.register_buffers(buffers)
        self._readv_fixed = IORING_OP_READV_FIXED in self._ring.supported_ops()
        self.registered = True

    # -- submission ---------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Reads the kernel owns: submitted and not yet reaped."""
        return len(self._table)

    @property
    def queued(self) -> int:
        """Reads waiting for room in the ring or under the byte bound."""
        return len(self._pending)

    def submit(self, *reads: RingRead) -> None:
        """Hand ``reads`` to the kernel now (those the bounds admit; the rest queue in order).

        Each read's ``on_complete(res)`` runs on the loop once its completion
        is reaped; until then the caller keeps the destination mapped and unused.
        """
        if self._broken is not None:
            raise ReactorClosedError(f"the io_uring reactor failed: {self._broken}")
        if self._closing:
            raise ReactorClosedError("the io_uring reactor is closing")
        for read in reads:
            if not self.registered:
                read.buf_index = None
            self._pending.append(read)
        self._idle.clear()
        self._flush()

    def _has_room(self, request: RingRead) -> bool:
        if len(self._table) >= self.entries:
            return False
        # One read larger than the byte bound still goes alone, or it would never go.
        return not self._table or self._inflight_bytes + request.nbytes <= self.max_inflight_bytes

    def _flush(self) -> None:
        """Move queued reads into the ring, as many as the bounds allow, and submit them together."""
        if self._broken is not None:
            return
        prepared = 0
        ring = self._ring
        assert ring is not None
        while self._pending and self._has_room(self._pending[0]) and ring.space() > 0:
            self._prepare(ring, self._pending.popleft())
            prepared += 1
        if prepared:
            self._submit()

    def _prepare(self, ring: Ring, request: RingRead) -> None:
        token = self._next_token
        self._next_token += 1
        count = len(request.segments)
        if request.buf_index is not None and count == 1:  # straight into the registered buffer: no iovec
            address, nbytes = request.segments[0]
            ring.prep(IORING_OP_READ_FIXED, request.fd, address, nbytes, request.offset, token,
                      buf_index=request.buf_index, flags=self._sqe_flags)
        else:
            # One-piece reads reuse the ring's iovecs; a coalesced read has its own for as long as it is in flight.
            request.iovec = self._iovecs.pop() if count == 1 else Iovecs(count)
            for index, (address, nbytes) in enumerate(request.segments):
                request.iovec.point(index, address, nbytes)
            fixed = request.buf_index is not None and self._readv_fixed
            ring.prep(IORING_OP_READV_FIXED if fixed else IORING_OP_READV, request.fd, request.iovec.address,
                      count, request.offset, token, buf_index=request.buf_index or 0, flags=self._sqe_flags)
        if not self._table:
            self._busy_since = time.perf_counter()
        self._table[token] = request
        self._inflight_bytes += request.nbytes

    def _submit(self) -> None:
        while True:
            try:
                assert self._ring is not None
                self._ring.submit()
                self.submits += 1
                return
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EBUSY) and self._table:
                    # The kernel is short of room; the SQEs stay queued in the
                    # ring and go with the next submit, after completions drain.
                    self._resubmit = True
                    return
                self._fail(exc)
                return

    def _fail(self, exc: BaseException) -> None:
        """The ring can no longer be trusted: every waiter learns why; nothing is submitted again."""
        self._broken = exc
        unsent, self._pending = self._pending, deque()
        for request in unsent:  # never reached the kernel: nothing of theirs is in flight
            request.on_complete(-(getattr(exc, "errno", None) or errno.EIO))
        self._wake_idle()

    # -- completion ---------------------------------------------------------

    def _on_wake(self) -> None:
        try:
            os.eventfd_read(self._eventfd)
        except BlockingIOError:
            pass
        self.drain()

    def drain(self) -> int:
        """Reap every completion that is ready; returns how many.

        The room the completions free goes to queued reads (one submit)
        before any completion callback runs, so the device's queue is
        refilled without waiting for the callbacks, or for the tasks they wake.
        """
        if self._ring is None:
            return 0
        total = 0
        finished: list[tuple[RingRead, int]] = []
        for token, res in self._ring.completions():
            total += 1
            request = self._release(token)
            if request is not None:
                finished.append((request, res))
        if total:
            self.completions += total
            if self._resubmit:
                self._resubmit = False
                self._submit()
            if self._pending:
                self._flush()
            for request, res in finished:
                self._deliver(request, res)
            self._wake_idle()
        return total

    def _release(self, token: int) -> RingRead | None:
        """The kernel is done with the read behind ``token``: its room in the ring and its iovec are free again."""
        request = self._table.pop(token, None)
        if request is None:
            return None
        self._inflight_bytes -= request.nbytes
        if request.iovec is not None and request.iovec.count == 1:
            self._iovecs.append(request.iovec)
        request.iovec = None
        if not self._table:
            self.busy_s += time.perf_counter() - self._busy_since
        return request

    def _deliver(self, request: RingRead, res: int) -> None:
        try:
            request.on_complete(res)
        except Exception as exc:  # a broken callback must not stop the others: their waiters would hang
            self._loop.call_exception_handler({"message": "io_uring completion callback failed", "exception": exc})

    def _wake_idle(self) -> None:
        if not self._table and not self._pending:
            self._idle.set()

    async def drained(self) -> None:
        """Wait until no read is in the kernel or queued for it."""
        await self._idle.wait()

    # -- shutdown -----------------------------------------------------------

    async def aclose(self) -> None:
        """Stop taking reads, wait for every read the kernel owns, then tear the ring down."""
        if self._ring is None:
            return
        self._closing = True
        await self.drained()
        self._loop.remove_reader(self._eventfd)
        ring, self._ring = self._ring, None
        ring.close()  # also unregisters the buffers and the eventfd
        os.close(self._eventfd)
