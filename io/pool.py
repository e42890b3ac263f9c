"""The buffer pool: fixed, page-aligned arenas cut into expert-sized slots.

Arenas are anonymous mmaps (page-aligned, so 4096-aligned), each at most
1 GiB because that is the most io_uring registers as one buffer. They are
allocated once here and never grown afterwards. Their pages are populated by
the reads that fill them (the kernel faults a page in when a read first
lands in it), not touched in advance: touching 4.8 GiB page by page took
7.9 s of an 8-layer model's start, on a thread that held the interpreter
while the trunk, the tokenizer and the kernels waited. ``populate=True``
touches every page now instead (MADV_POPULATE_WRITE), for callers that
want first-touch costs out of their timings.

The pool only owns the memory. Slot ``i`` is the expert cache's slot ``i``:
which expert a slot holds, and which slot a read may use, is decided by one
allocator, :class:`~colibri_aio.policy.cache.ExpertCache`; whether the kernel
is still writing into a slot is the reader's to know
(:meth:`~colibri_aio.io.reader.ExpertReader.in_kernel`), and it drains every
read before the pool is closed.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from colibri_aio.io.align import ALIGN, align_up

MAX_ARENA_NBYTES = 1 << 30  # io_uring refuses to register a larger single buffer
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14


_NO_BYTES = np.empty(0, dtype=np.uint8)


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


class BufferPool:
    """``n_slots`` slots of ``slot_nbytes`` bytes in <= 1 GiB page-aligned arenas."""

    def __init__(self, slot_nbytes: int, n_slots: int, *, arena_max: int = MAX_ARENA_NBYTES,
                 populate: bool = False) -> None:
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
            self._add_arena(count, populate)
            remaining -= count

    def _add_arena(self, count: int, populate: bool) -> None:
        arena = mmap.mmap(-1, count * self.slot_nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if populate:
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

    def close(self) -> None:
        """Drop the arenas. The reader drains every read first; views still held keep their arena alive."""
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
