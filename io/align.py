"""O_DIRECT alignment: where each of an expert's byte ranges lands in a pool slot.

O_DIRECT wants the buffer address, the file offset and the length aligned
(4096 covers every device here). GGUF aligns tensor data to 32 bytes only, so
each range is read as its aligned superset and the tensor's bytes start
``view_offset - dest_offset`` bytes into what was read.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from colibri_aio.experts import ExpertLocation

ALIGN = 4096
RANGES_PER_EXPERT = 3


def align_down(value: int, align: int = ALIGN) -> int:
    return value - value % align


def align_up(value: int, align: int = ALIGN) -> int:
    return -(-value // align) * align


@dataclass(frozen=True, slots=True)
class RangeRead:
    """One aligned read that covers one tensor range of an expert."""

    file_offset: int   # aligned start in the file
    read_nbytes: int   # aligned length asked of the kernel
    need_nbytes: int   # bytes that must arrive to cover the range (less than read_nbytes near EOF is fine)
    dest_offset: int   # where the read lands in the slot (aligned)
    view_offset: int   # where the range's first byte sits in the slot
    nbytes: int        # the range's own length
    range_offset: int  # the range's own (unaligned) file offset, for error messages
    file: int = 0      # which of the model's files (parts) it is read from


@dataclass(frozen=True, slots=True)
class ExpertPlan:
    """The aligned reads of one expert and the slot bytes they occupy."""

    reads: tuple[RangeRead, ...]
    span: int  # slot bytes used, a multiple of the alignment

    @property
    def read_nbytes(self) -> int:
        return sum(r.read_nbytes for r in self.reads)


@functools.lru_cache(maxsize=1 << 16)  # a model has a few thousand locations, read again and again
def plan_expert(loc: ExpertLocation, align: int = ALIGN) -> ExpertPlan:
    """Lay out the aligned supersets of ``loc``'s three ranges back to back in a slot."""
    reads = []
    dest = 0
    for rng in loc.ranges:
        start = align_down(rng.offset, align)
        end = rng.offset + rng.nbytes
        length = align_up(end, align) - start
        reads.append(RangeRead(file_offset=start, read_nbytes=length, need_nbytes=end - start,
                               dest_offset=dest, view_offset=dest + rng.offset - start,
                               nbytes=rng.nbytes, range_offset=rng.offset, file=rng.file))
        dest += length
    return ExpertPlan(tuple(reads), dest)


def slot_nbytes_for(expert_nbytes_max: int, align: int = ALIGN) -> int:
    """Slot size that fits any expert of at most ``expert_nbytes_max`` bytes, alignment slack included.

    Each range's aligned superset is at most its length plus almost two
    alignment units (one at each end), so three ranges need 6 units of slack.
    """
    return align_up(expert_nbytes_max, align) + 2 * RANGES_PER_EXPERT * align
