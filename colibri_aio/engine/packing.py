"""Experts put into the kernels' own layout as they land, so that compute never sees the file's.

ggml multiplies some types faster in its repacked layout (rows interleaved in
groups of 8) than in the file's; llama.cpp repacks every expert at load. We
read experts as they are needed, so each one is repacked when its read lands,
before the cache calls it ready (:class:`~colibri_aio.kernels.ggml_cpu.ExpertPacker`
says which types and does it):

- in a buffer-pool slot, in place: the slot's bytes become the repacked ones;
- from the mmap reader, into a copy beside the mapping: the page cache's pages
  are the file's and are shared, so the repacked bytes go to anonymous memory
  laid out as the file's stacked tensors are (expert ``e`` of a matrix at
  ``e x`` its size), and the stacks a decode graph picks experts from are
  the copies.

Every expert of a repacked type is repacked wherever it lands, so which reader,
cache size or prefetch setting served it never changes a bit.
"""
from __future__ import annotations

import mmap
from collections.abc import Callable

import numpy as np

from colibri_aio.experts import ExpertLocation, ExpertWeights, TensorRange
from colibri_aio.kernels.qtensor import QTensor


class LandedPacking:
    """Repacks each expert whose read has landed, for one expert source.

    ``packer``: the kernels' :class:`~colibri_aio.kernels.ggml_cpu.ExpertPacker` (``packs``/``pack``);
    ``locate(layer, expert)``: where an expert's ranges are in the file; ``mapped``: the source's bytes are
    views of the file's mapping (copies are made), else pool slots (repacked in place).
    """

    def __init__(self, packer: object, locate: Callable[[int, int], ExpertLocation], n_experts: int,
                 mapped: bool, release: Callable[[TensorRange], None] | None = None, prepacked: bool = False) -> None:
        """``prepacked``: the reader reads a repacked experts file (:mod:`~colibri_aio.engine.repacked_file`):
        its bytes are repacked already, and are only marked so."""
        self.packer = packer
        self.prepacked = prepacked
        self._locate = locate
        self._release = release
        self._n_experts = n_experts
        self.mapped = mapped
        self._copies: dict[tuple[int, int], np.ndarray] = {}   # (layer, projection) -> the copy of its tensor
        self.nbytes = 0                                         # bytes of copies made (mapped only)

    def packs(self, r: TensorRange) -> bool:
        """Whether the matrix ``r`` is repacked when it lands."""
        return self.packer.packs(r.ggml_type, r.shape[0])  # type: ignore[attr-defined]

    def land(self, key: tuple[int, int], weights: ExpertWeights) -> ExpertWeights:
        """The expert ``key`` (layer, expert) whose bytes ``weights`` just landed, in the kernels' layout."""
        loc = self._locate(*key)
        mats = []
        for p, (r, w) in enumerate(zip(loc.ranges, (weights.gate, weights.up, weights.down))):
            if w.packed or not self.packs(r):
                mats.append(w)
            elif self.prepacked:
                mats.append(QTensor(w.data, w.ggml_type, w.shape, packed=True))
            elif self.mapped:
                place = self._copy(key[0], p, r)[key[1] * r.nbytes: (key[1] + 1) * r.nbytes]
                mats.append(self.packer.pack(w, place))  # type: ignore[attr-defined]
                if self._release is not None:
                    self._release(r)
            else:
                mats.append(self.packer.pack(w))  # type: ignore[attr-defined]
        return ExpertWeights(*mats)

    def copy_base(self, layer: int, projection: int) -> int | None:
        """The address of expert 0's matrix ``projection`` (0 gate, 1 up, 2 down) of ``layer`` in the copies,
        the others one matrix's size apart; None when that matrix keeps the file's layout (and bytes)."""
        r = self._locate(layer, 0).ranges[projection]
        if not self.mapped or self.prepacked or not self.packs(r):
            return None
        return int(self._copy(layer, projection, r).ctypes.data)

    def _copy(self, layer: int, projection: int, r: TensorRange) -> np.ndarray:
        """The copy of one stacked tensor, made on first use; its pages are only backed once written."""
        key = (layer, projection)
        copy = self._copies.get(key)
        if copy is None:
            size = self._n_experts * r.nbytes
            # An anonymous mapping of base pages (page aligned), not NumPy's allocator, which asks for huge
            # pages: a huge page must be a free 2 MiB block, where a base page can be one the page cache
            # just gave back (LandedPacking's release), so the copies reuse the memory the file's pages left.
            pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            copy = self._copies[key] = np.frombuffer(pages, np.uint8)
            self.nbytes += size
        return copy
