"""The buffer pool: fixed, page-aligned arenas cut into expert-sized slots.

Arenas are anonymous mmaps (page-aligned, so 4096-aligned), each at most
1 GiB because that is the most io_uring registers as one buffer. They are
allocated and touched once here — first touch of fresh memory is slow on
these VMs — and never grown afterwards. A slot moves through three owners:

    FREE ──acquire──► RESERVED ──submit──► KERNEL ──completion reaped──► LEASED ──release──► FREE

A slot whose read was abandoned (the waiting task was cancelled) stays
KERNEL until the completion is reaped and only then goes back to FREE: the
kernel may still be writing into it.
"""
from __future__ import annotations

import asyncio
import enum
import mmap
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from colibri_aio.io.align import ALIGN, align_up

MAX_ARENA_NBYTES = 1 << 30  # io_uring refuses to register a larger single buffer
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14


_NO_BYTES = np.empty(0, dtype=np.uint8)


class SlotState(enum.Enum):
    FREE = "free"
    RESERVED = "reserved"  # taken by a reader, not yet handed to the kernel
    KERNEL = "kernel"      # a read into it is in flight
    LEASED = "leased"      # holds bytes a consumer is using


@dataclass(eq=False, slots=True)
class Slot:
    """One expert-sized region of an arena."""

    index: int
    arena: int          # arena index == registered buffer index
    offset: int         # byte offset in the arena
    nbytes: int
    address: int        # virtual address of the slot's first byte, for io_uring
    view: memoryview    # writable view of exactly this slot
    array: np.ndarray   # the same bytes as uint8, for zero-copy tensor views
    state: SlotState = field(default=SlotState.FREE)


class PoolClosedError(RuntimeError):
    """The pool was closed while a caller waited for a slot."""


class BufferPool:
    """``n_slots`` slots of ``slot_nbytes`` bytes in <= 1 GiB page-aligned arenas."""

    def __init__(self, slot_nbytes: int, n_slots: int, *, arena_max: int = MAX_ARENA_NBYTES) -> None:
        if n_slots < 1:
            raise ValueError("the buffer pool needs at least one slot")
        slot_nbytes = align_up(slot_nbytes, ALIGN)
        if slot_nbytes > arena_max:
            raise ValueError(f"one slot of {slot_nbytes} bytes exceeds the {arena_max}-byte arena limit")
        per_arena = arena_max // slot_nbytes
        self.slot_nbytes = slot_nbytes
        self.arenas: list[mmap.mmap] = []
        self.arena_views: list[memoryview] = []
        self.arena_addresses: list[int] = []
        self.slots: list[Slot] = []
        remaining = n_slots
        while remaining:
            count = min(per_arena, remaining)
            self._add_arena(count)
            remaining -= count
        self._free: deque[Slot] = deque(self.slots)
        self._waiters: deque[asyncio.Future[Slot]] = deque()
        self._closed = False

    def _add_arena(self, count: int) -> None:
        arena = mmap.mmap(-1, count * self.slot_nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        touch(arena)
        arena_view = memoryview(arena)
        whole = np.frombuffer(arena, dtype=np.uint8)
        index = len(self.arenas)
        for i in range(count):
            start = i * self.slot_nbytes
            stop = start + self.slot_nbytes
            self.slots.append(Slot(len(self.slots), index, start, self.slot_nbytes, whole.ctypes.data + start,
                                   arena_view[start:stop], whole[start:stop]))
        self.arenas.append(arena)
        self.arena_views.append(arena_view)
        self.arena_addresses.append(whole.ctypes.data)

    @property
    def n_slots(self) -> int:
        return len(self.slots)

    @property
    def nbytes(self) -> int:
        return sum(len(a) for a in self.arenas)

    @property
    def available(self) -> int:
        """Slots free right now (not reserved, not in flight, not leased)."""
        return len(self._free)

    def count(self, state: SlotState) -> int:
        return sum(1 for s in self.slots if s.state is state)

    def try_acquire(self) -> Slot | None:
        """A free slot, or None when every slot is busy."""
        if self._closed or not self._free:
            return None
        slot = self._free.popleft()
        slot.state = SlotState.RESERVED
        return slot

    async def acquire(self) -> Slot:
        """A free slot, waiting (first come, first served) until one is released."""
        if self._closed:
            raise PoolClosedError("the buffer pool is closed")
        if self._free and not self._waiters:
            slot = self.try_acquire()
            assert slot is not None
            return slot
        waiter: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            # Handed a slot in the same tick we were cancelled: give it back.
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.release(waiter.result())
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def mark(self, slot: Slot, state: SlotState) -> None:
        slot.state = state

    def release(self, slot: Slot) -> None:
        """Return a slot; it must not be in the kernel's hands."""
        if slot.state is SlotState.KERNEL:
            raise RuntimeError(f"slot {slot.index} released while a read into it is in flight")
        if slot.state is SlotState.FREE:
            raise RuntimeError(f"slot {slot.index} released twice")
        slot.state = SlotState.FREE
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                slot.state = SlotState.RESERVED
                waiter.set_result(slot)
                return
        self._free.append(slot)

    def close(self) -> None:
        """Drop the arenas. Callers drain every read first; views still held keep their arena alive."""
        in_flight = self.count(SlotState.KERNEL)
        if in_flight:
            raise RuntimeError(f"closing the buffer pool with {in_flight} reads in flight")
        self._closed = True
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(PoolClosedError("the buffer pool is closed"))
        self._waiters.clear()
        self._free.clear()
        for slot in self.slots:
            slot.view.release()
            slot.array = _NO_BYTES  # drop this pool's own export of the arena
        for view in self.arena_views:
            view.release()
        self.arena_views.clear()
        for arena in self.arenas:
            try:
                arena.close()
            except BufferError:
                # A NumPy view of a slot is still alive (a lease not yet
                # dropped); the mapping goes when the last view goes.
                pass
        self.arenas.clear()


def touch(arena: mmap.mmap) -> None:
    """Fault every page of a fresh arena in once, now rather than per token."""
    try:
        arena.madvise(MADV_POPULATE_WRITE)
    except (OSError, ValueError):
        np.frombuffer(arena, dtype=np.uint8)[::mmap.PAGESIZE] = 0
