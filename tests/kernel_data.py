"""Test data for the kernel tests: valid random tensors of every type, the gguf reference,
and the same bytes placed where the engine may find them (pool slot, file mapping)."""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, quants

from colibri_aio.kernels.qtensor import QTensor

# Types gguf.quants cannot quantise, made as random raw blocks instead: the byte ranges of each
# block's f16 scales, which are set small and finite (random bits there could be inf or NaN).
RANDOM_BLOCK_SCALES = {
    T.Q4_K: slice(0, 4), T.Q5_K: slice(0, 4), T.Q6_K: slice(208, 210),
    T.Q2_K: slice(80, 84), T.Q3_K: slice(108, 110), T.IQ4_NL: slice(0, 2), T.IQ4_XS: slice(0, 2),
    T.IQ2_XXS: slice(0, 2), T.IQ2_XS: slice(0, 2), T.IQ2_S: slice(0, 2), T.IQ3_XXS: slice(0, 2),
    T.IQ3_S: slice(0, 2), T.IQ1_S: slice(0, 2),
    # IQ1_M's f16 d is the top nibbles of the four u16 at bytes 48-55 (set in _small_iq1_m_scale); NVFP4's
    # four UE4M3 scales are finite (at most 240) for every byte.
    T.IQ1_M: slice(0, 0), T.NVFP4: slice(0, 0),
}


def _small_iq1_m_scale(blocks: np.ndarray, d: np.ndarray) -> None:
    """Write the f16 ``d`` (one per block) into the top nibbles of IQ1_M's scales u16[4], low nibble first."""
    sc = blocks[:, 48:56].view(np.uint16)
    bits = d.view(np.uint16)[:, :1]
    sc &= np.uint16(0x0FFF)
    sc |= ((bits >> np.array([0, 4, 8, 12], np.uint16)) & np.uint16(0xF)) << np.uint16(12)


def cols_for(t: T, blocks: int) -> int:
    """Row length of ``blocks`` blocks (float types count 32 weights as a block)."""
    return max(GGML_QUANT_SIZES[t][0], 32) * blocks


def make_weights(t: T, shape: tuple[int, ...], seed: int = 0) -> QTensor:
    """A valid tensor of type ``t``: quantised random data, or random blocks with small finite scales
    for the types gguf.quants cannot quantise."""
    rng = np.random.default_rng(seed)
    if t in RANDOM_BLOCK_SCALES:
        block, type_size = GGML_QUANT_SIZES[t]
        blocks = rng.integers(0, 256, (int(np.prod(shape)) // block, type_size), dtype=np.uint8)
        sl = RANDOM_BLOCK_SCALES[t]
        if t == T.IQ1_M:
            _small_iq1_m_scale(blocks, (rng.uniform(-1, 1, (blocks.shape[0], 1)) * 2e-3).astype(np.float16))
        else:
            scales = (rng.uniform(-1, 1, (blocks.shape[0], (sl.stop - sl.start) // 2)) * 2e-3).astype(np.float16)
            blocks[:, sl] = scales.view(np.uint8)
        raw = blocks.reshape(-1)
    else:
        raw = quants.quantize(rng.standard_normal(shape).astype(np.float32), t).view(np.uint8).reshape(-1)
    return QTensor(np.ascontiguousarray(raw), t, shape)


def random_bytes(t: T, shape: tuple[int, ...], seed: int = 0) -> QTensor:
    """A tensor of type ``t`` whose bytes are all random: every bit pattern, non-finite scales included."""
    raw = np.random.default_rng(seed).integers(0, 256, QTensor.nbytes_for(t, shape), dtype=np.uint8)
    return QTensor(raw, t, shape)


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
