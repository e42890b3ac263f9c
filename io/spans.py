"""Coalesced expert reads: neighbouring experts of one layer read with one request per projection.

In a GGUF the experts of one ``ffn_*_exps`` tensor follow each other, so
experts ``x`` and ``x + 1`` of a layer are neighbours in each of the three
tensors: a run of consecutive experts is three long stretches of the file.
Each stretch is read with one vectored read whose segments land in the
run's slots, each expert's bytes where :func:`~colibri_aio.io.align.plan_expert`
puts them. That is what the warm start streams and how a prefill's union
of experts is read (few large requests instead of three per expert).

O_DIRECT reads whole aligned blocks, and where an expert's range ends inside
a block the next expert's range begins in that same block. The read gives
that block to the later expert's slot; after the read it is copied into the
earlier slot as well (a :class:`Fixup`, one block per boundary).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from colibri_aio.experts import ExpertLocation
from colibri_aio.io.align import ALIGN, ExpertPlan

MAX_RUN = 64  # experts per run: bounds the iovec of one read (IOV_MAX is 1024)


@dataclass(frozen=True, slots=True)
class Segment:
    """``nbytes`` of the read land at ``dest_offset`` in the slot of run member ``member``."""

    member: int
    dest_offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Fixup:
    """After the read, copy ``nbytes`` from member ``src`` (at ``src_offset`` in its slot) to member ``dst``."""

    src: int
    src_offset: int
    dst: int
    dst_offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class SpanRead:
    """One projection of a run of experts: one aligned read of the file, scattered into their slots."""

    projection: int                  # 0 gate, 1 up, 2 down
    file: int                        # which of the model's files (parts) it is read from
    file_offset: int
    segments: tuple[Segment, ...]    # in file order, back to back
    fixups: tuple[Fixup, ...]
    need_end: int                    # file offset up to which bytes must arrive (the last range's end)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)


def adjacent(a: ExpertLocation, b: ExpertLocation) -> bool:
    """Whether ``b``'s three ranges start where ``a``'s end, in the same file (so one read per projection
    covers both)."""
    return all(ra.file == rb.file and ra.offset + ra.nbytes == rb.offset for ra, rb in zip(a.ranges, b.ranges))


def runs(locs: Sequence[ExpertLocation], plans: Sequence[ExpertPlan], max_run: int = MAX_RUN) -> list[list[int]]:
    """Indices of ``locs`` grouped into runs of neighbours, in file order.

    An expert joins the run before it when it is that run's last expert's
    neighbour and each of its ranges spans at least two aligned blocks (so a
    shared boundary block never swallows a whole range).
    """
    order = sorted(range(len(locs)), key=lambda i: (locs[i].gate.file, locs[i].gate.offset))
    out: list[list[int]] = []
    for i in order:
        run = out[-1] if out else None
        if (run is not None and len(run) < max_run and adjacent(locs[run[-1]], locs[i])
                and all(r.read_nbytes >= 2 * ALIGN for r in plans[i].reads)
                and all(r.read_nbytes >= 2 * ALIGN for r in plans[run[-1]].reads)):
            run.append(i)
        else:
            out.append([i])
    return out


def plan_span(plans: Sequence[ExpertPlan], projection: int) -> SpanRead:
    """The read of ``projection`` for a run whose members' plans are ``plans`` (neighbours, in file order)."""
    reads = [p.reads[projection] for p in plans]
    segments: list[Segment] = []
    fixups: list[Fixup] = []
    for i, rr in enumerate(reads):
        length = rr.read_nbytes
        if i + 1 < len(reads):
            overlap = rr.file_offset + rr.read_nbytes - reads[i + 1].file_offset  # 0 or one block
            if overlap:
                length -= overlap
                fixups.append(Fixup(i + 1, reads[i + 1].dest_offset, i, rr.dest_offset + length, overlap))
        segments.append(Segment(i, rr.dest_offset, length))
    last = reads[-1]
    return SpanRead(projection, reads[0].file, reads[0].file_offset, tuple(segments), tuple(fixups),
                    last.file_offset + last.need_nbytes)
