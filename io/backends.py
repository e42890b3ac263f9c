"""Three ways to get an expert's bytes, behind one interface.

- ``uring``: io_uring reads (registered buffers when allowed) into a pool slot.
- ``pread``: the same reads from a thread pool, for kernels without io_uring.
- ``mmap``: no pool at all; views of a shared read-only mapping of the file,
  faulted in from a worker thread. The page cache decides what stays, as in
  llama.cpp.

A model may be in several files (the parts of a split GGUF): each backend
holds all of them, and each range is read from the file its ``file`` index names.

``start`` hands the reads to the kernel (or queues them for a worker) before
it returns, and calls ``on_done`` exactly once, when every range's read is
over (the kernel or the worker thread no longer touches the slot), with the
three uint8 views of the expert's tensors or with an ExpertReadError. It
cannot be called off: a reader whose waiter went away still waits for
``on_done`` before the slot can be reused.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import mmap
import os
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from colibri_aio.errors import ExpertReadError
from colibri_aio.experts import PROJECTIONS, ExpertLocation
from colibri_aio.io.align import ExpertPlan, RangeRead, align_down
from colibri_aio.io.modelfile import ModelFile
from colibri_aio.io.pool import Slot
from colibri_aio.io.uring import RingRead, UringReactor

ExpertBytes = tuple[np.ndarray, np.ndarray, np.ndarray]
OnDone = Callable[["ExpertBytes | ExpertReadError"], None]
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14


class ReadBackend(Protocol):
    """How one expert's aligned range reads reach memory."""

    name: str
    uses_pool: bool

    def start(self, loc: ExpertLocation, plan: ExpertPlan, slot: Slot | None, on_done: OnDone) -> None: ...

    async def aclose(self) -> None: ...


class ExpertRead:
    """Gathers the outcomes of one expert's range reads into one ``on_done`` call.

    ``on_done`` runs only when every range has reported, so a failure of one
    range never hands the slot back while another range is still being
    written into it.
    """

    __slots__ = ("files", "loc", "plan", "views", "on_done", "_outstanding", "_error")

    def __init__(self, files: Sequence[ModelFile], loc: ExpertLocation, plan: ExpertPlan, views: ExpertBytes,
                 on_done: OnDone) -> None:
        self.files, self.loc, self.plan, self.views, self.on_done = files, loc, plan, views, on_done
        self._outstanding = len(plan.reads)
        self._error: ExpertReadError | None = None

    def range_done(self, index: int, outcome: int | BaseException) -> None:
        """Record range ``index``'s result: bytes read, ``-errno``, or the exception a worker raised."""
        rr = self.plan.reads[index]
        reason = _failure(rr, outcome)
        if reason is not None and self._error is None:
            self._error = ExpertReadError(
                self.files[rr.file].path, rr.range_offset, rr.nbytes, self.loc.layer, self.loc.expert,
                f"{reason} ({PROJECTIONS[index]} range; aligned read of {rr.read_nbytes} bytes at {rr.file_offset})")
        self._outstanding -= 1
        if self._outstanding == 0:
            self.on_done(self.views if self._error is None else self._error)


def _failure(rr: RangeRead, outcome: int | BaseException) -> str | None:
    """Why a range read failed, or None when it delivered every byte it must."""
    if isinstance(outcome, OSError) and outcome.errno:
        outcome = -outcome.errno
    if isinstance(outcome, BaseException):
        return f"{type(outcome).__name__}: {outcome}"
    if outcome < 0:
        code = -outcome
        return f"{errno.errorcode.get(code, code)}: {os.strerror(code)}"
    if outcome < rr.need_nbytes:
        return f"short read: got {outcome} of {rr.need_nbytes} bytes (end of file?)"
    return None


def slot_views(plan: ExpertPlan, slot: Slot) -> ExpertBytes:
    """The three tensors' bytes inside a slot (views, no copy)."""
    a = slot.array
    g, u, d = (a[r.view_offset: r.view_offset + r.nbytes] for r in plan.reads)
    return g, u, d


def slot_dest(rr: RangeRead, slot: Slot) -> memoryview:
    """Where the aligned read for ``rr`` lands in the slot."""
    return slot.view[rr.dest_offset: rr.dest_offset + rr.read_nbytes]


class UringBackend:
    """io_uring reads into pool slots; fixed-buffer reads when the arenas are registered."""

    name = "uring"
    uses_pool = True

    def __init__(self, reactor: UringReactor, files: Sequence[ModelFile]) -> None:
        self.reactor = reactor
        self.files = files

    def start(self, loc: ExpertLocation, plan: ExpertPlan, slot: Slot | None, on_done: OnDone) -> None:
        assert slot is not None
        op = ExpertRead(self.files, loc, plan, slot_views(plan, slot), on_done)
        self.reactor.submit(*(RingRead(self.files[rr.file].fd, slot.address + rr.dest_offset, rr.read_nbytes, rr.file_offset,
                                       slot.arena, lambda res, i=index: op.range_done(i, res))
                              for index, rr in enumerate(plan.reads)))

    async def aclose(self) -> None:
        await self.reactor.aclose()


class PreadBackend:
    """``os.preadv`` from worker threads into pool slots (the GIL is released while a read waits)."""

    name = "pread"
    uses_pool = True

    def __init__(self, files: Sequence[ModelFile], threads: int = 8) -> None:
        self.files = files
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="colibri-pread")

    def start(self, loc: ExpertLocation, plan: ExpertPlan, slot: Slot | None, on_done: OnDone) -> None:
        assert slot is not None
        loop = asyncio.get_running_loop()
        op = ExpertRead(self.files, loc, plan, slot_views(plan, slot), on_done)
        for index, rr in enumerate(plan.reads):
            job = self._pool.submit(os.preadv, self.files[rr.file].fd, [slot_dest(rr, slot)], rr.file_offset)
            # The worker owns the slot until this callback fires, whatever the waiter does.
            job.add_done_callback(
                lambda j, i=index: loop.call_soon_threadsafe(op.range_done, i, _job_outcome(j)))

    async def aclose(self) -> None:
        self._pool.shutdown(wait=True)


class MmapBackend:
    """Views of a read-only mapping of each file; pages are faulted in by a worker thread."""

    name = "mmap"
    uses_pool = False

    def __init__(self, files: Sequence[ModelFile], threads: int = 2) -> None:
        self.files = files
        self._maps: list[mmap.mmap | None] = [mmap.mmap(f.fd, 0, access=mmap.ACCESS_READ) if f.size else None
                                              for f in files]
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="colibri-mmap")

    def start(self, loc: ExpertLocation, plan: ExpertPlan, slot: Slot | None, on_done: OnDone) -> None:
        loop = asyncio.get_running_loop()
        for index, rng in enumerate(loc.ranges):
            file, mapped = self.files[rng.file], self._maps[rng.file]
            # Touching pages of a truncated file is SIGBUS, not an error: check before, not only after.
            file.check_unchanged()
            if mapped is None or rng.offset + rng.nbytes > len(mapped):
                # Touching a mapping past the end of the file is SIGBUS: refuse here.
                error = ExpertReadError(file.path, rng.offset, rng.nbytes, loc.layer, loc.expert,
                                        f"short read: the {PROJECTIONS[index]} range ends past the end of the "
                                        f"{file.size}-byte file")
                loop.call_soon(on_done, error)
                return
        job = self._pool.submit(self._fault_in, loc)
        job.add_done_callback(lambda j: loop.call_soon_threadsafe(self._finish, on_done, loc, j))

    def _fault_in(self, loc: ExpertLocation) -> ExpertBytes:
        """Bring the expert's pages into memory now, off the event loop, and return views of them."""
        maps = [self._maps[rng.file] for rng in loc.ranges]
        for rng, mapped in zip(loc.ranges, maps):
            assert mapped is not None
            # Ask for the whole range at once: faults alone would read it a read-around window at a time.
            start = align_down(rng.offset, mmap.PAGESIZE)
            mapped.madvise(mmap.MADV_WILLNEED, start, rng.offset + rng.nbytes - start)
        for rng, mapped in zip(loc.ranges, maps):
            assert mapped is not None
            start = align_down(rng.offset, mmap.PAGESIZE)
            try:
                mapped.madvise(MADV_POPULATE_READ, start, rng.offset + rng.nbytes - start)
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: a kernel older than 5.14; touch instead
                    raise
                np.frombuffer(mapped, np.uint8, rng.offset + rng.nbytes - start, start)[::mmap.PAGESIZE].max()
        g, u, d = (np.frombuffer(m, np.uint8, r.nbytes, r.offset) for r, m in zip(loc.ranges, maps))
        return g, u, d

    def _finish(self, on_done: OnDone, loc: ExpertLocation, job: concurrent.futures.Future[ExpertBytes]) -> None:
        exc = job.exception()
        if exc is None:
            on_done(job.result())
            return
        on_done(ExpertReadError(self.files[loc.gate.file].path, loc.gate.offset, loc.nbytes, loc.layer, loc.expert,
                                f"{type(exc).__name__}: {exc}"))

    async def aclose(self) -> None:
        self._pool.shutdown(wait=True)
        for i, mapped in enumerate(self._maps):
            if mapped is not None:
                try:
                    mapped.close()
                except BufferError:
                    pass  # a lease's views still use the mapping; it goes with the last of them
                self._maps[i] = None


def _job_outcome(job: concurrent.futures.Future[int]) -> int | BaseException:
    exc = job.exception()
    return exc if exc is not None else job.result()
