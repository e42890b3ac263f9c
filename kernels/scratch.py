"""Kernel-owned, page-aligned scratch buffers that are allocated once and reused.

The quantised kernels never let a BLAS call or a reduction see the caller's
memory: weights and activations are converted into these buffers first. Every
buffer starts on a 4096-byte boundary, so the arithmetic a BLAS kernel picks
(which may depend on pointer alignment) is the same whether the GGUF bytes
came from an mmap, a RAM copy or an I/O buffer-pool slot.
"""
from __future__ import annotations

import math
import threading

import numpy as np

ALIGN = 4096


class Scratch:
    """Named growable buffers of one thread; a view returned stays valid until the next ``get`` of that name."""

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}
        # The same few (name, shape, dtype) views are asked for on every chunk: keep them.
        self._views: dict[tuple[str, tuple[int, ...], type | np.dtype], np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: type | np.dtype) -> np.ndarray:
        """An uninitialised, 4096-aligned, C-contiguous array of ``shape`` and ``dtype``."""
        key = (name, shape, dtype)
        view = self._views.get(key)
        if view is not None:
            return view
        dt = np.dtype(dtype)
        nbytes = math.prod(shape) * dt.itemsize
        buf = self._buffers.get(name)
        if buf is None or buf.size < nbytes:
            buf = _aligned_bytes(max(nbytes, 2 * (0 if buf is None else buf.size)))
            self._buffers[name] = buf
            self._views = {k: v for k, v in self._views.items() if k[0] != name}
        if len(self._views) > 256:  # shapes vary with tensor shapes; stay bounded
            self._views.clear()
        view = self._views[key] = buf[:nbytes].view(dt).reshape(shape)
        return view


def _aligned_bytes(nbytes: int) -> np.ndarray:
    """``nbytes`` (at least one page) of zeroed memory starting on an ALIGN boundary."""
    nbytes = max(nbytes, ALIGN)
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    raw.fill(0)  # touch the pages now, not in the hot loop
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + nbytes]


def aligned_empty(shape: tuple[int, ...], dtype: type | np.dtype) -> np.ndarray:
    """A new, touched, ALIGN-aligned array (for constants that BLAS reads)."""
    dt = np.dtype(dtype)
    return _aligned_bytes(math.prod(shape) * dt.itemsize)[:math.prod(shape) * dt.itemsize].view(dt).reshape(shape)


_local = threading.local()


def thread_scratch() -> Scratch:
    """The calling thread's own :class:`Scratch`."""
    s = getattr(_local, "scratch", None)
    if s is None:
        s = _local.scratch = Scratch()
    return s
