"""QTensor: a GGUF tensor as its raw bytes, its ggml type and its logical shape."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType


@dataclass(frozen=True, slots=True)
class QTensor:
    """Raw bytes of one 1-D or 2-D GGUF tensor, exactly as stored in the file.

    ``shape`` is in NumPy order: ``(rows, cols)`` where ``cols`` is ggml's
    ``ne[0]`` (the contiguous, quantised axis) and ``rows`` the output features
    of a weight matrix. ``data`` is a uint8 view (never a copy) of
    ``rows * cols / block_size * type_size`` bytes; it may live in an mmap of
    the file, in RAM, or in an I/O buffer-pool slot.

    ``packed``: the bytes are in ggml's CPU_REPACK layout of this CPU (rows
    interleaved in groups of 8, the same size as the file's), not the file's:
    only a backend that made them (:class:`~colibri_aio.kernels.ggml_cpu.ExpertPacker`)
    can multiply by them.
    """

    data: np.ndarray
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    packed: bool = False

    def __post_init__(self) -> None:
        block, type_size = GGML_QUANT_SIZES[self.ggml_type]
        cols = self.shape[-1]
        if cols % block:
            raise ValueError(f"{self.ggml_type.name}: row length {cols} is not a multiple of {block}")
        want = math.prod(self.shape) // block * type_size  # math.prod: np.prod costs ~5 µs per call
        if self.data.dtype != np.uint8 or self.data.ndim != 1 or self.data.size != want:
            raise ValueError(
                f"{self.ggml_type.name}{self.shape}: need {want} bytes as a flat uint8 array, "
                f"got {self.data.size} {self.data.dtype} ndim={self.data.ndim}")

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1]) if len(self.shape) > 1 else 1

    @property
    def cols(self) -> int:
        return self.shape[-1]

    @property
    def nbytes(self) -> int:
        return self.data.size

    @staticmethod
    def nbytes_for(ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
        """Bytes a tensor of this type and shape occupies in a GGUF."""
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        return math.prod(shape) // block * type_size

    def row_block(self, start: int, stop: int) -> "QTensor":
        """The rows [start, stop) as a QTensor view (rows are contiguous byte runs)."""
        if self.packed:
            raise ValueError("a repacked matrix interleaves its rows: it has no row blocks")
        row_bytes = self.nbytes // self.rows
        return QTensor(self.data[start * row_bytes: stop * row_bytes], self.ggml_type, (stop - start, self.cols))


class FFNWeights(Protocol):
    """An expert FFN's three matrices (gate and up: (F, D); down: (D, F))."""

    @property
    def gate(self) -> QTensor: ...

    @property
    def up(self) -> QTensor: ...

    @property
    def down(self) -> QTensor: ...
