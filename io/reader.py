"""ExpertReader: ``await reader.read(location)`` gives a lease on one expert's bytes.

The reader owns the model file, the buffer pool and one backend (io_uring,
thread-pool pread or mmap) and keeps the pool's ownership rule: a slot is the
kernel's from submission until its completion is reaped, even when the task
that asked for it was cancelled; ``aclose`` drains every in-flight read
before the memory is released.
"""
from __future__ import annotations

import asyncio
import errno
import os
import resource
import time
import warnings
from dataclasses import dataclass

import structlog

from colibri_aio.errors import ExpertReadError, UserError
from colibri_aio.experts import ExpertLocation, ExpertWeights
from colibri_aio.io.align import ExpertPlan, plan_expert, slot_nbytes_for
from colibri_aio.io.backends import ExpertBytes, MmapBackend, PreadBackend, ReadBackend, UringBackend
from colibri_aio.io.modelfile import ModelFile
from colibri_aio.io.pool import BufferPool, PoolClosedError, Slot, SlotState
from colibri_aio.io.uring import DEFAULT_MAX_INFLIGHT_BYTES, DEFAULT_RING_ENTRIES, UringReactor
from colibri_aio.kernels.qtensor import QTensor

log = structlog.get_logger("colibri_aio.io")

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
    slot_wait_s: float = 0.0  # time readers waited for a free slot


class SlotLease:
    """One expert's weights, valid until :meth:`release` (or the end of a ``with`` block).

    The weights are views into a pool slot (or the file mapping, with mmap);
    after release the slot may be refilled with another expert's bytes.
    """

    __slots__ = ("location", "weights", "slot", "_pool", "_released")

    def __init__(self, location: ExpertLocation, weights: ExpertWeights, slot: Slot | None,
                 pool: BufferPool | None) -> None:
        self.location = location
        self.weights = weights
        self.slot = slot
        self._pool = pool
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Give the slot back to the pool; releasing twice is harmless."""
        if self._released:
            return
        self._released = True
        if self.slot is not None and self._pool is not None:
            self._pool.release(self.slot)

    def __enter__(self) -> "SlotLease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        if not self._released and self.slot is not None:
            warnings.warn(f"lease on layer {self.location.layer} expert {self.location.expert} was never released",
                          ResourceWarning, stacklevel=1)
            self.release()


class ExpertReader:
    """Reads routed experts' byte ranges from one GGUF file through the chosen backend."""

    def __init__(self, file: ModelFile, pool: BufferPool | None, backend: ReadBackend, reason: str) -> None:
        self.file = file
        self.pool = pool
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
    def direct(self) -> bool:
        """Whether reads bypass the page cache (O_DIRECT)."""
        return self.file.direct

    @property
    def in_flight(self) -> int:
        """Reads whose slot the kernel (or a worker thread) still owns."""
        return self._in_flight

    @classmethod
    async def open(cls, path: str | os.PathLike[str], slot_nbytes_max: int, n_slots: int, backend: str = "auto", *,
                   ring_entries: int = DEFAULT_RING_ENTRIES, max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
                   threads: int = 8, direct: bool = True) -> "ExpertReader":
        """Open ``path`` for expert reads.

        ``slot_nbytes_max`` is the size of the largest expert (its three ranges
        together); the pool adds the O_DIRECT alignment slack. ``n_slots`` is
        how many experts can be in flight or leased at once. ``backend`` is
        one of ``auto|uring|pread|mmap``; ``auto`` tries io_uring with
        registered buffers, then io_uring without them, then pread.
        ``ring_entries`` and ``max_inflight_bytes`` bound the reads io_uring
        has in flight; ``threads`` is the pread worker count; ``direct=False``
        reads through the page cache instead of O_DIRECT.
        """
        if backend not in BACKENDS:
            raise UserError(f"unknown I/O backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        file = ModelFile.open(path, direct=direct and backend != "mmap")
        try:
            if backend == "mmap":
                reader = cls(file, None, MmapBackend(file), "mmap requested: the page cache decides what stays")
            else:
                pool = BufferPool(slot_nbytes_for(slot_nbytes_max), n_slots)
                try:
                    chosen, reason = _pool_backend(backend, file, pool, ring_entries, max_inflight_bytes, threads)
                except BaseException:
                    pool.close()
                    raise
                reader = cls(file, pool, chosen, reason)
        except BaseException:
            file.close()
            raise
        pool = reader.pool
        log.info("expert reader open", path=file.path, backend=reader.backend, reason=reader.backend_reason,
                 o_direct=file.direct, o_direct_reason=file.direct_reason,
                 slots=pool.n_slots if pool else 0, slot_nbytes=pool.slot_nbytes if pool else 0,
                 pool_nbytes=pool.nbytes if pool else 0)
        return reader

    async def read(self, loc: ExpertLocation) -> SlotLease:
        """Read one expert; the lease's weights are views of its bytes (release it when done)."""
        if self._closed:
            raise ReaderClosedError("the expert reader is closed")
        plan = plan_expert(loc)
        slot = None
        if self.pool is not None:
            if plan.span > self.pool.slot_nbytes:
                raise ValueError(f"layer {loc.layer} expert {loc.expert} needs {plan.span} slot bytes; "
                                 f"slots hold {self.pool.slot_nbytes} (slot_nbytes_max too small)")
            slot = self.pool.try_acquire() or await self._wait_for_slot()
        waiter = self._start(loc, plan, slot)
        try:
            views = await waiter
        except asyncio.CancelledError:
            # Cancelled after the read was over but before we resumed: the slot is ours to give back.
            # Otherwise _read_over gives it back once the kernel is done with it.
            if waiter.done() and not waiter.cancelled():
                waiter.exception()
                self._give_back(slot)
            raise
        except ExpertReadError:
            self.stats.errors += 1
            self._give_back(slot)
            self.file.check_unchanged()  # a truncated file reads short: name the real cause
            raise
        try:
            if self._closed:  # closed while we waited: the pool is going away
                raise ReaderClosedError("the expert reader closed while this read was in flight")
            # One fstat per read, after it: bytes read from a file that changed
            # before or during the read never reach compute.
            self.file.check_unchanged()
        except BaseException:
            self._give_back(slot)
            raise
        self.stats.reads += 1
        self.stats.bytes += loc.nbytes
        self.stats.io_bytes += plan.read_nbytes if slot is not None else loc.nbytes
        gate, up, down = views
        weights = ExpertWeights(QTensor(gate, loc.gate.ggml_type, loc.gate.shape),
                                QTensor(up, loc.up.ggml_type, loc.up.shape),
                                QTensor(down, loc.down.ggml_type, loc.down.shape))
        return SlotLease(loc, weights, slot, self.pool)

    async def _wait_for_slot(self) -> Slot:
        waited = time.perf_counter()
        try:
            slot = await self.pool.acquire()
        except PoolClosedError:
            raise ReaderClosedError("the expert reader closed while this read waited for a slot") from None
        self.stats.slot_wait_s += time.perf_counter() - waited
        if self._closed:
            self.pool.release(slot)
            raise ReaderClosedError("the expert reader is closed")
        return slot

    def _give_back(self, slot: Slot | None) -> None:
        if slot is not None:
            self.pool.release(slot)

    def _start(self, loc: ExpertLocation, plan: ExpertPlan, slot: Slot | None) -> asyncio.Future[ExpertBytes]:
        """Hand the slot to the backend; the returned future is the waiter's, cancelling it stops nothing."""
        waiter: asyncio.Future[ExpertBytes] = self._loop.create_future()
        if slot is not None:
            slot.state = SlotState.KERNEL
        try:
            self._backend.start(loc, plan, slot, lambda outcome: self._read_over(waiter, slot, outcome))
        except BaseException:
            if slot is not None:
                slot.state = SlotState.RESERVED
                self.pool.release(slot)
            raise
        if not self._in_flight:
            self._busy_since = time.perf_counter()
            self._idle.clear()
        self._in_flight += 1
        return waiter

    def _read_over(self, waiter: asyncio.Future[ExpertBytes], slot: Slot | None,
                   outcome: ExpertBytes | ExpertReadError) -> None:
        """The kernel (or worker) is done with the slot: it now holds the bytes, or garbage to discard."""
        if slot is not None:
            slot.state = SlotState.LEASED
        self._in_flight -= 1
        if not self._in_flight:
            self.stats.busy_s += time.perf_counter() - self._busy_since
            self._idle.set()
        if waiter.cancelled():  # the waiter went away while the kernel still owned the slot
            self._give_back(slot)
        elif isinstance(outcome, ExpertReadError):
            waiter.set_exception(outcome)
        else:
            waiter.set_result(outcome)

    async def drained(self) -> None:
        """Wait until no read is in flight."""
        await self._idle.wait()

    async def aclose(self) -> None:
        """Refuse new reads, wait for every in-flight read, then release the pool and the file."""
        if self._closed:
            return
        self._closed = True
        await self.drained()
        await self._backend.aclose()
        if self.pool is not None:
            self.pool.close()
        self.file.close()

    async def __aenter__(self) -> "ExpertReader":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _pool_backend(kind: str, file: ModelFile, pool: BufferPool, ring_entries: int, max_inflight_bytes: int,
                  threads: int) -> tuple[ReadBackend, str]:
    """Pick the backend for ``kind`` among those that read into the pool, with the reason why."""
    if kind == "pread":
        return PreadBackend(file, threads), "pread requested"
    try:
        reactor = UringReactor.create(ring_entries, max_inflight_bytes)
    except (OSError, RuntimeError) as exc:
        if kind == "uring":
            raise UserError(f"--io uring: io_uring cannot be set up here ({_describe(exc)}); "
                            f"use --io auto or --io pread") from None
        log.warning("io_uring unavailable, falling back to thread-pool pread", error=_describe(exc))
        return PreadBackend(file, threads), f"io_uring cannot be set up ({_describe(exc)}): thread-pool pread"
    try:
        reactor.register_buffers(list(zip(pool.arena_addresses, (len(a) for a in pool.arenas))))
    except OSError as exc:
        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
        log.warning("io_uring buffer registration refused, using unregistered reads",
                    error=_describe(exc), rlimit_memlock=limit)
        return UringBackend(reactor, file), (f"io_uring, unregistered buffers: registration of "
                                             f"{pool.nbytes} bytes refused ({_describe(exc)}; "
                                             f"RLIMIT_MEMLOCK {limit})")
    return UringBackend(reactor, file), (f"io_uring, {len(pool.arenas)} registered buffer(s) "
                                         f"of {pool.nbytes} bytes in all")


def _describe(exc: BaseException) -> str:
    code = getattr(exc, "errno", None)
    if code:
        return f"{errno.errorcode.get(code, code)}: {os.strerror(code)}"
    return f"{type(exc).__name__}: {exc}"
