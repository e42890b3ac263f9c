"""iovec arrays for the liburing wheel that point at memory we own, without pinning it.

``liburing.Iovec`` takes its entries from Python buffers, and for a
``memoryview`` it never gives the buffer back: the export outlives the Iovec,
so an mmap'd arena behind it can never be unmapped (and a fresh slice per read
would leak one view per read). So each Iovec here is built over throw-away
``bytearray``s (which it does release) and its C ``iovec`` entries are then
pointed at the pool's addresses. The object layout this relies on is checked
once, against a known Iovec; if it does not match, io_uring is reported as
unusable and the reader falls back to pread.
"""
from __future__ import annotations

import ctypes
import functools

try:
    import liburing as L
except ImportError:
    L = None

# PyObject header (refcount, type), then the wheel's struct: entry count, entry pointer.
_COUNT_WORD = 2
_ENTRIES_WORD = 3


class PointedIovec:
    """A ``liburing.Iovec`` of ``count`` entries whose base/length we set."""

    __slots__ = ("iovec", "_entries", "count")

    def __init__(self, count: int = 1) -> None:
        self.count = count
        self.iovec = L.Iovec([bytearray(1) for _ in range(count)])
        words = (ctypes.c_uint64 * (_ENTRIES_WORD + 1)).from_address(id(self.iovec))
        self._entries = (ctypes.c_uint64 * (2 * count)).from_address(words[_ENTRIES_WORD])

    def point(self, index: int, address: int, nbytes: int) -> None:
        """Make entry ``index`` describe ``nbytes`` at ``address``."""
        self._entries[2 * index] = address
        self._entries[2 * index + 1] = nbytes


@functools.cache
def layout_problem() -> str | None:
    """None when the wheel's Iovec has the layout PointedIovec writes into, else why not."""
    if L is None:
        return "the liburing package is not installed"
    buffers = [bytearray(3), bytearray(5)]
    probe = L.Iovec(buffers)
    words = (ctypes.c_uint64 * (_ENTRIES_WORD + 1)).from_address(id(probe))
    if words[_COUNT_WORD] != len(buffers) or words[_ENTRIES_WORD] == 0:
        return "liburing.Iovec has an object layout this reader does not know"
    entries = (ctypes.c_uint64 * 4).from_address(words[_ENTRIES_WORD])
    for index, buf in enumerate(buffers):
        view = (ctypes.c_char * len(buf)).from_buffer(buf)
        expected = (ctypes.addressof(view), len(buf))
        del view
        if (entries[2 * index], entries[2 * index + 1]) != expected:
            return "liburing.Iovec entries are not where this reader expects them"
    return None
