"""Buffer pool and O_DIRECT alignment: memory and arithmetic, no disk."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from colibri_aio.io.align import ALIGN, plan_expert, slot_nbytes_for
from colibri_aio.io.pool import BufferPool
from colibri_aio.bench.locations import byte_range, random_locations
from colibri_aio.experts import ExpertLocation


def test_plan_covers_each_range_with_aligned_reads() -> None:
    rng = np.random.default_rng(1)
    for loc in random_locations(1 << 30, 200, rng, offset_align=1):
        plan = plan_expert(loc)
        assert plan.span <= slot_nbytes_for(loc.nbytes)
        previous_end = 0
        for rr, tr in zip(plan.reads, loc.ranges):
            assert rr.file_offset % ALIGN == 0 and rr.read_nbytes % ALIGN == 0 and rr.dest_offset % ALIGN == 0
            assert rr.file_offset <= tr.offset
            assert tr.offset + tr.nbytes <= rr.file_offset + rr.read_nbytes
            assert rr.view_offset - rr.dest_offset == tr.offset - rr.file_offset
            assert rr.need_nbytes == tr.offset + tr.nbytes - rr.file_offset
            assert rr.dest_offset == previous_end  # back to back in the slot, no overlap
            previous_end = rr.dest_offset + rr.read_nbytes


def test_worst_case_alignment_fits_the_slot() -> None:
    # Every range starts one byte after an alignment boundary and ends one byte past another.
    n = 3 * ALIGN - 1
    loc = ExpertLocation(0, 0, byte_range(ALIGN + 1, n), byte_range(9 * ALIGN + 1, n), byte_range(20 * ALIGN + 1, n))
    assert plan_expert(loc).span <= slot_nbytes_for(loc.nbytes)


def test_slots_are_aligned_views_of_the_arenas() -> None:
    pool = BufferPool(3 * ALIGN + 100, 5)
    try:
        assert pool.slot_nbytes % ALIGN == 0
        for slot in pool.slots:
            assert slot.address % ALIGN == 0
            assert slot.array.ctypes.data == slot.address
            arena = np.frombuffer(pool.arenas[slot.arena], np.uint8)
            assert np.shares_memory(slot.array, arena)
            slot.array[:] = slot.index  # writing through the array shows through the memoryview
            assert bytes(slot.view[:2]) == bytes([slot.index, slot.index])
    finally:
        pool.close()


def test_arenas_stay_under_the_registration_limit() -> None:
    pool = BufferPool(64 << 10, 10, arena_max=256 << 10)
    try:
        assert [len(a) for a in pool.arenas] == [256 << 10, 256 << 10, 128 << 10]
        assert pool.n_slots == 10 and [s.index for s in pool.slots] == list(range(10))
    finally:
        pool.close()
    with pytest.raises(ValueError):
        BufferPool(2 << 20, 1, arena_max=1 << 20)


def test_close_unmaps_arenas_when_no_view_is_held() -> None:
    pool = BufferPool(ALIGN, 2)
    pool.close()
    assert pool.mapping.closed


def test_slots_follow_each_other_across_arenas() -> None:
    """One stride from every slot to the next, arena boundaries included: the kernels see the pool
    as one 3-D tensor per matrix."""
    pool = BufferPool(64 << 10, 10, arena_max=256 << 10)
    try:
        assert [s.address for s in pool.slots] == [pool.address + i * pool.slot_nbytes for i in range(10)]
    finally:
        pool.close()


def vm_flags(address: int) -> set[str]:
    """The kernel's VmFlags of the mapping that holds ``address`` (``hg``: MADV_HUGEPAGE was asked for)."""
    flags: set[str] | None = None
    with open("/proc/self/smaps", encoding="ascii") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif head == "VmFlags:" and inside:
                flags = set(line.split()[1:])
    assert flags is not None, "no mapping holds the pool"
    return flags


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_pool_memory_asks_for_huge_pages_unless_told_not_to() -> None:
    for huge, expected in ((True, True), (False, False)):
        pool = BufferPool(1 << 20, 6, huge_pages=huge)
        try:
            assert pool.huge_pages is expected
            assert ("hg" in vm_flags(pool.address)) is expected
            pool.slots[5].array[:] = 7  # memory as before: every slot writable, its own bytes
            assert int(pool.slots[5].array.sum()) == 7 * pool.slot_nbytes and not pool.slots[4].array.any()
        finally:
            pool.close()
