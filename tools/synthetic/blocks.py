"""Valid quantised blocks written straight from random bytes (no float weights, no quantiser).

Every block starts as random bytes; ``finish`` then overwrites its scale bytes
with one of 256 pre-computed headers (picked by a random byte of the block)
and fixes the few quant values a real quantiser never emits. The headers are
chosen so that the dequantised weights have a requested standard deviation and
(near) zero mean. This is ~1 byte of NumPy work per byte written, so a 32 GB
file costs what the random-number generator and the disk cost.

Layouts follow ggml's ``block_q8_0``, ``block_q4_K``, ``block_q6_K``, ``block_q5_0`` and ``block_mxfp4``;
the codebook types (``block_iq1_s``, ``block_iq2_xxs``, ``block_iq3_xxs``) take random codes as they are.
"""
from __future__ import annotations

import math
from typing import ClassVar, Protocol

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

LUT_SIZE = 256  # headers per tensor: indexed by one random byte of each block
# Root-mean-square of the quant value (after offsets) each format stores:
Q8_RMS = float(np.sqrt((2 * sum(q * q for q in range(1, 128)) + 127**2) / 256))  # int8, -128 folded to -127
Q4_RMS = float(np.sqrt(255 / 12))    # uniform 0..15 around its mean 7.5
Q6_RMS = float(np.sqrt(341.5))       # uniform -32..31
Q5_RMS = float(np.sqrt(85.5))        # q - 16 for q uniform 0..31: mean -0.5 (5% of the std), variance 85.25
SCALE_JITTER = 0.15                  # log-normal spread of block scales, as real tensors have


class Encoder(Protocol):
    """What the tensor writer needs from a block format."""

    qtype: T
    block: int
    type_size: int
    scale_bytes: slice  # zeroing these bytes makes every weight of the block exactly 0
    blind_columns: int  # the columns zero_first_32 zeroes (at least the CODE_CHANNELS code channels)

    def make_lut(self, rng: np.random.Generator, std: float) -> np.ndarray: ...

    def finish(self, blocks: np.ndarray, lut: np.ndarray) -> None: ...

    def apply_code(self, blocks: np.ndarray, signs: np.ndarray, lut: np.ndarray) -> float: ...

    def zero_first_32(self, blocks: np.ndarray) -> None: ...


def _jitter(rng: np.random.Generator) -> np.ndarray:
    """LUT_SIZE positive factors with root-mean-square exactly 1 (the std stays as asked)."""
    j = np.exp(SCALE_JITTER * rng.standard_normal(LUT_SIZE))
    return j / np.sqrt(np.mean(j * j))


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """(n,) float -> (n, 2) uint8, little-endian float16."""
    return np.ascontiguousarray(np.asarray(values, np.float16).astype("<f2")).view(np.uint8).reshape(-1, 2)


def _headers_from_lut(blocks: np.ndarray, lut: np.ndarray, where: slice) -> None:
    """Overwrite ``blocks[:, where]`` with ``lut[i]``, ``i`` = the block's (random) first header byte.

    Works on the widest word that divides the block and the header, and gathers
    whole words with ``np.take``: ~5x faster than byte-wise fancy indexing.
    """
    n, size = blocks.shape
    start, stop = where.start, where.stop
    w = math.gcd(size, start, stop - start, 8)
    words = blocks.reshape(-1).view(f"<u{w}").reshape(n, size // w)[:, start // w: stop // w]
    table = np.ascontiguousarray(lut).view(f"<u{w}")                # (LUT_SIZE, header words)
    index = words[:, 0] & 0xFF                                      # low byte = byte ``start``
    words[...] = np.take(table, index, axis=0)


def _fold_minus_128(blocks: np.ndarray) -> None:
    """Turn every int8 -128 (byte 0x80) into -127, in place, on the contiguous buffer."""
    flat = blocks.reshape(-1)
    mask = np.equal(flat, 0x80)
    np.add(flat, mask, out=flat, casting="unsafe")


class Q8_0:
    """32 int8 quants times one f16 scale ``d``: w = d * q."""

    qtype: ClassVar[T] = T.Q8_0
    block: ClassVar[int] = 32
    type_size: ClassVar[int] = 34
    scale_bytes: ClassVar[slice] = slice(0, 2)
    rms: ClassVar[float] = Q8_RMS  # of the stored quant value
    blind_columns: ClassVar[int] = 32

    def make_lut(self, rng: np.random.Generator, std: float) -> np.ndarray:
        return _f16_bytes(std * _jitter(rng) / self.rms)

    def finish(self, blocks: np.ndarray, lut: np.ndarray) -> None:
        # ggml never writes the quant -128 and its x86 dot products assume so. Folding on
        # the whole contiguous buffer before the headers go in beats touching strided quants.
        _fold_minus_128(blocks)
        _headers_from_lut(blocks, lut, self.scale_bytes)

    def apply_code(self, blocks: np.ndarray, signs: np.ndarray, lut: np.ndarray) -> float:
        """Make ``blocks`` (one per row) hold ``±a`` in the pattern ``signs``; returns ``a``."""
        d = np.float16(lut.view("<f2")[0, 0])
        blocks[:, 0:2] = _f16_bytes(np.array([d]))
        blocks[:, 2:] = (127 * np.sign(signs)).astype(np.int8).view(np.uint8)
        return float(d) * 127

    def zero_first_32(self, blocks: np.ndarray) -> None:
        """Weights 0..31 of ``blocks`` (one per row, the row's first) become 0."""
        blocks[:, 0:2] = 0


def pack_k4_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """(n, 8) 6-bit scales and mins -> (n, 12) bytes, the inverse of ggml's get_scale_min_k4."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    out = np.empty(sc.shape[:-1] + (12,), np.uint8)
    out[..., 0:4] = (sc[..., 0:4] & 0x3F) | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = (m[..., 0:4] & 0x3F) | ((m[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 0x0F) | ((m[..., 4:8] & 0x0F) << 4)
    return out


class Q4_K:
    """256 weights: f16 d and dmin, eight 6-bit (scale, min) pairs, 4-bit quants.

    w = d*sc*q - dmin*m. With dmin = 8*d and m = round(7.5*sc/8) the offset
    cancels the mean of q (7.5), so weights are zero-mean and uniform in each
    32-weight sub-block; sc in [32, 63] gives sub-blocks of differing spread.
    """

    qtype: ClassVar[T] = T.Q4_K
    block: ClassVar[int] = 256
    type_size: ClassVar[int] = 144
    scale_bytes: ClassVar[slice] = slice(0, 4)
    blind_columns: ClassVar[int] = 32

    def make_lut(self, rng: np.random.Generator, std: float) -> np.ndarray:
        sc = rng.integers(32, 64, size=(LUT_SIZE, 8))
        m = np.rint(7.5 * sc / 8).astype(np.int64)
        d = std * _jitter(rng) / (Q4_RMS * np.sqrt(np.mean(sc.astype(np.float64) ** 2, axis=1)))
        d16 = np.asarray(d, np.float16)
        lut = np.empty((LUT_SIZE, 16), np.uint8)
        lut[:, 0:2] = _f16_bytes(d16)
        lut[:, 2:4] = _f16_bytes(d16.astype(np.float32) * 8)  # exact: a power of two
        lut[:, 4:16] = pack_k4_scales(sc, m)
        return lut

    def finish(self, blocks: np.ndarray, lut: np.ndarray) -> None:
        _headers_from_lut(blocks, lut, slice(0, 16))

    def apply_code(self, blocks: np.ndarray, signs: np.ndarray, lut: np.ndarray) -> float:
        """Sub-block 0 (the low nibbles of qs[0:32]) holds ±120*d in the pattern ``signs``.

        With sc=16, m=15 and dmin=8d: q=15 gives d*(240-120) = +120d, q=0 gives -120d.
        The other 224 weights of the super-block stay random.
        """
        header = lut[0].copy()
        sc = np.full((1, 8), 32)
        sc[0, 0] = 16
        m = np.rint(7.5 * sc / 8).astype(np.int64)
        m[0, 0] = 15
        header[4:16] = pack_k4_scales(sc, m)[0]
        blocks[:, 0:16] = header
        low = np.where(signs > 0, 15, 0).astype(np.uint8)
        blocks[:, 16:48] = (blocks[:, 16:48] & 0xF0) | low
        return float(header[0:2].view("<f2")[0]) * 120

    def zero_first_32(self, blocks: np.ndarray) -> None:
        """Sub-block 0 gets sc = m = 0 (low 6 bits of scale bytes 0 and 4; the top 2 bits belong to sub-block 4)."""
        blocks[:, 4] &= 0xC0
        blocks[:, 8] &= 0xC0


class Q6_K:
    """256 weights: 6-bit quants (ql, qh), sixteen int8 scales, f16 d: w = d*sc*(q-32)."""

    qtype: ClassVar[T] = T.Q6_K
    block: ClassVar[int] = 256
    type_size: ClassVar[int] = 210
    scale_bytes: ClassVar[slice] = slice(208, 210)
    blind_columns: ClassVar[int] = 32

    def make_lut(self, rng: np.random.Generator, std: float) -> np.ndarray:
        sc = rng.integers(64, 128, size=(LUT_SIZE, 16))
        d = std * _jitter(rng) / (Q6_RMS * np.sqrt(np.mean(sc.astype(np.float64) ** 2, axis=1)))
        lut = np.empty((LUT_SIZE, 18), np.uint8)
        lut[:, 0:16] = sc.astype(np.int8).view(np.uint8)
        lut[:, 16:18] = _f16_bytes(d)
        return lut

    def finish(self, blocks: np.ndarray, lut: np.ndarray) -> None:
        _headers_from_lut(blocks, lut, slice(192, 210))

    def apply_code(self, blocks: np.ndarray, signs: np.ndarray, lut: np.ndarray) -> float:
        raise NotImplementedError("Q6_K is only used for the output head, which carries no code channels")

    def zero_first_32(self, blocks: np.ndarray) -> None:
        """The int8 scales of weights 0..15 and 16..31 become 0."""
        blocks[:, 192:194] = 0


class Q5_0(Q8_0):
    """32 weights: f16 d, 4 bytes of fifth bits, 16 bytes of low nibbles: w = d * (q - 16), q in 0..31.

    Its scale sits where Q8_0's does, so LUT and zeroing are Q8_0's. Random bytes
    give q uniform over 0..31 (mean -0.5 d, not quite zero); only the scale is set.
    Used where llama.cpp's Q4_K_M falls back for rows that are not whole super-blocks.
    """

    qtype: ClassVar[T] = T.Q5_0
    type_size: ClassVar[int] = 22
    rms: ClassVar[float] = Q5_RMS

    def finish(self, blocks: np.ndarray, lut: np.ndarray) -> None:
        _headers_from_lut(blocks, lut, self.scale_bytes)

    def apply_code(self, blocks: np.ndarray, signs: np.ndarray, lut: np.ndarray) -> float:
        raise NotImplementedError("Q5_0 only stands in for K-quant rows of odd width, which carry no code")


MXFP4_TABLE = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float64)  # ggml's doubled E2M1
MXFP4_RMS = float(np.sqrt(np.mean(MXFP4_TABLE ** 2)))


class MXFP4:
    """32 weights: one E8M0 byte e, 16 bytes of 4-bit codes: w = K[q] * 2^(e-128) (gpt-oss experts).

    Scales are powers of two, so the LUT mixes the two exponents around the
    requested std in the proportion that gives exactly its mean square.
    """

    qtype: ClassVar[T] = T.MXFP4
    block: ClassVar[int] = 32
    type_size: ClassVar[int] = 17
    # zeroing the codes (not the exponent: 2^-128 is not 0) makes every weight of the block 0
    scale_bytes: ClassVar[slice] = slice(1, 17)
    blind_columns: ClassVar[int] = 32

    def make_lut(self, rng: np.random.Generator, std: float) -> np.ndarray:
        x = np.log2(std / MXFP4_RMS)
        lo = np.floor(x)
        p_lo = (4.0 ** (lo + 1) - 4.0 ** x) / (4.0 ** (lo + 1) - 4.0 ** lo)
        e = np.where(np.arange(LUT_SIZE) < round(p_lo * LUT_SIZE), lo, lo + 1) + 128
        return rng.permutation(e).astype(np.uint8).reshape(LUT_SIZE, 1)

    def finish(self, blocks: np.ndarray, lut: np.ndarray) -> None:
        _headers_from_lut(blocks, lut, slice(0, 1))

    def apply_code(self, blocks: np.ndarray, signs: np.ndarray, lut: np.ndarray) -> float:
        raise NotImplementedError("MXFP4 holds experts only, which carry no code channels")

    def zero_first_32(self, blocks: np.ndarray) -> None:
        blocks[:, 1:17] = 0


class Codebook(Q5_0):
    """A 256-weight codebook type whose block starts with its f16 scale ``d`` (IQ1_S, IQ2_XXS, IQ3_XXS).

    Every byte pattern after ``d`` is a valid block: grid indices, sign indices and sub-block scales are all
    in range, so random bytes are random codes, the signs make the weights zero-mean, and the weights are
    ``d`` times a fixed code distribution. Its root-mean-square (at ``d`` = 1) is measured once on random
    blocks by gguf's own dequantiser, so the LUT's ``d`` (Q5_0's: the scale alone) gives the requested std for
    any of these types. ``d`` = 0 zeroes the block: as IQ sub-block scales have no zero, the blind columns of
    a row are its whole first block (256 weights, not only the code channels).
    """

    block: ClassVar[int] = 256
    blind_columns: ClassVar[int] = 256

    def __init__(self, qtype: T) -> None:
        self.qtype = qtype  # type: ignore[misc]
        self.type_size = GGML_QUANT_SIZES[qtype][1]  # type: ignore[misc]
        self.rms = _code_rms(qtype, self.type_size)  # type: ignore[misc]

    def apply_code(self, blocks: np.ndarray, signs: np.ndarray, lut: np.ndarray) -> float:
        raise NotImplementedError(f"{self.qtype.name} holds routed experts only, which carry no code channels")


def _code_rms(qtype: T, type_size: int, n_blocks: int = 4096) -> float:
    """RMS of the weights of random ``qtype`` blocks with d = 1, by gguf.quants (a fixed seed: reproducible)."""
    from gguf.quants import dequantize

    blocks = np.random.default_rng(0).integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    blocks[:, 0:2] = _f16_bytes(np.ones(1))
    return float(np.sqrt(np.mean(np.square(dequantize(blocks.reshape(-1), qtype), dtype=np.float64))))


ENCODERS: dict[T, Encoder] = {e.qtype: e for e in (Q8_0(), Q4_K(), Q6_K(), Q5_0(), MXFP4(),
                                                      *(Codebook(t) for t in (T.IQ1_S, T.IQ2_XXS, T.IQ3_XXS)))}

for _enc in ENCODERS.values():  # the layouts above must agree with gguf's table
    assert GGML_QUANT_SIZES[_enc.qtype] == (_enc.block, _enc.type_size), _enc.qtype
