"""ExpertReader: ``reader.start(location, slot)`` reads one expert into one pool slot.

The reader owns the model's file (or files: the parts of a split GGUF, each
expert range naming the one it is in), the buffer pool and one backend (io_uring,
thread-pool pread or mmap). It does not choose slots: the caller's allocator
(the expert cache) does, and the reader keeps the ownership rule: a slot is
the kernel's from submission until its completion is reaped, even when the
future that wanted its bytes was cancelled; :meth:`ExpertReader.start`
refuses a slot whose read is not over, and ``aclose`` drains every in-flight
read before the memory is released.
"""
from __future__ import annotations

import asyncio
import errno
import os
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass

from colibri_aio import probes
from colibri_aio.errors import ExpertReadError, UserError
from colibri_aio.experts import ExpertLocation, ExpertWeights, TensorRange
from colibri_aio.io.align import ExpertPlan, plan_expert, slot_nbytes_for
from colibri_aio.io.backends import ExpertBytes, Job, MmapBackend, PreadBackend, ReadBackend, UringBackend
from colibri_aio.io.modelfile import ModelFile, open_files
from colibri_aio.io.pool import BufferPool
from colibri_aio.io.uring import DEFAULT_MAX_INFLIGHT_BYTES, DEFAULT_RING_ENTRIES, UringReactor
from colibri_aio.kernels.qtensor import QTensor
from colibri_aio.logs import get_logger

log = get_logger("colibri_aio.io")

BACKENDS = ("auto", "uring", "pread", "mmap")


class ReaderClosedError(RuntimeError):
    """A read was asked of a reader that is closing or closed."""


@dataclass(slots=True)
class ReaderStats:
    """What the reader has done so far."""

    reads: int = 0          # experts delivered
    bytes: int = 0          # expert bytes delivered
    io_bytes: int = 0       # bytes asked of the disk (aligned supersets)
    errors: int = 0
    busy_s: float = 0.0     # wall time with at least one read in flight


class ExpertReader:
    """Reads routed experts' byte ranges from a GGUF (one file or its parts) through the chosen backend."""

    def __init__(self, files: Sequence[ModelFile], pool: BufferPool | None, backend: ReadBackend, reason: str,
                 n_slots: int) -> None:
        self.files = tuple(files)
        self.pool = pool
        self.n_slots = n_slots
        self._kernel: dict[int, Job] = {}  # slots a read is still writing into, and that read (for promote)
        self._backend = backend
        self.backend: str = backend.name
        self.backend_reason = reason
        self.stats = ReaderStats()
        self._in_flight = 0  # reads the kernel or a worker still owns
        self._busy_since = 0.0
        self._loop = asyncio.get_running_loop()  # readers live on the loop they were opened on
        self._idle = asyncio.Event()  # set while no read is in flight
        self._idle.set()
        self._closed = False

    @property
    def registered(self) -> bool:
        """Whether reads go into io_uring registered (fixed) buffers."""
        return isinstance(self._backend, UringBackend) and self._backend.reactor.registered

    @property
    def file(self) -> ModelFile:
        """The model's (first) file."""
        return self.files[0]

    def mapped_addresses(self) -> list[int] | None:
        """With the mmap backend, the address of byte 0 of each file's mapping; else None."""
        return self._backend.base_addresses() if isinstance(self._backend, MmapBackend) else None

    def release(self, rng: TensorRange) -> None:
        """With the mmap backend: the bytes of ``rng`` are no longer read through the mapping (a copy of them
        serves instead), so its whole pages leave this process's mapping and the page cache, and memory the
        copies need next can be those pages. Else nothing."""
        if isinstance(self._backend, MmapBackend):
            self._backend.release(rng)

    @property
    def direct(self) -> bool:
        """Whether reads bypass the page cache (O_DIRECT) in every file."""
        return all(f.direct for f in self.files)

    @property
    def in_flight(self) -> int:
        """Reads whose slot the kernel (or a worker thread) still owns."""
        return self._in_flight

    def in_kernel(self, slot: int) -> bool:
        """Whether a read into ``slot`` is still in flight (its memory is not the caller's yet)."""
        return slot in self._kernel

    @classmethod
    async def open(cls, paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], slot_nbytes_max: int,
                   n_slots: int, backend: str = "auto", *,
                   ring_entries: int = DEFAULT_RING_ENTRIES, max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
                   threads: int = 8, direct: bool = True, register: bool = False,
                   punt: bool = False, huge_pages: bool = True, why: str | None = None) -> "ExpertReader":
        """Open ``paths`` for expert reads: the model's file, or its parts in order (a range's ``file`` indexes them).

        ``slot_nbytes_max`` is the size of the largest expert (its three ranges
        together); the pool adds the O_DIRECT alignment slack. ``n_slots`` is
        how many experts can be in flight or held at once (slots 0..n_slots-1;
        with mmap they are only names, the bytes stay in the mapping). ``backend`` is
        one of ``auto|uring|pread|mmap``; ``auto`` tries io_uring, then pread.
        ``ring_entries`` and ``max_inflight_bytes`` bound the reads io_uring
        has in flight; ``threads`` is the pread worker count; ``direct=False``
        reads through the page cache instead of O_DIRECT. ``register=True``
        registers the pool with io_uring as fixed buffers (falling back to
        unregistered reads when refused); registering pins, and so faults in,
        every page of the pool at once, where unregistered reads populate it
        as they fill it. ``punt=True`` has io_uring issue every read from its
        kernel workers (IOSQE_ASYNC) rather than inline in the submitting call.
        ``huge_pages=False`` keeps the pool in 4 KiB pages (see
        :func:`~colibri_aio.io.pool.ask_huge_pages`). ``why``: the reason to report for ``mmap`` when the
        caller chose it (default: it was asked for).
        """
        if backend not in BACKENDS:
            raise UserError(f"unknown I/O backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        files = open_files(paths, direct=direct and backend != "mmap")
        try:
            if backend == "mmap":
                reader = cls(files, None, MmapBackend(files),
                             why or "mmap requested: the page cache decides what stays",
                             n_slots)
            else:
                # First use on a machine: the probe's child runs off the loop, beside the rest of the open.
                uring = None if backend == "pread" else await asyncio.to_thread(probes.verdict, "io_uring")
                pool = BufferPool(slot_nbytes_for(slot_nbytes_max), n_slots, huge_pages=huge_pages)
                try:
                    chosen, reason = _pool_backend(backend, uring, files, pool, ring_entries, max_inflight_bytes,
                                                   threads, register, punt)
                except BaseException:
                    pool.close()
                    raise
                reader = cls(files, pool, chosen, reason, n_slots)
        except BaseException:
            for f in files:
                f.close()
            raise
        pool = reader.pool
        first = files[0]
        log.info("expert reader open", path=first.path, files=len(files), backend=reader.backend,
                 reason=reader.backend_reason, o_direct=reader.direct, o_direct_reason=first.direct_reason,
                 slots=pool.n_slots if pool else 0, slot_nbytes=pool.slot_nbytes if pool else 0,
                 huge_pages=pool.huge_pages if pool else False,
                 pool_nbytes=pool.nbytes if pool else 0)
        return reader

    def start(self, loc: ExpertLocation, slot: int) -> asyncio.Future[ExpertWeights]:
        """Read ``loc`` into pool slot ``slot``; the future gives views of its bytes (valid until the slot is reused).

        When this returns the reads are in the kernel's hands (io_uring) or
        queued for a worker (pread, mmap), so compute that follows without
        yielding to the loop overlaps them. Cancelling the future stops
        nothing: the slot stays the kernel's until the read is over
        (:meth:`in_kernel`), and ``start`` refuses such a slot.
        """
        return self.start_many([(loc, slot)])[0]

    def start_many(self, items: Sequence[tuple[ExpertLocation, int]],
                   urgent: bool = False, background: bool = False) -> list[asyncio.Future[ExpertWeights]]:
        """:meth:`start` for several experts at once, one future each, in the order given.

        ``urgent``: the model is waiting for these (demand reads); a backend
        that queues reads (mmap) serves them ahead of the others. ``background``:
        a warm start's, which nobody waits for soon; such a backend keeps only a
        little of them queued at the device at a time.

        Neighbouring experts of a layer are read together: one request per
        projection for the whole run (:mod:`colibri_aio.io.spans`). Every
        item is checked before any read is submitted, so a refusal (a slot
        still in flight, a slot out of range) submits nothing.
        """
        if self._closed:
            raise ReaderClosedError("the expert reader is closed")
        jobs_in: list[tuple[ExpertLocation, ExpertPlan, int]] = []
        seen: set[int] = set()
        for loc, slot in items:
            if not 0 <= slot < self.n_slots:
                raise ValueError(f"slot {slot} is not one of this reader's {self.n_slots} slots")
            if slot in self._kernel or slot in seen:
                raise RuntimeError(f"slot {slot} still has a read in flight; its memory is not free yet")
            seen.add(slot)
            plan = plan_expert(loc)
            if self.pool is not None and plan.span > self.pool.slot_nbytes:
                raise ValueError(f"layer {loc.layer} expert {loc.expert} needs {plan.span} slot bytes; "
                                 f"slots hold {self.pool.slot_nbytes} (slot_nbytes_max too small)")
            jobs_in.append((loc, plan, slot))
        futures: list[asyncio.Future[ExpertWeights]] = []
        jobs: list[Job] = []
        over: set[int] = set()
        for loc, plan, slot in jobs_in:
            future: asyncio.Future[ExpertWeights] = self._loop.create_future()
            futures.append(future)

            def on_done(outcome: ExpertBytes | ExpertReadError, future=future, loc=loc, plan=plan, slot=slot) -> None:
                over.add(slot)
                self._read_over(future, loc, plan, slot, outcome)

            jobs.append(Job(loc, plan, self.pool.slots[slot] if self.pool is not None else None, on_done, urgent,
                            background))
            self._begin(slot, jobs[-1])
        try:
            self._backend.start(jobs)
        except BaseException:
            for _, _, slot in jobs_in:
                if slot not in over:  # nothing of it reached the kernel
                    self._end(slot)
            raise
        return futures

    def promote(self, slot: int) -> None:
        """The model now waits for the read into ``slot``, started as one it would not wait for (a warm
        start's, a read-ahead's): a backend that queues reads (mmap) serves it next."""
        job = self._kernel.get(slot)
        promote = getattr(self._backend, "promote", None)  # only a backend that queues reads has it
        if job is not None and not job.urgent and promote is not None:
            promote(job)

    def _begin(self, slot: int, job: Job) -> None:
        self._kernel[slot] = job
        if not self._in_flight:
            self._busy_since = time.perf_counter()
            self._idle.clear()
        self._in_flight += 1

    def _end(self, slot: int) -> None:
        self._kernel.pop(slot, None)
        self._in_flight -= 1
        if not self._in_flight:
            self.stats.busy_s += time.perf_counter() - self._busy_since
            self._idle.set()

    def _read_over(self, future: asyncio.Future[ExpertWeights], loc: ExpertLocation, plan: ExpertPlan, slot: int,
                   outcome: ExpertBytes | ExpertReadError) -> None:
        """The kernel (or worker) is done with the slot: hand its bytes, or the reason there are none, to the future."""
        self._end(slot)
        if isinstance(outcome, ExpertReadError):
            self.stats.errors += 1
        if future.cancelled():  # nobody wants the bytes; the slot is free again
            return
        try:
            if self._closed:  # the pool is going away
                raise ReaderClosedError("the expert reader closed while this read was in flight")
            # One fstat per file read from, after the read: bytes read from a file that changed before or
            # during the read never reach compute, and a truncated file that read short is named as such.
            for index in {rng.file for rng in loc.ranges}:
                self.files[index].check_unchanged()
            if isinstance(outcome, ExpertReadError):
                raise outcome
        except Exception as exc:  # the waiter's to raise, never lost in a loop callback
            future.set_exception(exc)
            return
        self.stats.reads += 1
        self.stats.bytes += loc.nbytes
        self.stats.io_bytes += plan.read_nbytes if self.pool is not None else loc.nbytes
        gate, up, down = outcome
        future.set_result(ExpertWeights(QTensor(gate, loc.gate.ggml_type, loc.gate.shape),
                                        QTensor(up, loc.up.ggml_type, loc.up.shape),
                                        QTensor(down, loc.down.ggml_type, loc.down.shape)))

    async def drained(self) -> None:
        """Wait until no read is in flight."""
        await self._idle.wait()

    async def aclose(self) -> None:
        """Refuse new reads, wait for every in-flight read, then release the pool and the file."""
        if self._closed:
            return
        self._closed = True
        if isinstance(self._backend, MmapBackend):
            self._backend.stop()  # a batch's experts not brought in yet end now instead of being read for nobody
        await self.drained()
        assert not self._kernel, f"slots {sorted(self._kernel)} still in the kernel's hands after the drain"
        await self._backend.aclose()
        if self.pool is not None:
            self.pool.close()
        for f in self.files:
            f.close()

    async def __aenter__(self) -> "ExpertReader":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _pool_backend(kind: str, found: probes.Verdict | None, files: Sequence[ModelFile], pool: BufferPool,
                  ring_entries: int, max_inflight_bytes: int, threads: int, register: bool,
                  punt: bool = False) -> tuple[ReadBackend, str]:
    """Pick the backend for ``kind`` among those that read into the pool, with the reason why
    (``found``: the io_uring probe's verdict, None for pread)."""
    if found is None:  # pread asked for: no probe was made
        return PreadBackend(files, threads), "pread requested"
    if not found.ok:
        if kind == "uring":
            raise UserError(f"--io uring: the {found.line()}; use --io auto or --io pread")
        probes.warn_fallback(found, "reading with pread")
        return PreadBackend(files, threads), f"{found.line()}: thread-pool pread"
    try:
        reactor = UringReactor.create(ring_entries, max_inflight_bytes, punt)
    except (OSError, RuntimeError) as exc:
        if kind == "uring":
            raise UserError(f"--io uring: io_uring cannot be set up here ({_describe(exc)}); "
                            f"use --io auto or --io pread") from None
        log.warning("io_uring unavailable, falling back to thread-pool pread", error=_describe(exc))
        return PreadBackend(files, threads), f"io_uring cannot be set up ({_describe(exc)}): thread-pool pread"
    if not register:
        return UringBackend(reactor, files), ("io_uring, unregistered buffers (the pool's pages are populated by the "
                                              "reads that fill them)")
    try:
        reactor.register_buffers(list(zip(pool.arena_addresses, (len(a) for a in pool.arenas))))
    except OSError as exc:
        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
        log.warning("io_uring buffer registration refused, using unregistered reads",
                    error=_describe(exc), rlimit_memlock=limit)
        return UringBackend(reactor, files), (f"io_uring, unregistered buffers: registration of "
                                             f"{pool.nbytes} bytes refused ({_describe(exc)}; "
                                             f"RLIMIT_MEMLOCK {limit})")
    return UringBackend(reactor, files), (f"io_uring, {len(pool.arenas)} registered buffer(s) "
                                         f"of {pool.nbytes} bytes in all")


def _describe(exc: BaseException) -> str:
    code = getattr(exc, "errno", None)
    if code:
        return f"{errno.errorcode.get(code, code)}: {os.strerror(code)}"
    return f"{type(exc).__name__}: {exc}"
