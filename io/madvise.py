"""``madvise(2)`` with the GIL released.

Python's ``mmap.madvise`` holds the GIL for the whole system call. A
``MADV_POPULATE_READ`` that waits for the disk then stops every other thread
of the process until the disk is done: beside a thread populating 2 GiB that
way, a decode step took 2.26x its time; through libc, 0.99x
(evidence/fill_interference_20261207T235812Z.md). Called through libc, the
GIL is released as for any other foreign call.
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import os

import numpy as np


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def address_of(mapped: mmap.mmap) -> int:
    """The address of byte 0 of ``mapped`` (valid while the mapping is open)."""
    return int(np.frombuffer(mapped, np.uint8, 1).ctypes.data)


def madvise(address: int, nbytes: int, advice: int) -> None:
    """``madvise(address, nbytes, advice)`` without the GIL (``address`` page-aligned); OSError on failure."""
    if _libc().madvise(address, nbytes, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
