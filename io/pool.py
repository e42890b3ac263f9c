"""The buffer pool: fixed, page-aligned arenas cut into expert-sized slots.

The pool is one anonymous mmap (page-aligned, so 4096-aligned) cut into
arenas of at most 1 GiB, because that is the most io_uring registers as one
buffer. One mapping puts every slot at ``address + index * slot_nbytes``, so
the kernels can see the experts in the pool as one 3-D tensor per matrix (one
ggml_mul_mat_id for a layer's experts). It is allocated once here and never
grown afterwards. Its pages are populated by the reads that fill them (the
kernel faults a page in when a read first lands in it), not touched in
advance: touching 4.8 GiB page by page took 7.9 s of an 8-layer model's
start, on a thread that held the interpreter while the trunk, the tokenizer
and the kernels waited. The mapping asks for transparent huge pages
(:func:`ask_huge_pages`), so a read lands in few physically contiguous
pieces and reaches the disk as few large requests. ``populate=True`` touches every page now instead
(MADV_POPULATE_WRITE), for callers that want first-touch costs out of their
timings.

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
    """``n_slots`` slots of ``slot_nbytes`` bytes, one after another in one mapping cut into <= 1 GiB arenas."""

    def __init__(self, slot_nbytes: int, n_slots: int, *, arena_max: int = MAX_ARENA_NBYTES,
                 populate: bool = False, huge_pages: bool = True) -> None:
        if n_slots < 1:
            raise ValueError("the buffer pool needs at least one slot")
        slot_nbytes = align_up(slot_nbytes, ALIGN)
        if slot_nbytes > arena_max:
            raise ValueError(f"one slot of {slot_nbytes} bytes exceeds the {arena_max}-byte arena limit")
        per_arena = arena_max // slot_nbytes
        self.slot_nbytes = slot_nbytes
        self.mapping = mmap.mmap(-1, n_slots * slot_nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.huge_pages = huge_pages and ask_huge_pages(self.mapping)
        if populate:
            touch(self.mapping)
        self.address = np.frombuffer(self.mapping, dtype=np.uint8).ctypes.data
        self.arenas: list[memoryview] = []       # <= 1 GiB each, consecutive: the registered buffers
        self.arena_addresses: list[int] = []
        self.slots: list[Slot] = []
        whole = memoryview(self.mapping)
        for first in range(0, n_slots, per_arena):
            count = min(per_arena, n_slots - first)
            self._add_arena(whole[first * slot_nbytes: (first + count) * slot_nbytes], count)
        whole.release()

    def _add_arena(self, arena_view: memoryview, count: int) -> None:
        whole = np.frombuffer(arena_view, dtype=np.uint8)
        index = len(self.arenas)
        for i in range(count):
            start = i * self.slot_nbytes
            stop = start + self.slot_nbytes
            self.slots.append(Slot(len(self.slots), index, start, self.slot_nbytes, whole.ctypes.data + start,
                                   arena_view[start:stop], whole[start:stop]))
        self.arenas.append(arena_view)
        self.arena_addresses.append(whole.ctypes.data)

    @property
    def n_slots(self) -> int:
        return len(self.slots)

    @property
    def nbytes(self) -> int:
        return sum(len(a) for a in self.arenas)

    def close(self) -> None:
        """Drop the mapping. The reader drains every read first; views still held keep it alive."""
        for slot in self.slots:
            slot.view.release()
            slot.array = _NO_BYTES  # drop this pool's own export of the arena
        for view in self.arenas:
            try:
                view.release()
            except BufferError:  # a NumPy view of it is still alive
                pass
        self.arenas.clear()
        try:
            self.mapping.close()
        except BufferError:
            # A NumPy view of a slot is still alive (a lease not yet
            # dropped); the mapping goes when the last view goes.
            pass


def ask_huge_pages(mapping: mmap.mmap) -> bool:
    """Ask for transparent huge pages behind ``mapping``; False when the kernel has none to give.

    Why: a read's destination is cut into one segment per physically
    contiguous run of pages, and the block layer splits a read into requests
    of at most ``max_segments`` segments (254 on a virtio disk): with 4 KiB
    pages a read of more than ~1 MiB becomes several requests, and fewer,
    larger requests are what a disk like this reads fastest. A 2 MiB page is
    one segment.
    """
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return False
    try:
        mapping.madvise(advice)
    except OSError:  # a kernel without transparent huge pages
        return False
    return True


def touch(arena: mmap.mmap) -> None:
    """Fault every page of a fresh arena in once, now rather than per token."""
    try:
        arena.madvise(MADV_POPULATE_WRITE)
    except (OSError, ValueError):
        np.frombuffer(arena, dtype=np.uint8)[::mmap.PAGESIZE] = 0
