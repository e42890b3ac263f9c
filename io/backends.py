"""Three ways to get an expert's bytes, behind one interface.

- ``uring``: io_uring reads (registered buffers when allowed) into a pool slot.
- ``pread``: the same reads from a thread pool, for kernels without io_uring.
- ``mmap``: no pool at all; views of a shared read-only mapping of the file,
  faulted in from a worker thread. The page cache decides what stays, as in
  llama.cpp.

A model may be in several files (the parts of a split GGUF): each backend
holds all of them, and each range is read from the file its ``file`` index names.

``start`` takes a batch of experts, each with its slot and its ``on_done``;
it hands their reads to the kernel (or queues them for a worker) before it
returns, neighbouring experts of a layer coalesced into one read per
projection (:mod:`colibri_aio.io.spans`), and calls each expert's
``on_done`` exactly once, when every read that writes into its slot is over
(the kernel or the worker thread no longer touches the slot), with the
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
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from colibri_aio.errors import ExpertReadError
from colibri_aio.experts import PROJECTIONS, ExpertLocation, TensorRange
from colibri_aio.io.align import ExpertPlan, RangeRead, align_down, align_up
from colibri_aio.io.spans import SpanRead, plan_span, runs
from colibri_aio.io.madvise import address_of, madvise
from colibri_aio.io.modelfile import ModelFile
from colibri_aio.io.pool import Slot
from colibri_aio.io.uring import RingRead, UringReactor

ExpertBytes = tuple[np.ndarray, np.ndarray, np.ndarray]
OnDone = Callable[["ExpertBytes | ExpertReadError"], None]
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14
# The mmap reader advises the kernel of a batch's ranges this many bytes at a time (each call returns once
# its read-ahead is queued, so the advice keeps pace with the device).
ADVICE_CHUNK = 32 << 20
# A warm start's batch is advised at most about this many bytes ahead of the expert its worker brings in.
BACKGROUND_LEAD = 64 << 20


@dataclass(frozen=True, slots=True)
class Job:
    """One expert to read: where it is, its aligned layout, its slot (None for mmap), whom to tell, and whether
    the model is waiting for it (a demand read: no read started for a guess may delay it)."""

    loc: ExpertLocation
    plan: ExpertPlan
    slot: Slot | None
    on_done: OnDone
    urgent: bool = False
    # A warm start's read, which nobody waits for soon: the mmap reader keeps only a little of such a batch
    # queued at the device, so that a demand read never queues behind all of it.
    background: bool = False
    # Taken by the one worker that reads the job (mmap: a queued job promoted to the demand worker is read
    # there, and its batch's worker skips it).
    claim: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)


class ReadBackend(Protocol):
    """How experts' aligned range reads reach memory."""

    name: str
    uses_pool: bool

    def start(self, jobs: Sequence[Job]) -> None: ...

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


class SpanOp:
    """One coalesced read (:class:`~colibri_aio.io.spans.SpanRead`) and the experts whose slots it writes."""

    __slots__ = ("span", "members", "slots")

    def __init__(self, span: SpanRead, members: list[ExpertRead], slots: list[Slot]) -> None:
        self.span, self.members, self.slots = span, members, slots

    def segments(self) -> list[tuple[int, int]]:
        """(address, nbytes) of each piece of the read, in file order."""
        return [(self.slots[s.member].address + s.dest_offset, s.nbytes) for s in self.span.segments]

    def arena(self) -> int | None:
        """The one arena every piece lands in (for a fixed-buffer read), or None."""
        arenas = {self.slots[s.member].arena for s in self.span.segments}
        return arenas.pop() if len(arenas) == 1 else None

    def done(self, outcome: int | BaseException) -> None:
        """The read is over (bytes read, ``-errno`` or a worker's exception): finish the boundaries, tell each expert."""
        p, span = self.span.projection, self.span
        if isinstance(outcome, BaseException) or outcome < 0:
            for m in self.members:
                m.range_done(p, outcome)
            return
        arrived = span.file_offset + outcome
        if arrived < span.need_end:  # short: the file ended early; no member is trusted
            for m in self.members:
                rr = m.plan.reads[p]
                m.range_done(p, max(0, min(arrived - rr.file_offset, rr.need_nbytes - 1)))
            return
        for f in span.fixups:
            src, dst = self.slots[f.src].array, self.slots[f.dst].array
            dst[f.dst_offset: f.dst_offset + f.nbytes] = src[f.src_offset: f.src_offset + f.nbytes]
        for m in self.members:
            m.range_done(p, m.plan.reads[p].need_nbytes)


def span_ops(files: Sequence[ModelFile], jobs: Sequence[Job]) -> list[SpanOp]:
    """The coalesced reads of ``jobs`` (pool slots), in file order; each job's ExpertRead hears of its three."""
    ops = [ExpertRead(files, j.loc, j.plan, slot_views(j.plan, j.slot), j.on_done) for j in jobs]
    out = []
    for run in runs([j.loc for j in jobs], [j.plan for j in jobs]):
        plans = [jobs[i].plan for i in run]
        members, slots = [ops[i] for i in run], [jobs[i].slot for i in run]
        out += [SpanOp(plan_span(plans, p), members, slots) for p in range(len(PROJECTIONS))]
    out.sort(key=lambda op: (op.span.file, op.span.file_offset))
    return out


class UringBackend:
    """io_uring reads into pool slots; fixed-buffer reads when the arenas are registered."""

    name = "uring"
    uses_pool = True

    def __init__(self, reactor: UringReactor, files: Sequence[ModelFile]) -> None:
        self.reactor = reactor
        self.files = files

    def start(self, jobs: Sequence[Job]) -> None:
        self.reactor.submit(*(RingRead(self.files[op.span.file].fd, tuple(op.segments()), op.span.file_offset,
                                       op.arena(), op.done)
                              for op in span_ops(self.files, jobs)))

    async def aclose(self) -> None:
        await self.reactor.aclose()


class PreadBackend:
    """``os.preadv`` from worker threads into pool slots (the GIL is released while a read waits)."""

    name = "pread"
    uses_pool = True

    def __init__(self, files: Sequence[ModelFile], threads: int = 8) -> None:
        self.files = files
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="colibri-pread")

    def start(self, jobs: Sequence[Job]) -> None:
        loop = asyncio.get_running_loop()
        for op in span_ops(self.files, jobs):
            views = [op.slots[s.member].view[s.dest_offset: s.dest_offset + s.nbytes] for s in op.span.segments]
            job = self._pool.submit(os.preadv, self.files[op.span.file].fd, views, op.span.file_offset)
            # The worker owns the slots until this callback fires, whatever the waiter does.
            job.add_done_callback(lambda j, op=op: loop.call_soon_threadsafe(op.done, _job_outcome(j)))

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
        # Where each mapping starts, for madvise without the GIL (the workers are done before a mapping closes).
        self._addresses = [address_of(m) if m is not None else 0 for m in self._maps]
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="colibri-mmap")
        self._advisor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="colibri-advice")
        # Demand reads have a worker and an advisor of their own: behind the others' batches (a warm fill of
        # whole layers, a prompt's read-ahead) in one queue, the expert a step waits for waited for all of them.
        self._demand = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="colibri-mmap-demand")
        self._demand_advisor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="colibri-advice-demand")
        self._closing = False
        self._bases: list[np.ndarray] = []

    def start(self, jobs: Sequence[Job]) -> None:
        """Check each job's ranges, then hand the batch to one worker: the kernel is asked for every range of
        the batch (read-ahead queued at the device's full depth) and the worker waits for each expert in turn,
        reporting each as it is in. Asked one expert at a time from two workers, the disk had two experts'
        ranges in flight."""
        loop = asyncio.get_running_loop()
        ok = [job for job in jobs if self._in_file(job, loop)]
        demand = [job for job in ok if job.urgent]
        if demand:
            self._demand.submit(self._batch, demand, loop, self._demand_advisor)
        if ahead := [job for job in ok if not job.urgent and not job.background]:
            self._pool.submit(self._batch, ahead, loop, self._advisor)
        if background := [job for job in ok if job.background and not job.urgent]:
            self._pool.submit(self._batch, background, loop, self._advisor, BACKGROUND_LEAD)

    def promote(self, job: Job) -> None:
        """The model now waits for ``job``, queued in a batch nobody waited for: the demand worker reads it
        now (unless a worker has it already); its batch's worker skips it."""
        if not job.claim.locked():
            self._demand.submit(self._batch, [job], asyncio.get_running_loop(), self._demand_advisor)

    def _in_file(self, job: Job, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether every range of ``job`` lies in its file (else its ``on_done`` gets the error, soon)."""
        loc = job.loc
        for index, rng in enumerate(loc.ranges):
            file, mapped = self.files[rng.file], self._maps[rng.file]
            # Touching pages of a truncated file is SIGBUS, not an error: check before, not only after.
            file.check_unchanged()
            if mapped is None or rng.offset + rng.nbytes > len(mapped):
                # Touching a mapping past the end of the file is SIGBUS: refuse here.
                error = ExpertReadError(file.path, rng.offset, rng.nbytes, loc.layer, loc.expert,
                                        f"short read: the {PROJECTIONS[index]} range ends past the end of the "
                                        f"{file.size}-byte file")
                job.claim.acquire(blocking=False)  # never to be read, promoted or not
                loop.call_soon(job.on_done, error)
                return False
        return True

    def _batch(self, jobs: Sequence[Job], loop: asyncio.AbstractEventLoop,
               advisor: concurrent.futures.ThreadPoolExecutor, lead: int | None = None) -> None:
        """:meth:`_fault_in_batch` on a worker; should it fail before every expert of the batch is reported
        (a fault of this code, not of the disk: the executor would keep the exception), each expert nobody
        took ends as a failed read that names it, so that no waiter waits forever."""
        try:
            self._fault_in_batch(jobs, loop, advisor, lead)
        except BaseException as exc:
            for job in jobs:
                if job.claim.acquire(blocking=False):  # a job taken is always reported by whoever took it
                    loop.call_soon_threadsafe(self._finish, job.on_done, job.loc, exc)
            raise

    def _fault_in_batch(self, jobs: Sequence[Job], loop: asyncio.AbstractEventLoop,
                        advisor: concurrent.futures.ThreadPoolExecutor, lead: int | None = None) -> None:
        """Bring each expert of ``jobs`` in, in order, reporting each as it is in, while ``advisor`` asks
        the kernel for the batch's ranges (merged where they touch), in the same order.

        The advice blocks once the device's queue is full, so it runs on a thread of its own, paced by the
        device: the queue stays full, and the experts that come first are reported as soon as they are in
        rather than once the advice behind them is queued. With ``lead`` (a warm start's batch) the advice
        runs at most about that many bytes ahead of the expert being brought in: advised whole, a batch of
        two layers queued a gigabyte at the device, and a demand read that came after waited for all of it."""
        pace = _Pace(lead) if lead else None
        if pace is None:
            advisor.submit(self._advise, _merged_pages(jobs))
        else:
            advisor.submit(self._advise_paced, jobs, pace)
        try:
            self._fault_in_each(jobs, loop, pace)
        finally:
            if pace is not None:
                pace.over()

    def _fault_in_each(self, jobs: Sequence[Job], loop: asyncio.AbstractEventLoop, pace: "_Pace | None") -> None:
        for job in jobs:
            if pace is not None:
                pace.begin(job.loc.nbytes)
            if not job.claim.acquire(blocking=False):
                continue  # promoted: the demand worker has it
            try:
                if self._closing:  # the reader is closing: what is left of the batch is not read
                    raise RuntimeError("the expert reader closed before this expert was read")
                outcome: ExpertBytes | BaseException = self._fault_in(job.loc)
            except BaseException as exc:  # the waiter's to raise
                outcome = exc
            loop.call_soon_threadsafe(self._finish, job.on_done, job.loc, outcome)

    def _advise(self, spans: Sequence[tuple[int, int, int]]) -> None:
        for file, start, end in spans:
            for at in range(start, end, ADVICE_CHUNK):
                if self._closing:
                    return  # closing: what is advised already is enough
                try:
                    os.posix_fadvise(self.files[file].fd, at, min(ADVICE_CHUNK, end - at), os.POSIX_FADV_WILLNEED)
                except OSError:
                    return  # advice only: the populate reads what the advice did not

    def _advise_paced(self, jobs: Sequence[Job], pace: "_Pace") -> None:
        """Advise ``jobs`` in their order, a window of ``pace.lead / 2`` bytes (at least one expert) at a
        time, each window once the worker has begun the one before it."""
        begun_before = -1
        for start, window in _windows(jobs, pace.lead // 2):
            if begun_before >= 0 and not pace.wait_begun(begun_before):
                return  # the batch is over
            if self._closing:
                return
            self._advise(_merged_pages(window))
            begun_before = start

    def _fault_in(self, loc: ExpertLocation) -> ExpertBytes:
        """Bring the expert's pages into memory now, off the event loop, and return views of them."""
        maps = [self._maps[rng.file] for rng in loc.ranges]
        for rng, mapped in zip(loc.ranges, maps):
            assert mapped is not None
            start = align_down(rng.offset, mmap.PAGESIZE)
            try:
                madvise(self._addresses[rng.file] + start, rng.offset + rng.nbytes - start, MADV_POPULATE_READ)
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: a kernel older than 5.14; touch instead
                    raise
                np.frombuffer(mapped, np.uint8, rng.offset + rng.nbytes - start, start)[::mmap.PAGESIZE].max()
        g, u, d = (np.frombuffer(m, np.uint8, r.nbytes, r.offset) for r, m in zip(loc.ranges, maps))
        return g, u, d

    def release(self, rng: TensorRange) -> None:
        """Drop the whole pages inside ``rng`` from the mapping and then from the page cache (the pages it
        shares with a neighbouring range stay: that range may still be read through the mapping)."""
        mapped = self._maps[rng.file]
        start, end = align_up(rng.offset, mmap.PAGESIZE), align_down(rng.offset + rng.nbytes, mmap.PAGESIZE)
        if mapped is None or end <= start:
            return
        mapped.madvise(mmap.MADV_DONTNEED, start, end - start)
        os.posix_fadvise(self.files[rng.file].fd, start, end - start, os.POSIX_FADV_DONTNEED)

    def base_addresses(self) -> list[int] | None:
        """The address of byte 0 of each file's mapping (a kernel graph may index a stacked tensor there);
        None when a file is empty. The views kept here hold the mappings until the last of them goes."""
        if any(m is None for m in self._maps):
            return None
        if not self._bases:
            self._bases = [np.frombuffer(m, np.uint8, 1) for m in self._maps]  # type: ignore[arg-type]
        return list(self._addresses)

    def _finish(self, on_done: OnDone, loc: ExpertLocation, outcome: ExpertBytes | BaseException) -> None:
        if not isinstance(outcome, BaseException):
            on_done(outcome)
            return
        on_done(ExpertReadError(self.files[loc.gate.file].path, loc.gate.offset, loc.nbytes, loc.layer, loc.expert,
                                f"{type(outcome).__name__}: {outcome}"))

    def stop(self) -> None:
        """Read nothing more: each expert of a batch not brought in yet ends at once, as a failed read."""
        self._closing = True

    async def aclose(self) -> None:
        self._closing = True
        self._pool.shutdown(wait=True)
        self._demand.shutdown(wait=True)
        for advisor in (self._advisor, self._demand_advisor):
            advisor.shutdown(wait=True, cancel_futures=True)
        self._bases = []
        for i, mapped in enumerate(self._maps):
            if mapped is not None:
                try:
                    mapped.close()
                except BufferError:
                    pass  # a lease's views still use the mapping; it goes with the last of them
                self._maps[i] = None


class _Pace:
    """How far a paced batch's worker has got: the bytes of the experts it has begun, in the batch's order."""

    def __init__(self, lead: int) -> None:
        self.lead = lead
        self._begun = 0
        self._over = False
        self._changed = threading.Condition()

    def wait_begun(self, offset: int) -> bool:
        """Wait until the worker has begun the expert at byte ``offset`` of the batch; False if it ended."""
        with self._changed:
            while self._begun <= offset and not self._over:
                self._changed.wait()
            return not self._over

    def begin(self, nbytes: int) -> None:
        with self._changed:
            self._begun += nbytes
            self._changed.notify_all()

    def over(self) -> None:
        with self._changed:
            self._over = True
            self._changed.notify_all()


def _windows(jobs: Sequence[Job], nbytes: int) -> list[tuple[int, list[Job]]]:
    """``jobs`` cut in order into windows of at most ``nbytes`` (at least one expert each), each with its
    byte offset in the batch."""
    out: list[tuple[int, list[Job]]] = []
    at = size = 0
    for job in jobs:
        if not out or size + job.loc.nbytes > nbytes:
            out.append((at, []))
            size = 0
        out[-1][1].append(job)
        size += job.loc.nbytes
        at += job.loc.nbytes
    return out


def _merged_pages(jobs: Sequence[Job]) -> list[tuple[int, int, int]]:
    """Every range of ``jobs`` as (file, first page's offset, end), merged where they touch, in file order."""
    pieces = sorted((r.file, align_down(r.offset, mmap.PAGESIZE), r.offset + r.nbytes)
                    for job in jobs for r in job.loc.ranges)
    merged: list[list[int]] = []
    for file, start, end in pieces:
        if merged and merged[-1][0] == file and start <= merged[-1][2]:
            merged[-1][2] = max(merged[-1][2], end)
        else:
            merged.append([file, start, end])
    return [(f, a, b) for f, a, b in merged]


def _job_outcome(job: concurrent.futures.Future[int]) -> int | BaseException:
    exc = job.exception()
    return exc if exc is not None else job.result()
