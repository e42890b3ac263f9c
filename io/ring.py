"""io_uring from its three system calls: no compiled code of ours or anyone's between Python and the kernel.

The binding is ``ctypes`` for ``syscall(2)`` and Python's ``mmap`` for the
rings, so it runs on every Linux CPU that runs Python: there is no machine
code in it that a CPU could lack (a prebuilt binding once shipped AVX-512
instructions and died with SIGILL on AVX2-only CPUs). It owns every iovec it
hands the kernel, so nothing writes into another library's private structs.

What the kernel shares with us (``io_uring_setup`` fills the offsets)::

    SQ ring  | head (kernel) | tail (us) | mask | entries | flags | dropped | array[entries] (u32 SQE index)
    CQ ring  | head (us) | tail (kernel) | mask | entries | overflow | cqes[entries] (16 bytes each)
    SQEs     | entries x 64 bytes:
               opcode u8 | flags u8 | ioprio u16 | fd s32 | off u64 | addr u64 | len u32 | rw_flags u32 |
               user_data u64 | buf_index u16 | personality u16 | file_index s32 | addr3 u64 | pad u64
    CQE      | user_data u64 | res s32 | flags u32

Memory ordering: the kernel reads the SQ tail only inside ``io_uring_enter``,
which this thread calls after its stores (no SQPOLL), so SQEs are visible
to it. The CQ tail is written by the kernel from any CPU; it must be loaded
with acquire order before the CQEs it covers, and our CQ head stored with
release order after we are done reading them. On x86-64 (total store order)
plain aligned loads and stores have those orders; elsewhere they go through
libatomic's ``__atomic_load_4`` / ``__atomic_store_4`` (GCC's runtime,
present wherever GCC-built software runs), and without it the ring is
refused, so the reader falls back to pread rather than risk a torn read.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import mmap
import os
import platform
import struct
from collections.abc import Iterator, Sequence

from colibri_aio import cpu

SYS_IO_URING_SETUP, SYS_IO_URING_ENTER, SYS_IO_URING_REGISTER = 425, 426, 427  # every Linux arch but alpha

# Opcodes (enum io_uring_op, linux/io_uring.h).
IORING_OP_NOP = 0
IORING_OP_READV = 1
IORING_OP_READ_FIXED = 4
IORING_OP_READV_FIXED = 60  # Linux 6.15

IOSQE_ASYNC = 1 << 4               # issue from io-wq workers, never inline in io_uring_enter
IORING_SETUP_CLAMP = 1 << 4        # more entries than the kernel allows: clamp instead of EINVAL
IORING_FEAT_SINGLE_MMAP = 1 << 0   # SQ and CQ rings share one mapping (Linux 5.4)
IORING_ENTER_GETEVENTS = 1 << 0
IORING_OFF_SQ_RING, IORING_OFF_CQ_RING, IORING_OFF_SQES = 0, 0x8000000, 0x10000000
IORING_REGISTER_BUFFERS, IORING_REGISTER_EVENTFD, IORING_REGISTER_PROBE = 0, 4, 8
IO_URING_OP_SUPPORTED = 1 << 0

_SQE = struct.Struct("<BBHiQQIIQHHiQQ")  # the 64-byte SQE above
_CQE = struct.Struct("<QiI")
_MACHINES = {"x86_64", "amd64", "aarch64", "arm64", "riscv64", "ppc64le", "s390x", "loongarch64"}
assert _SQE.size == 64 and _CQE.size == 16


class _SqringOffsets(ctypes.Structure):
    _fields_ = [("head", ctypes.c_uint32), ("tail", ctypes.c_uint32), ("ring_mask", ctypes.c_uint32),
                ("ring_entries", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("dropped", ctypes.c_uint32),
                ("array", ctypes.c_uint32), ("resv1", ctypes.c_uint32), ("user_addr", ctypes.c_uint64)]


class _CqringOffsets(ctypes.Structure):
    _fields_ = [("head", ctypes.c_uint32), ("tail", ctypes.c_uint32), ("ring_mask", ctypes.c_uint32),
                ("ring_entries", ctypes.c_uint32), ("overflow", ctypes.c_uint32), ("cqes", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("resv1", ctypes.c_uint32), ("user_addr", ctypes.c_uint64)]


class _Params(ctypes.Structure):
    _fields_ = [("sq_entries", ctypes.c_uint32), ("cq_entries", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("sq_thread_cpu", ctypes.c_uint32), ("sq_thread_idle", ctypes.c_uint32),
                ("features", ctypes.c_uint32), ("wq_fd", ctypes.c_uint32), ("resv", ctypes.c_uint32 * 3),
                ("sq_off", _SqringOffsets), ("cq_off", _CqringOffsets)]


class _ProbeOp(ctypes.Structure):
    _fields_ = [("op", ctypes.c_uint8), ("resv", ctypes.c_uint8), ("flags", ctypes.c_uint16),
                ("resv2", ctypes.c_uint32)]


class _Probe(ctypes.Structure):
    _fields_ = [("last_op", ctypes.c_uint8), ("ops_len", ctypes.c_uint8), ("resv", ctypes.c_uint16),
                ("resv2", ctypes.c_uint32 * 3), ("ops", _ProbeOp * 256)]


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


assert ctypes.sizeof(_Params) == 120 and ctypes.sizeof(_ProbeOp) == 8


class Iovecs:
    """An array of ``struct iovec`` this module owns; it must stay alive until the read using it is reaped."""

    __slots__ = ("_array", "count", "address")

    def __init__(self, count: int = 1) -> None:
        self.count = count
        self._array = (_Iovec * count)()
        self.address = ctypes.addressof(self._array)

    def point(self, index: int, address: int, nbytes: int) -> None:
        """Make entry ``index`` describe ``nbytes`` at ``address``."""
        entry = self._array[index]
        entry.iov_base = address
        entry.iov_len = nbytes


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _syscall(number: int, *args: int) -> int:
    """``syscall(2)``; raises OSError with the call's errno on failure (the GIL is released while it runs)."""
    result = _libc().syscall(ctypes.c_long(number), *(ctypes.c_long(a) for a in args))
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return result


class _Ordered:
    """Loads with acquire and stores with release order on the u32 words of a shared mapping (module docstring)."""

    def __init__(self, mapping: mmap.mmap) -> None:
        self._words = memoryview(mapping).cast("I")
        anchor = ctypes.c_char.from_buffer(mapping)  # an export of the mapping, dropped at once so it can close
        self._base = ctypes.addressof(anchor)
        del anchor
        atomic = _libatomic()
        self._load_fn = self._store_fn = None
        if atomic is not None:
            # getattr: written as attributes, double-underscore names would be mangled inside a class
            self._load_fn, self._store_fn = getattr(atomic, "__atomic_load_4"), getattr(atomic, "__atomic_store_4")

    def load(self, offset: int) -> int:
        if self._load_fn is None:
            return self._words[offset >> 2]
        return self._load_fn(ctypes.c_void_p(self._base + offset), 2) & 0xFFFFFFFF  # __ATOMIC_ACQUIRE

    def store(self, offset: int, value: int) -> None:
        if self._store_fn is None:
            self._words[offset >> 2] = value & 0xFFFFFFFF
        else:
            self._store_fn(ctypes.c_void_p(self._base + offset), ctypes.c_uint32(value), 3)  # __ATOMIC_RELEASE

    def release(self) -> None:
        self._words.release()


def _tso() -> bool:
    """Whether plain loads and stores are already acquire/release ordered on this CPU (x86's total store order)."""
    return cpu.is_x86_64()


@functools.cache
def _libatomic_lib() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("atomic") or "libatomic.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    lib.__atomic_load_4.restype = ctypes.c_uint32
    lib.__atomic_load_4.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.__atomic_store_4.restype = None
    lib.__atomic_store_4.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int]
    return lib


FORCE_ATOMICS = False  # tests set it to run the libatomic path on x86 too


def _libatomic() -> ctypes.CDLL | None:
    """libatomic where plain accesses are not ordered enough (or FORCE_ATOMICS), else None."""
    if _tso() and not FORCE_ATOMICS:
        return None
    return _libatomic_lib()


def unsupported_reason() -> str | None:
    """Why this process cannot drive a ring at all (before any system call), or None."""
    if not os.uname().sysname == "Linux":
        return f"io_uring is Linux's; this is {os.uname().sysname}"
    machine = platform.machine().lower()
    if machine not in _MACHINES:
        return f"this binding does not know the io_uring system call numbers on {machine}"
    if not _tso() and _libatomic_lib() is None:
        return f"libatomic.so.1 is missing: the ring's head and tail cannot be read with the order {machine} needs"
    return None


class Ring:
    """One io_uring instance: ``entries`` submission slots, completions reaped by :meth:`completions`.

    Not thread-safe: one thread (the event loop's) prepares, submits and reaps.
    """

    def __init__(self, entries: int) -> None:
        reason = unsupported_reason()
        if reason is not None:
            raise OSError(errno.ENOSYS, reason)
        params = _Params(flags=IORING_SETUP_CLAMP)
        self.fd = _syscall(SYS_IO_URING_SETUP, entries, ctypes.addressof(params))
        self._maps: list[mmap.mmap] = []
        self._ordered: list[_Ordered] = []
        try:
            self._map_rings(params)
        except BaseException:
            self.close()
            raise
        self.features = params.features

    def _map(self, nbytes: int, offset: int) -> mmap.mmap:
        mapping = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                            mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
        self._maps.append(mapping)
        return mapping

    def _ordered_view(self, mapping: mmap.mmap) -> _Ordered:
        ordered = _Ordered(mapping)
        self._ordered.append(ordered)  # released before the mapping closes
        return ordered

    def _map_rings(self, p: _Params) -> None:
        sq_bytes = p.sq_off.array + p.sq_entries * 4
        cq_bytes = p.cq_off.cqes + p.cq_entries * _CQE.size
        if p.features & IORING_FEAT_SINGLE_MMAP:
            sq = cq = self._map(max(sq_bytes, cq_bytes), IORING_OFF_SQ_RING)
        else:
            sq, cq = self._map(sq_bytes, IORING_OFF_SQ_RING), self._map(cq_bytes, IORING_OFF_CQ_RING)
        self._sqes = self._map(p.sq_entries * _SQE.size, IORING_OFF_SQES)
        self._sq = self._ordered_view(sq)
        self._cq = self._sq if cq is sq else self._ordered_view(cq)
        self._cqmap = cq
        self.entries = p.sq_entries
        self.cq_entries = p.cq_entries
        self._sq_head, self._sq_tail = p.sq_off.head, p.sq_off.tail
        self._sq_mask = self._sq.load(p.sq_off.ring_mask)
        self._cq_head, self._cq_tail = p.cq_off.head, p.cq_off.tail
        self._cq_mask = self._cq.load(p.cq_off.ring_mask)
        self._cqes = p.cq_off.cqes
        # SQE index i always sits at array[i]: the slot an SQE is written into is the tail's own.
        array = memoryview(sq).cast("I")
        for i in range(p.sq_entries):
            array[p.sq_off.array // 4 + i] = i
        array.release()
        self._tail = self._sq.load(self._sq_tail)  # our copy; the kernel's is stored at submit

    # -- submission ---------------------------------------------------------

    def space(self) -> int:
        """Free submission slots (the kernel's head moves as it consumes SQEs)."""
        return self.entries - (self._tail - self._sq.load(self._sq_head)) % (1 << 32)

    def prep(self, opcode: int, fd: int, address: int, length: int, offset: int, user_data: int, *,
             buf_index: int = 0, flags: int = 0) -> bool:
        """Write one SQE into the next free slot; False when the submission queue is full.

        ``address``/``length`` are an iovec array and its count for the vectored ops, a buffer and its byte
        count for ``READ_FIXED``; ``buf_index`` names the registered buffer of the fixed ops.
        """
        if self.space() <= 0:
            return False
        _SQE.pack_into(self._sqes, (self._tail & self._sq_mask) * _SQE.size, opcode, flags, 0, fd, offset,
                       address, length, 0, user_data, buf_index, 0, 0, 0, 0)
        self._tail = (self._tail + 1) & 0xFFFFFFFF
        return True

    def pending(self) -> int:
        """SQEs written and not yet consumed by the kernel."""
        return (self._tail - self._sq.load(self._sq_head)) % (1 << 32)

    def submit(self, wait: int = 0) -> int:
        """Publish the SQEs written so far and enter the kernel; returns how many it consumed.

        Raises OSError (EAGAIN/EBUSY: the kernel is short of room now, the
        SQEs stay in the ring for the next submit; EINTR is retried).
        """
        self._sq.store(self._sq_tail, self._tail)
        to_submit = self.pending()
        flags = IORING_ENTER_GETEVENTS if wait else 0
        while True:
            try:
                return _syscall(SYS_IO_URING_ENTER, self.fd, to_submit, wait, flags, 0, 0)
            except InterruptedError:
                continue

    # -- completion ---------------------------------------------------------

    def completions(self) -> Iterator[tuple[int, int]]:
        """Every completion ready now, as ``(user_data, res)``; each is consumed once the loop moves past it."""
        cq = self._cq
        head = cq.load(self._cq_head)
        while True:
            tail = cq.load(self._cq_tail)
            if head == tail:
                return
            while head != tail:
                user_data, res, _flags = _CQE.unpack_from(self._cqmap, self._cqes + (head & self._cq_mask) * 16)
                head = (head + 1) & 0xFFFFFFFF
                cq.store(self._cq_head, head)  # the slot is the kernel's again: we have copied it out
                yield user_data, res

    # -- registration -------------------------------------------------------

    def register_buffers(self, buffers: Sequence[tuple[int, int]]) -> None:
        """Register ``(address, nbytes)`` memory as fixed buffers 0..n-1 (pins it); OSError if refused."""
        iovecs = Iovecs(len(buffers))
        for index, (address, nbytes) in enumerate(buffers):
            iovecs.point(index, address, nbytes)
        _syscall(SYS_IO_URING_REGISTER, self.fd, IORING_REGISTER_BUFFERS, iovecs.address, len(buffers))

    def register_eventfd(self, eventfd: int) -> None:
        """Have the kernel signal ``eventfd`` whenever it posts a completion."""
        value = ctypes.c_int32(eventfd)
        _syscall(SYS_IO_URING_REGISTER, self.fd, IORING_REGISTER_EVENTFD, ctypes.addressof(value), 1)

    def supported_ops(self) -> frozenset[int]:
        """The opcodes this kernel implements (``IORING_REGISTER_PROBE``, Linux 5.6); empty if it cannot say."""
        probe = _Probe()
        try:
            _syscall(SYS_IO_URING_REGISTER, self.fd, IORING_REGISTER_PROBE, ctypes.addressof(probe), 256)
        except OSError:
            return frozenset()
        return frozenset(op.op for op in probe.ops[:probe.ops_len] if op.flags & IO_URING_OP_SUPPORTED)

    # -- teardown -----------------------------------------------------------

    def close(self) -> None:
        """Unmap the rings and close the ring's fd (the kernel drops registrations with it). Idempotent."""
        for ordered in self._ordered:
            ordered.release()
        self._ordered = []
        for mapping in self._maps:
            mapping.close()
        self._maps = []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def self_test() -> str:
    """Set up a ring, run a NOP and a READV of this file, tear it down: the io_uring probe's child (one line)."""
    ring = Ring(8)
    try:
        efd = os.eventfd(0, os.EFD_CLOEXEC)
        try:
            ring.register_eventfd(efd)
            path = os.path.abspath(__file__)
            fd = os.open(path, os.O_RDONLY)
            try:
                buf = ctypes.create_string_buffer(64)
                iov = Iovecs(1)
                iov.point(0, ctypes.addressof(buf), 64)
                ring.prep(IORING_OP_NOP, -1, 0, 0, 0, 1)
                ring.prep(IORING_OP_READV, fd, iov.address, 1, 0, 2)
                ring.submit(wait=2)
                got = dict(ring.completions())
                with open(path, "rb") as f:
                    expected = f.read(64)
                if got.get(1) != 0 or got.get(2) != 64 or buf.raw != expected:
                    raise RuntimeError(f"io_uring returned {got} and bytes that differ from the file's")
            finally:
                os.close(fd)
        finally:
            os.close(efd)
        ops = ring.supported_ops()
    finally:
        ring.close()
    fixed = "READV_FIXED" if IORING_OP_READV_FIXED in ops else "READ_FIXED only"
    return f"io_uring rings set up and a read checked ({platform.machine()}, kernel {os.uname().release}, {fixed})"
