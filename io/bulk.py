"""Bulk reads at disk bandwidth: many byte ranges of one file into one page-aligned buffer.

The resident trunk is a few hundred tensors scattered between the expert
tensors (a block's attention weights, then its three stacked expert tensors,
then the next block's). Read one at a time with ``readinto`` they came in at
~280 MB/s on a disk that does ~1.5 GB/s. Here the ranges are merged where
the gap between them is small, cut into large aligned reads, and ``depth`` of
them are in flight at once from worker threads (``preadv`` releases the GIL),
with O_DIRECT where the file system allows it: the page cache gains nothing
from bytes that are copied into RAM once.

The buffer is an anonymous mapping that nothing touches before the reads:
each page is faulted in by the read that fills it, in the worker that does
the read, instead of page by page in advance. It asks for transparent huge
pages: the trunk is streamed once per decoded token, and on 2 MiB pages its
TLB misses go (decode x1.044 on the 8-layer cut, evidence/decode_20261202T034250Z.md;
``COLIBRI_TRUNK_HUGE_PAGES=off`` keeps 4 KiB pages, the A/B).
"""
from __future__ import annotations

import bisect
import concurrent.futures
import mmap
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from colibri_aio.errors import ModelFormatError
from colibri_aio.io.align import ALIGN, align_down, align_up
from colibri_aio.io.modelfile import ModelFile
from colibri_aio.io.pool import ask_huge_pages

CHUNK_NBYTES = 8 << 20   # one read: large enough for the disk to stream, small enough to spread over workers
DEPTH = 8                # reads in flight
MERGE_GAP = 1 << 20      # ranges closer than this are read as one span (the gap is read and ignored)


@dataclass(frozen=True, slots=True)
class Span:
    """One aligned stretch of the file read into the buffer at ``dest``."""

    file_offset: int
    nbytes: int
    dest: int


@dataclass(frozen=True, slots=True)
class BulkStats:
    nbytes: int        # bytes asked of the disk (spans, gaps and alignment included)
    wanted: int        # bytes of the ranges themselves
    reads: int
    seconds: float
    direct: bool

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds if self.seconds else 0.0


def total_stats(parts: Sequence[BulkStats]) -> BulkStats | None:
    """Several files' bulk reads (one after the other) as one; None for none."""
    if not parts:
        return None
    return BulkStats(sum(p.nbytes for p in parts), sum(p.wanted for p in parts), sum(p.reads for p in parts),
                     sum(p.seconds for p in parts), all(p.direct for p in parts))


def plan_spans(ranges: Sequence[tuple[int, int]], merge_gap: int = MERGE_GAP) -> list[Span]:
    """Aligned spans covering every ``(offset, nbytes)`` range, merged where they lie within ``merge_gap``."""
    spans: list[Span] = []
    start = end = -1
    dest = 0
    for offset, nbytes in sorted(r for r in ranges if r[1] > 0):
        lo, hi = align_down(offset), align_up(offset + nbytes)
        if start >= 0:
            if lo <= end + merge_gap:
                end = max(end, hi)
                continue
            spans.append(Span(start, end - start, dest))
            dest += end - start
        start, end = lo, hi
    if start >= 0:
        spans.append(Span(start, end - start, dest))
    return spans


def _chunks(spans: Sequence[Span], chunk: int) -> list[Span]:
    """The spans cut into reads of at most ``chunk`` bytes (aligned, as the spans are)."""
    out = []
    for s in spans:
        for at in range(0, s.nbytes, chunk):
            out.append(Span(s.file_offset + at, min(chunk, s.nbytes - at), s.dest + at))
    return out


def read_ranges(path: str | os.PathLike[str], ranges: Sequence[tuple[int, int]], *, chunk: int = CHUNK_NBYTES,
                depth: int = DEPTH, direct: bool = True, huge_pages: bool = True,
                progress: Callable[[int, int], None] | None = None) -> tuple[list[np.ndarray], BulkStats]:
    """The bytes of every ``(offset, nbytes)`` range of ``path``, as uint8 views of one buffer, in order.

    A range that reaches past the end of the file is a
    :class:`~colibri_aio.errors.ModelFormatError` (the file is truncated).
    ``progress(done, total)`` hears of each read that lands (reads done, reads in all).
    """
    file = ModelFile.open(path, direct=direct)
    try:
        for offset, nbytes in ranges:
            if offset + nbytes > file.size:
                raise ModelFormatError(f"{file.path}: bytes {offset}..{offset + nbytes} lie beyond the end of the "
                                       f"{file.size}-byte file (truncated)")
        spans = plan_spans(ranges)
        total = sum(s.nbytes for s in spans)
        buffer = mmap.mmap(-1, max(total, ALIGN), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge_pages:     # streamed once per token: TLB misses showed (COLIBRI_TRUNK_HUGE_PAGES)
            ask_huge_pages(buffer)
        reads = _chunks(spans, chunk)
        t0 = time.perf_counter()
        with memoryview(buffer) as view:
            def read(s: Span) -> None:
                got = os.preadv(file.fd, [view[s.dest: s.dest + s.nbytes]], s.file_offset)
                # Only the aligned tail past the end of the file may be missing.
                if got < s.nbytes and s.file_offset + got < file.size:
                    raise ModelFormatError(f"{file.path}: read {got} of {s.nbytes} bytes at offset "
                                           f"{s.file_offset} (the file has {file.size})")

            with concurrent.futures.ThreadPoolExecutor(max(1, min(depth, len(reads))),
                                                       thread_name_prefix="colibri-bulk") as pool:
                done = 0
                for landed in concurrent.futures.as_completed([pool.submit(read, r) for r in reads]):
                    landed.result()
                    if progress is not None:
                        done += 1
                        progress(done, len(reads))
        seconds = time.perf_counter() - t0
    finally:
        file.close()
    whole = np.frombuffer(buffer, np.uint8)
    starts = [s.file_offset for s in spans]
    out = []
    for offset, nbytes in ranges:
        if nbytes == 0:
            out.append(whole[:0])
            continue
        s = spans[bisect.bisect_right(starts, offset) - 1]
        at = s.dest + offset - s.file_offset
        out.append(whole[at: at + nbytes])
    return out, BulkStats(total, sum(n for _, n in ranges), len(reads), seconds, file.direct)
