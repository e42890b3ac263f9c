"""Test data for the kernel tests: valid random tensors of every type, the gguf reference,
and the same bytes placed where the engine may find them (pool slot, file mapping)."""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, quants

from colibri_aio.kernels.qtensor import QTensor

K_TYPES = {T.Q4_K, T.Q5_K, T.Q6_K}
# Byte offset of each block's f16 scale(s) in the K-quant layouts.
K_SCALE_BYTES = {T.Q4_K: slice(0, 4), T.Q5_K: slice(0, 4), T.Q6_K: slice(208, 210)}


def make_weights(t: T, shape: tuple[int, ...], seed: int = 0) -> QTensor:
    """A valid tensor of type ``t``: quantised random data, or random K-quant blocks with small finite scales
    (gguf.quants cannot quantise K-types)."""
    rng = np.random.default_rng(seed)
    if t in K_TYPES:
        block, type_size = GGML_QUANT_SIZES[t]
        blocks = rng.integers(0, 256, (int(np.prod(shape)) // block, type_size), dtype=np.uint8)
        sl = K_SCALE_BYTES[t]
        scales = (rng.uniform(-1, 1, (blocks.shape[0], (sl.stop - sl.start) // 2)) * 2e-3).astype(np.float16)
        blocks[:, sl] = scales.view(np.uint8)
        raw = blocks.reshape(-1)
    else:
        raw = quants.quantize(rng.standard_normal(shape).astype(np.float32), t).view(np.uint8).reshape(-1)
    return QTensor(np.ascontiguousarray(raw), t, shape)


def reference(w: QTensor) -> np.ndarray:
    """gguf's own dequantisation, in float64, as (rows, cols)."""
    return quants.dequantize(w.data, w.ggml_type).reshape(w.rows, w.cols).astype(np.float64)


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(ours.astype(np.float64) - ref) / np.linalg.norm(ref))


def placed(w: QTensor, offset: int) -> QTensor:
    """The same bytes at ``offset`` inside a 4096-aligned buffer, as in an I/O pool slot."""
    slot = np.zeros(offset + w.nbytes + 8192, dtype=np.uint8)
    start = (-slot.ctypes.data) % 4096
    view = slot[start + offset: start + offset + w.nbytes]
    view[:] = w.data
    return QTensor(view, w.ggml_type, w.shape)


def mapped(w: QTensor, path) -> QTensor:
    """The same bytes in a file mapping at a 32-byte (GGUF-style) offset."""
    with open(path, "wb") as f:
        f.write(b"\0" * 96 + w.data.tobytes())
    return QTensor(np.memmap(path, np.uint8, "r", offset=96, shape=(w.nbytes,)), w.ggml_type, w.shape)
