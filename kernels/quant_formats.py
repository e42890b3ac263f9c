"""How each GGML type's blocks become numbers, vectorised over a chunk of rows.

A quantised row is decoded in two parts, both in *layout order* (a fixed
permutation of the row's columns chosen per type so that NumPy works on long
contiguous runs instead of 16- or 32-element pieces):

* ``decode(raw, scratch)`` -> the integer quant values, ``(rows, cols)`` int8
  or uint8 -- for IQ4_NL, IQ4_XS, MXFP4 and NVFP4 the small integers their 4-bit
  codes stand for, for the IQ1/IQ2/IQ3 types their codebook values times their
  signs -- (or float32 for the float types, which have no scales);
* ``prepare(raw, index)`` -> :class:`Scales`, one value per sub-block of
  ``sub`` consecutive layout columns, ``(rows, sub_blocks)`` float32: the
  factor ``mul`` and, for Q4_1/Q5_1 (``m``) and Q2_K/Q4_K/Q5_K
  (``-dmin * m``), the additive ``bias``, so that ``weight = q * mul + bias``. ``index`` (from :func:`scale_index`)
  names, per layout sub-block, the block and the natural scale it uses; the
  small integer scales are gathered into layout order before any float work,
  so every pass runs over whole rows.

``raw`` is always the ``(rows, blocks_per_row, type_size)`` uint8 view of the
GGUF bytes; nibbles and high bits are unpacked eight at a time on uint64 words.
``column_order(cols)`` gives, for each layout position, the natural column it
holds (``None`` when layout order is natural order).

Byte layouts follow ggml's ``block_<type>`` structs (``block_q8_0`` ...
``block_iq4_xs``, ``block_iq1_s`` ... ``block_iq3_s``, ``block_tq1_0``,
``block_tq2_0``, ``block_mxfp4``, ``block_nvfp4``); each is drawn beside its decoder.
``gguf.quants.dequantize`` is the reference: ``dequantize`` reproduces it bit
for bit, since ``q * mul + bias`` is the same float32 arithmetic.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, quants

from colibri_aio.kernels.scratch import Scratch, thread_scratch


class ScaleIndex(NamedTuple):
    """For each layout sub-block of a row: its block, and which of the block's scales it uses."""

    block: np.ndarray
    scale: np.ndarray


class Scales(NamedTuple):
    """Per-sub-block float32 scales of a run of rows (row axis first, so they slice by rows)."""

    mul: np.ndarray | None
    bias: np.ndarray | None


@dataclass(frozen=True, slots=True)
class Format:
    """One GGML type: block geometry, layout and the decoding steps."""

    ggml_type: T
    block: int          # weights per block
    type_size: int      # bytes per block
    sub: int            # layout columns sharing one (mul, bias); 0 for float types
    prepare: Callable[[np.ndarray, "ScaleIndex"], Scales]
    decode: Callable[[np.ndarray, Scratch], np.ndarray]
    column_order: Callable[[int], np.ndarray | None]
    has_bias: bool = False  # Scales.bias is set (Q4_K, Q5_K: the -dmin * m term)


def _split(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A view of ``a`` reshaped; never a silent copy (``out=`` must land in ``a``)."""
    return a.reshape(shape, copy=False)


def _natural(cols: int) -> None:
    return None


# --- f16 -> f32 without NumPy's per-element software conversion ---

_F16_TO_F32_SCALE = np.float32(2.0 ** 112)  # rebias the exponent: 2^(127 - 15)


def f16_to_f32(h: np.ndarray, out: np.ndarray, scratch: Scratch) -> np.ndarray:
    """Convert f16 bit patterns ``h`` (uint16, any strides) into float32 ``out``, exactly.

    The 15 magnitude bits shifted up by 13 are an f32 whose exponent is 112
    too small; one multiply by 2^112 fixes normals and subnormals alike.
    Infinities and NaNs (f16 exponent 31) come out >= 2^16 and are patched.
    """
    bits = out.view(np.uint32)
    sign = scratch.get("f16_sign", out.shape, np.uint32)
    np.copyto(bits, h)
    np.bitwise_and(bits, 0x8000, out=sign)
    np.bitwise_xor(bits, sign, out=bits)
    np.left_shift(bits, 13, out=bits)
    np.multiply(out, _F16_TO_F32_SCALE, out=out)
    if out.size and out.max() >= 65536.0:
        special = out >= 65536.0
        bits[special] = (bits[special].view(np.float32) / _F16_TO_F32_SCALE).view(np.uint32) | 0x7F800000
    np.left_shift(sign, 16, out=sign)
    np.bitwise_or(bits, sign, out=bits)
    return out


def _f16_field(raw: np.ndarray, start: int) -> np.ndarray:
    """The f16 at byte ``start`` of every block as float32, shape (rows, blocks)."""
    h = raw[..., start:start + 2].view(np.uint16)[..., 0]
    return f16_to_f32(h, np.empty(h.shape, np.float32), thread_scratch())


# --- float types: a straight conversion into scratch; copying still matters (see quant.py) ---

def _no_scales(raw: np.ndarray, index: ScaleIndex) -> Scales:
    return Scales(None, None)


def _flat(raw: np.ndarray) -> np.ndarray:
    return _split(raw, (raw.shape[0], -1))


def _decode_f32(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    out = scratch.get("wf", (raw.shape[0], raw.shape[1]), np.float32)
    np.copyto(out, _flat(raw).view(np.float32))
    return out


def _decode_f16(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    out = scratch.get("wf", (raw.shape[0], raw.shape[1]), np.float32)
    return f16_to_f32(_flat(raw).view(np.uint16), out, scratch)


def _decode_bf16(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    # bf16 is the top half of an f32: widen the uint16 and shift it up.
    out = scratch.get("wf", (raw.shape[0], raw.shape[1]), np.float32)
    bits = out.view(np.uint32)
    np.copyto(bits, _flat(raw).view(np.uint16))
    np.left_shift(bits, 16, out=bits)
    return out


# --- SWAR helpers on uint64 words (eight packed bytes) ---

_LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
_TOP_BITS = np.uint64(0x8080808080808080)
_PLANES = np.arange(2).reshape(2, 1)  # picks [mul | bias] planes out of (R, blocks, 2) scale pairs


def _bytes_x8(c: int) -> np.uint64:
    return np.uint64(int.from_bytes(bytes([c]) * 8, "little"))


_ONE_EACH = _bytes_x8(1)
_TWO_BITS = _bytes_x8(3)
_PAIR_SHIFTS = (np.arange(4, dtype=np.uint64) * 2).reshape(4, 1)  # the four 2-bit fields of a byte


def _words(a: np.ndarray) -> np.ndarray:
    """A uint8 array whose last axis is contiguous and a multiple of 8 bytes, as uint64 words."""
    return a.view(np.uint64)


def _subtract_each_byte(w: np.ndarray, c: int) -> None:
    """Every byte b (< 128) of ``w`` becomes (b - c) mod 256, so read as int8 it is b - c.

    Setting each top bit first means no byte borrows from its neighbour.
    """
    np.bitwise_or(w, _TOP_BITS, out=w)
    np.subtract(w, _bytes_x8(c), out=w)
    np.bitwise_xor(w, _TOP_BITS, out=w)


def _nibbles(qs: np.ndarray, low: np.ndarray, high: np.ndarray) -> None:
    """uint64 words of packed nibbles -> their low and high nibbles, one per byte."""
    np.bitwise_and(qs, _LOW_NIBBLES, out=low)
    np.right_shift(qs, np.uint64(4), out=high)
    np.bitwise_and(high, _LOW_NIBBLES, out=high)


def _contiguous_bytes(raw: np.ndarray, start: int, stop: int, name: str, scratch: Scratch) -> np.ndarray:
    """Bytes [start, stop) of every block copied into aligned scratch, (rows, blocks, stop - start)."""
    out = scratch.get(name, (raw.shape[0], raw.shape[1], stop - start), np.uint8)
    np.copyto(out, raw[..., start:stop])
    return out


# --- Q8_0: d (f16) + 32 x int8. Natural layout; the int8 values are read in place. ---

def _prepare_q8_0(raw: np.ndarray, index: ScaleIndex) -> Scales:
    """mul = d per sub-block, for every type whose block opens with its one f16 scale d."""
    d = _f16_field(raw, 0)                                                  # (R, nb)
    return Scales(d if index.scale.size == 0 else d[:, index.block], None)  # empty scale: natural order


def _decode_q8_0(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    return raw[..., 2:].view(np.int8)                                      # (R, nb, 32), strided


# --- 4-bit types with 32-weight blocks (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4) share one nibble layout:
# 16 bytes qs[l] hold weight l in the low nibble and weight 16 + l in the high one. Layout (h, b, l):
# all low-nibble halves of the row, then all high ones, so a sub-block of 16 layout columns is one
# half of one block and every pass runs over whole rows. ---

def _nibble_words(raw: np.ndarray, start: int, scratch: Scratch) -> np.ndarray:
    """The 16 packed bytes at ``start`` of every block, one nibble per byte in layout (h, b, l).

    Returns uint64 words ``(rows, 2, blocks * 2)`` in scratch (eight nibbles to a word).
    """
    r, nb, _ = raw.shape
    qs = _words(_contiguous_bytes(raw, start, start + 16, "q_bytes", scratch)).reshape(r, nb * 2)
    q = scratch.get("q", (r, 2, nb * 2), np.uint64)
    _nibbles(qs, q[:, 0], q[:, 1])
    return q


def _as_row(q: np.ndarray, dtype: type) -> np.ndarray:
    """Decoded words (rows, ...) as one value per byte, (rows, cols)."""
    return q.view(dtype).reshape(q.shape[0], -1)


# Q4_0 (18 bytes):  | d f16 | qs[16] |                  weight = d * (nibble - 8)

def _decode_q4_0(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    q = _nibble_words(raw, 2, scratch)
    _subtract_each_byte(q, 8)
    return _as_row(q, np.int8)


@functools.lru_cache(maxsize=64)
def _order_q4_0(cols: int) -> np.ndarray:
    return _grid_order((2, cols // 32, 16), lambda h, b, l: b * 32 + h * 16 + l)


# Q4_1 (20 bytes):  | d f16 | m f16 | qs[16] |          weight = d * nibble + m

def _prepare_d_m(raw: np.ndarray, index: ScaleIndex) -> Scales:
    """mul = d and bias = m per sub-block, from the two f16 that open a Q4_1/Q5_1 block."""
    r, nb, _ = raw.shape
    d_m = f16_to_f32(raw[..., 0:4].view(np.uint16), np.empty((r, nb, 2), np.float32), thread_scratch())
    f = d_m[:, index.block, _PLANES]                                        # (R, 2, S): [d | m]
    return Scales(f[:, 0], f[:, 1])


def _decode_q4_1(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    return _as_row(_nibble_words(raw, 4, scratch), np.uint8)


# Q5_0 (22 bytes):  | d f16 | qh u32 | qs[16] |         weight j = d * (q5_j - 16)
# Q5_1 (24 bytes):  | d f16 | m f16 | qh u32 | qs[16] | weight j = d * q5_j + m
# where q5_j = nibble j | (bit j of qh) << 4 (qh little-endian: byte k holds weights 8k..8k+7).
# In layout (h, b, l) the word of l = 8g..8g+7 takes its fifth bits from qh byte 2h + g, bit i to byte i.

_BIT_I_OF_BYTE_I = np.uint64(0x8040201008040201)


def _or_fifth_bits(raw: np.ndarray, start: int, q: np.ndarray, scratch: Scratch) -> None:
    """OR 16 into every byte of ``q`` (from :func:`_nibble_words`) whose bit in the qh at ``start`` is set."""
    r, nb, _ = raw.shape
    high = scratch.get("q_high", (r, 2, nb, 2), np.uint64)                  # [h, b, g]
    np.copyto(high, raw[..., start:start + 4].reshape(r, nb, 2, 2).transpose(0, 2, 1, 3))
    np.multiply(high, _ONE_EACH, out=high)             # the qh byte in all eight bytes
    np.bitwise_and(high, _BIT_I_OF_BYTE_I, out=high)   # byte i keeps only its bit i ...
    np.add(high, _bytes_x8(0x7F), out=high)            # ... which sets its top bit (no carry: <= 0xFF)
    np.bitwise_and(high, _TOP_BITS, out=high)
    np.right_shift(high, np.uint64(3), out=high)       # 0x80 -> 0x10
    np.bitwise_or(q, high.reshape(q.shape), out=q)


def _decode_q5_0(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    q = _nibble_words(raw, 6, scratch)
    _or_fifth_bits(raw, 2, q, scratch)
    _subtract_each_byte(q, 16)
    return _as_row(q, np.int8)


def _decode_q5_1(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    q = _nibble_words(raw, 8, scratch)
    _or_fifth_bits(raw, 4, q, scratch)
    return _as_row(q, np.uint8)


# Non-linear 4-bit types: each nibble indexes a 16-entry table of small integers.
# IQ4_NL (18 bytes): | d f16 | qs[16] |                 weight = d * IQ4_VALUES[nibble]
# MXFP4  (17 bytes): | e u8 | qs[16] |                  weight = 2^(e - 128) * MXFP4_VALUES[nibble]
# MXFP4's values are twice the FP4 (E2M1) ones and its scale half the E8M0 2^(e - 127), as in ggml.

IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def _look_up(table: np.ndarray, q: np.ndarray, scratch: Scratch) -> np.ndarray:
    """Decoded nibble words -> the table's int8 value for each, (rows, cols) in scratch."""
    nibbles = _as_row(q, np.uint8)
    out = scratch.get("q_values", nibbles.shape, np.int8)
    np.take(table, nibbles, out=out, mode="clip")  # indices are 0..15; "clip" writes out= unbuffered
    return out


def _decode_iq4_nl(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    return _look_up(IQ4_VALUES, _nibble_words(raw, 2, scratch), scratch)


def _decode_mxfp4(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    return _look_up(MXFP4_VALUES, _nibble_words(raw, 1, scratch), scratch)


def e8m0_half_to_f32(e: np.ndarray) -> np.ndarray:
    """E8M0 exponents (uint8) -> 2^(e - 128) as float32, exactly (subnormal for e < 2)."""
    e32 = e.astype(np.uint32)
    bits = np.where(e32 < 2, np.uint32(0x00200000) << e32, (e32 - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def _prepare_mxfp4(raw: np.ndarray, index: ScaleIndex) -> Scales:
    """mul = the block's halved E8M0 scale per sub-block."""
    return Scales(e8m0_half_to_f32(raw[..., 0])[:, index.block], None)


def _grid_order(shape: tuple[int, ...], natural: Callable[..., np.ndarray]) -> np.ndarray:
    """Natural column of every layout position, the layout being the C-order walk of ``shape``."""
    return natural(*np.indices(shape)).reshape(-1)


# --- Q4_K / Q5_K: d, dmin (f16), 12 bytes of 6-bit scales and mins, [qh 32 bytes,] qs 128 bytes.
# Natural weight 64g + 32h + l of a block is nibble h of qs[32g + l]; it belongs to sub-block 2g + h. ---

_K4_LOW6 = np.uint32(0x3F3F3F3F)
_K4_NIB = np.uint32(0x0F0F0F0F)
_K4_TOP2 = np.uint32(0x30303030)


def unpack_k4_scales(raw: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K blocks (R, nb, type_size) -> their 6-bit scales and mins, (R, nb, 2, 8) uint8.

    ``[..., 0, j]`` is sc[j] and ``[..., 1, j]`` is m[j] of sub-block j. In the
    12 packed bytes, bytes 0-3 hold sc[0:4] in their low 6 bits, bytes 4-7
    hold m[0:4]; the top 2 bits of bytes 0-7 and the nibbles of bytes 8-11
    make sc[4:8] and m[4:8]. Done on 32-bit words read in place, four at a time.
    """
    r, nb, _ = raw.shape
    words = raw[..., 4:16].view(np.uint32)                                 # (R, nb, 3)
    a, b, c = words[..., 0], words[..., 1], words[..., 2]
    out = np.empty((r, nb, 2, 2), np.uint32)                               # [sc | m][first 4 | last 4]
    np.bitwise_and(a, _K4_LOW6, out=out[..., 0, 0])
    np.bitwise_or(c & _K4_NIB, (a >> np.uint32(2)) & _K4_TOP2, out=out[..., 0, 1])
    np.bitwise_and(b, _K4_LOW6, out=out[..., 1, 0])
    np.bitwise_or((c >> np.uint32(4)) & _K4_NIB, (b >> np.uint32(2)) & _K4_TOP2, out=out[..., 1, 1])
    return out.view(np.uint8).reshape(r, nb, 2, 8)


def _mul_bias(d_dmin: np.ndarray, sc_m: np.ndarray, index: ScaleIndex) -> Scales:
    """mul = d * sc and bias = -dmin * m per layout sub-block.

    ``d_dmin`` (R, nb, 2) float32 [d | dmin]; ``sc_m`` (R, nb, 2, n) the small integer
    scales [sc | m] of each block. The integers are gathered before any float work.
    """
    np.negative(d_dmin[..., 1], out=d_dmin[..., 1])
    f = d_dmin[:, index.block, _PLANES]                                    # (R, 2, S): [d | -dmin]
    np.multiply(f, sc_m[:, index.block, _PLANES, index.scale], out=f)
    return Scales(f[:, 0], f[:, 1])


def _prepare_k4(raw: np.ndarray, index: ScaleIndex) -> Scales:
    """mul = d * sc and bias = -dmin * m per layout sub-block."""
    r, nb, _ = raw.shape
    d_dmin = f16_to_f32(raw[..., 0:4].view(np.uint16), np.empty((r, nb, 2), np.float32), thread_scratch())
    return _mul_bias(d_dmin, unpack_k4_scales(raw), index)


# Q4_K layout (h, b, g, l): the low nibbles of every qs byte of the row, then the high ones.

def _decode_q4_k(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    r, nb, _ = raw.shape
    qs = _words(_contiguous_bytes(raw, 16, 144, "q_bytes", scratch)).reshape(r, nb * 16)
    q = scratch.get("q", (r, 2, nb * 16), np.uint64)
    _nibbles(qs, q[:, 0], q[:, 1])
    return q.view(np.uint8).reshape(r, nb * 256)


@functools.lru_cache(maxsize=64)
def _order_q4_k(cols: int) -> np.ndarray:
    return _grid_order((2, cols // 256, 4, 32), lambda h, b, g, l: b * 256 + g * 64 + h * 32 + l)


# Q5_K layout (j, b, l), j = 2g + h the sub-block: bit j of qh[l] is the fifth bit of weight (j, l).

_Q5_BITS = np.arange(8, dtype=np.uint64).reshape(8, 1)


def _decode_q5_k(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    r, nb, _ = raw.shape
    qs = scratch.get("q_bytes", (r, 4, nb, 32), np.uint8)                  # [g, b, l]
    np.copyto(qs, raw[..., 48:176].reshape(r, nb, 4, 32).transpose(0, 2, 1, 3))
    qh = _words(_contiguous_bytes(raw, 16, 48, "qh_bytes", scratch)).reshape(r, 1, nb * 4)
    q = scratch.get("q", (r, 4, 2, nb * 4), np.uint64)                     # [g, h, (b, l)]
    _nibbles(_words(qs).reshape(r, 4, nb * 4), q[:, :, 0], q[:, :, 1])
    high = scratch.get("q_high", (r, 8, nb * 4), np.uint64)
    np.right_shift(qh, _Q5_BITS, out=high)
    np.bitwise_and(high, _ONE_EACH, out=high)
    np.left_shift(high, np.uint64(4), out=high)
    q8 = _split(q, (r, 8, nb * 4))
    np.bitwise_or(q8, high, out=q8)
    return q.view(np.uint8).reshape(r, nb * 256)


@functools.lru_cache(maxsize=64)
def _order_q5_k(cols: int) -> np.ndarray:
    return _grid_order((8, cols // 256, 32), lambda j, b, l: b * 256 + j * 32 + l)


# --- Q6_K: ql[128] qh[64] scales[16] (int8) d (f16). In half h, weight 32k + l takes nibble k // 2 of
# ql[64h + 32(k % 2) + l] and bits 2k..2k+1 of qh[32h + l]; minus 32; one scale per 16 weights.
# Layout (k, b, h, l) with k = 2 * nibble + part. ---

def _d_times(d: np.ndarray, scales: np.ndarray, index: ScaleIndex) -> Scales:
    """mul = d * scale per layout sub-block; d (R, nb) float32, scales (R, nb, n) signed integers."""
    mul = d[:, index.block]
    np.multiply(mul, scales[:, index.block, index.scale], out=mul)
    return Scales(mul, None)


def _prepare_q6_k(raw: np.ndarray, index: ScaleIndex) -> Scales:
    """mul = d * sc per layout sub-block of 16."""
    return _d_times(_f16_field(raw, 208), raw[..., 192:208].view(np.int8), index)


def _decode_q6_k(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    r, nb, _ = raw.shape
    ql = scratch.get("q_bytes", (r, 2, nb, 2, 32), np.uint8)               # [part, b, h, l]
    np.copyto(ql, raw[..., 0:128].reshape(r, nb, 2, 2, 32).transpose(0, 3, 1, 2, 4))
    qh = _words(_contiguous_bytes(raw, 128, 192, "qh_bytes", scratch)).reshape(r, 1, nb * 8)
    q = scratch.get("q", (r, 2, 2, nb * 8), np.uint64)                     # [nibble, part, (b, h, l)]
    _nibbles(_words(ql).reshape(r, 2, nb * 8), q[:, 0], q[:, 1])
    high = scratch.get("q_high", (r, 4, nb * 8), np.uint64)
    np.right_shift(qh, _PAIR_SHIFTS, out=high)
    np.bitwise_and(high, _TWO_BITS, out=high)
    np.left_shift(high, np.uint64(4), out=high)
    q4 = _split(q, (r, 4, nb * 8))
    np.bitwise_or(q4, high, out=q4)
    _subtract_each_byte(q, 32)
    return q.view(np.int8).reshape(r, nb * 256)


@functools.lru_cache(maxsize=64)
def _order_q6_k(cols: int) -> np.ndarray:
    return _grid_order((4, cols // 256, 2, 32), lambda k, b, h, l: b * 256 + h * 128 + k * 32 + l)

def _split_bytes(packed: np.ndarray, low: np.ndarray, high: np.ndarray) -> None:
    """Bytes -> their low and high nibbles (small arrays of packed scales; any strides)."""
    np.bitwise_and(packed, 0x0F, out=low)
    np.right_shift(packed, 4, out=high)


def _six_bits_minus_32(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """6-bit scales from their low nibbles and (unmasked) top two bits, minus 32, as int8 in ``low``."""
    np.bitwise_and(high, 0x03, out=high)
    np.left_shift(high, 4, out=high)
    np.bitwise_or(low, high, out=low)
    np.subtract(low, 32, out=low)  # wraps: read as int8 it is the scale - 32
    return low.view(np.int8)


# --- Q2_K (84 bytes, 256 weights, 16 sub-blocks of 16):
#
#     | scales[16] | qs[64] | d f16 | dmin f16 |
#
# scales[j]: low nibble the scale, high nibble the min of sub-block j. Weight 128 h + 32 s + l
# (h < 2, s < 4, l < 32) is bits 2s..2s+1 of qs[32 h + l]; it belongs to sub-block 8 h + 2 s + l // 16.
# weight = d * sc * q - dmin * m. Layout (s, b, j): for each pair of bits s, all qs bytes j of the row. ---

def _crumbs(qs: np.ndarray, out: np.ndarray) -> None:
    """uint64 words of packed 2-bit values -> (4, words): pair s of every byte, one per byte."""
    np.right_shift(qs, _PAIR_SHIFTS, out=out)
    np.bitwise_and(out, _TWO_BITS, out=out)


def _prepare_q2_k(raw: np.ndarray, index: ScaleIndex) -> Scales:
    r, nb, _ = raw.shape
    d_dmin = f16_to_f32(raw[..., 80:84].view(np.uint16), np.empty((r, nb, 2), np.float32), thread_scratch())
    sc_m = np.empty((r, nb, 2, 16), np.uint8)
    _split_bytes(raw[..., 0:16], sc_m[:, :, 0], sc_m[:, :, 1])
    return _mul_bias(d_dmin, sc_m, index)


def _decode_q2_k(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    r, nb, _ = raw.shape
    qs = _words(_contiguous_bytes(raw, 16, 80, "q_bytes", scratch)).reshape(r, 1, nb * 8)
    q = scratch.get("q", (r, 4, nb * 8), np.uint64)
    _crumbs(qs, q)
    return _as_row(q, np.uint8)


@functools.lru_cache(maxsize=64)
def _order_q2_k(cols: int) -> np.ndarray:
    return _grid_order((4, cols // 256, 2, 32), lambda s, b, h, l: b * 256 + h * 128 + s * 32 + l)


# --- Q3_K (110 bytes, 256 weights, 16 sub-blocks of 16):
#
#     | hmask[32] | qs[64] | scales[12] | d f16 |
#
# Weight 128 h + 32 s + l: low two bits from qs[32 h + l] as in Q2_K, third bit = bit 4 h + s of
# hmask[l]; q = low + 4 * bit - 4 (the bit *clear* means minus 4). Sub-block j's 6-bit scale:
# low nibble = nibble j // 8 of scales[j % 8], top two bits = bits 2 (j // 4)..+1 of scales[8 + j % 4];
# weight = d * (scale - 32) * q. Layout (s, b, h, l), as Q2_K. ---

_Q3_HMASK_SHIFTS = (4 * np.arange(2, dtype=np.uint64).reshape(1, 2, 1) +
                    np.arange(4, dtype=np.uint64).reshape(4, 1, 1)).reshape(4, 1, 2, 1)   # [s, 1, h, 1]
_Q3_HIGH_SHIFTS = (np.arange(4, dtype=np.uint8) * 2).reshape(4, 1)


def unpack_q3_k_scales(raw: np.ndarray) -> np.ndarray:
    """Q3_K blocks (R, nb, 110) -> the 16 signed sub-block scales (6-bit value - 32), (R, nb, 16) int8."""
    r, nb, _ = raw.shape
    packed = raw[..., 96:108]
    low = np.empty((r, nb, 2, 8), np.uint8)                                # [nibble, byte]: j = 8 nibble + byte
    _split_bytes(packed[..., :8], low[:, :, 0], low[:, :, 1])
    high = np.empty((r, nb, 4, 4), np.uint8)                               # [pair, byte]: j = 4 pair + byte
    np.right_shift(packed[..., None, 8:12], _Q3_HIGH_SHIFTS, out=high)
    return _six_bits_minus_32(_split(low, (r, nb, 16)), _split(high, (r, nb, 16)))


def _prepare_q3_k(raw: np.ndarray, index: ScaleIndex) -> Scales:
    """mul = d * (scale - 32) per layout sub-block of 16."""
    return _d_times(_f16_field(raw, 108), unpack_q3_k_scales(raw), index)


def _decode_q3_k(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    r, nb, _ = raw.shape
    qs = _words(_contiguous_bytes(raw, 32, 96, "q_bytes", scratch)).reshape(r, 1, nb * 8)
    q = scratch.get("q", (r, 4, nb * 8), np.uint64)                        # [s, (b, h, l)]
    _crumbs(qs, q)
    hmask = _words(_contiguous_bytes(raw, 0, 32, "qh_bytes", scratch)).reshape(r, 1, nb, 1, 4)
    high = scratch.get("q_high", (r, 4, nb, 2, 4), np.uint64)              # [s, b, h, l // 8]
    np.right_shift(hmask, _Q3_HMASK_SHIFTS, out=high)
    np.bitwise_and(high, _ONE_EACH, out=high)
    np.left_shift(high, np.uint64(2), out=high)
    np.bitwise_or(q, _split(high, q.shape), out=q)
    _subtract_each_byte(q, 4)
    return _as_row(q, np.int8)


# --- IQ4_XS (136 bytes, 256 weights, 8 sub-blocks of 32):
#
#     | d f16 | scales_h u16 | scales_l[4] | qs[128] |
#
# Sub-block k's 6-bit scale: low nibble = nibble k % 2 of scales_l[k // 2], top two bits = bits
# 2k..2k+1 of scales_h. Weight 32 k + 16 h + l is nibble h of qs[16 k + l];
# weight = d * (scale - 32) * IQ4_VALUES[nibble]. Layout (h, b, k, l): every low nibble of the row,
# then every high one (a sub-block of 16 layout columns is one half of one k). ---

_IQ4_XS_HIGH_SHIFTS = np.arange(0, 16, 2, dtype=np.uint16)


def unpack_iq4_xs_scales(raw: np.ndarray) -> np.ndarray:
    """IQ4_XS blocks (R, nb, 136) -> the 8 signed sub-block scales (6-bit value - 32), (R, nb, 8) int8."""
    r, nb, _ = raw.shape
    low = np.empty((r, nb, 4, 2), np.uint8)                                # [byte, nibble]: k = 2 byte + nibble
    _split_bytes(raw[..., 4:8], low[..., 0], low[..., 1])
    high = np.empty((r, nb, 8), np.uint8)
    np.right_shift(raw[..., 2:4].view(np.uint16)[..., 0:1], _IQ4_XS_HIGH_SHIFTS, out=high, casting="unsafe")
    return _six_bits_minus_32(_split(low, (r, nb, 8)), high)


def _prepare_iq4_xs(raw: np.ndarray, index: ScaleIndex) -> Scales:
    """mul = d * (scale - 32) per layout sub-block of 16."""
    return _d_times(_f16_field(raw, 0), unpack_iq4_xs_scales(raw), index)


def _decode_iq4_xs(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    r, nb, _ = raw.shape
    qs = _words(_contiguous_bytes(raw, 8, 136, "q_bytes", scratch)).reshape(r, nb * 16)
    q = scratch.get("q", (r, 2, nb * 16), np.uint64)
    _nibbles(qs, q[:, 0], q[:, 1])
    return _look_up(IQ4_VALUES, q, scratch)


@functools.lru_cache(maxsize=64)
def _order_iq4_xs(cols: int) -> np.ndarray:
    return _grid_order((2, cols // 256, 8, 16), lambda h, b, k, l: b * 256 + k * 32 + h * 16 + l)


# --- Codebook i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M): 256-weight blocks whose
# quants are indices into a codebook of 8 (IQ2, IQ1) or 4 (IQ3) magnitudes, with signs per 8 weights.
# The codebooks (ggml's iq2xxs_grid ... iq1s_grid, ksigns_iq2xs) are read from gguf-py's public classes,
# which ship them packed (grid_hex: 2 or 3 bits per value, grid_map: what each code stands for).
# Every one of these types keeps natural order: a codebook entry is 8 (or 4) consecutive weights.
# q = codebook value * sign (int8), so q * mul is the single rounding ggml makes of db * grid * sign. ---

def _codebook(cls: type) -> np.ndarray:
    """gguf-py's packed codebook of ``cls`` -> (entries, width) int16 of the values it stands for."""
    bits = int(np.ceil(np.log2(len(cls.grid_map))))
    per_byte = 8 // bits
    packed = np.frombuffer(bytes.fromhex(cls.grid_hex.decode()), np.uint8)
    shifts = np.arange(0, 8, 8 // per_byte, dtype=np.uint8)
    codes = (packed[:, None] >> shifts) & ((1 << bits) - 1)          # value i of byte k: bits at 8i/per_byte
    return np.array(cls.grid_map, np.int16)[codes].reshape(cls.grid_shape)


def _packed(values: np.ndarray, dtype: type) -> np.ndarray:
    """(entries, width) small integers -> one ``dtype`` word per entry whose bytes are the values, int8."""
    return np.ascontiguousarray(values.astype(np.int8)).view(dtype).reshape(-1)


def _sign_words(masks: np.ndarray) -> np.ndarray:
    """Sign bytes -> uint64 words whose byte j is -1 where bit j of the mask is set, else +1."""
    bits = (masks[:, None].astype(np.uint16) >> np.arange(8, dtype=np.uint16)) & 1
    return _packed(1 - 2 * bits.astype(np.int16), np.uint64)


_IQ2XXS_GRID = _packed(_codebook(quants.IQ2_XXS), np.uint64)        # 256 x 8 magnitudes (8, 25, 43)
_IQ2XS_GRID = _packed(_codebook(quants.IQ2_XS), np.uint64)          # 512 x 8
_IQ2S_GRID = _packed(_codebook(quants.IQ2_S), np.uint64)            # 1024 x 8
_IQ3XXS_GRID = _packed(_codebook(quants.IQ3_XXS), np.uint32)        # 256 x 4 magnitudes (4 ... 62)
_IQ3S_GRID = _packed(_codebook(quants.IQ3_S), np.uint32)            # 512 x 4 magnitudes (1 ... 15)
# ksigns_iq2xs: a 7-bit index -> 8 sign bits (the eighth makes the parity even).
_KSIGNS = _sign_words(np.frombuffer(quants.IQ2_XXS.ksigns, np.uint8))
_SIGNS = _sign_words(np.arange(256, dtype=np.uint8))                # a plain sign byte (IQ2_S, IQ3_S)
# IQ1_S/IQ1_M: grid values g in {-1, 0, 1} plus a delta of +-IQ1S_DELTA (1/8) per 8 weights. ggml computes
# dl * (g + delta); the table holds 8 * (g + delta) = 8g +- 1 (never 0, so an infinite dl stays infinite
# as in ggml) and mul carries dl / 8, a power-of-two scaling: q * mul is that same single rounding.
# Entry i is delta +1/8, entry 2048 + i delta -1/8 (the sign bit of the delta is bit 11 of the index).
_IQ1S_DELTA_EIGHTHS = int(quants.IQ1_S.delta * 8)
_IQ1_GRID = _packed(np.concatenate([8 * _codebook(quants.IQ1_S) + _IQ1S_DELTA_EIGHTHS,
                                    8 * _codebook(quants.IQ1_S) - _IQ1S_DELTA_EIGHTHS]), np.uint64)
_SEVEN_BITS_AT = np.array([0, 7, 14, 21], np.uint32)                # the four sign indices of a u32
_THREE_BITS_AT = np.array([0, 3, 6, 9], np.uint16)                  # four 3-bit fields of a u16


def _signed_grid(grid: np.ndarray, index: np.ndarray, signs: np.ndarray, sign_index: np.ndarray,
                 scratch: Scratch) -> np.ndarray:
    """Codebook entries times their signs, (rows, cols) int8 in scratch, natural order.

    ``index`` (R, ...) picks one ``grid`` word per 8 (uint64) or 4 (uint32) weights and ``sign_index``
    (R, ...) one ``signs`` word per 8 weights, both in natural order.
    """
    r = index.shape[0]
    q = scratch.get("q", index.shape, grid.dtype)
    np.take(grid, index, out=q, mode="clip")                       # indices are in range; "clip" is unbuffered
    s = scratch.get("q_signs", sign_index.shape, np.uint64)
    np.take(signs, sign_index, out=s, mode="clip")
    qv, sv = q.view(np.int8).reshape(r, -1), s.view(np.int8).reshape(r, -1)
    np.multiply(qv, sv, out=qv)
    return qv


def _nibble_scales(packed: np.ndarray) -> np.ndarray:
    """Bytes of two 4-bit scales each, (R, nb, n) -> (R, nb, 2n) uint8: low nibble first."""
    r, nb, n = packed.shape
    out = np.empty((r, nb, n, 2), np.uint8)
    _split_bytes(packed, out[..., 0], out[..., 1])
    return _split(out, (r, nb, 2 * n))


def _iq2_mul(d: np.ndarray, ls: np.ndarray, index: ScaleIndex, last: float) -> Scales:
    """mul = d * (0.5 + ls) * last per layout sub-block, rounded in ggml's order (float32 throughout)."""
    f = ls[:, index.block, index.scale].astype(np.float32)
    np.add(f, np.float32(0.5), out=f)
    mul = d[:, index.block]
    np.multiply(mul, f, out=mul)
    np.multiply(mul, np.float32(last), out=mul)
    return Scales(mul, None)


def _odd_mul(d: np.ndarray, ls: np.ndarray, index: ScaleIndex, last: float) -> Scales:
    """mul = d * (2 ls + 1) [* last] per layout sub-block (IQ3_S; IQ1_S/IQ1_M with last = 1/8)."""
    f = ls[:, index.block, index.scale].astype(np.float32)
    np.multiply(f, np.float32(2), out=f)
    np.add(f, np.float32(1), out=f)
    mul = d[:, index.block]
    np.multiply(mul, f, out=mul)
    if last != 1:
        np.multiply(mul, np.float32(last), out=mul)
    return Scales(mul, None)


# IQ2_XXS (66 bytes; ggml's block_iq2_xxs), per 32 weights (ib) 8 bytes of qs:
#
#     | d f16 | ib 0: grid[4] u8 | aux u32 | ib 1: ... | ... ib 7 |
#
# grid[l] indexes iq2xxs_grid for weights 8l..8l+7 of the 32; aux bits 7l..7l+6 index ksigns for
# them; aux >> 28 is the 4-bit scale ls. weight = d * (0.5 + ls) * 0.25 * grid * sign.

def _iq2_xxs_groups(raw: np.ndarray) -> np.ndarray:
    r, nb, _ = raw.shape
    return _split(raw[..., 2:66], (r, nb, 8, 8))                    # [ib, byte]


def _prepare_iq2_xxs(raw: np.ndarray, index: ScaleIndex) -> Scales:
    """mul = d * (0.5 + ls) * 0.25 per sub-block of 32."""
    aux = _iq2_xxs_groups(raw)[..., 4:8].view(np.uint32)[..., 0]   # (R, nb, 8)
    return _iq2_mul(_f16_field(raw, 0), aux >> np.uint32(28), index, 0.25)


def _decode_iq2_xxs(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    g = _iq2_xxs_groups(raw)
    aux = g[..., 4:8].view(np.uint32)                               # (R, nb, 8, 1)
    sign_index = (aux >> _SEVEN_BITS_AT) & np.uint32(127)           # (R, nb, 8, 4)
    return _signed_grid(_IQ2XXS_GRID, g[..., 0:4], _KSIGNS, sign_index, scratch)


# IQ2_XS (74 bytes; block_iq2_xs):  | d f16 | qs u16[32] | scales[8] |
# qs[k] covers weights 8k..8k+7: its low 9 bits index iq2xs_grid, its top 7 ksigns. scales[ib]:
# low nibble for the first 16 weights of ib, high nibble for the next 16.
# weight = d * (0.5 + ls) * 0.25 * grid * sign.

def _prepare_iq2_xs(raw: np.ndarray, index: ScaleIndex) -> Scales:
    """mul = d * (0.5 + ls) * 0.25 per sub-block of 16."""
    return _iq2_mul(_f16_field(raw, 0), _nibble_scales(raw[..., 66:74]), index, 0.25)


def _decode_iq2_xs(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    qs = raw[..., 2:66].view(np.uint16)                             # (R, nb, 32)
    return _signed_grid(_IQ2XS_GRID, qs & np.uint16(511), _KSIGNS, qs >> np.uint16(9), scratch)


# IQ2_S (82 bytes; block_iq2_s):  | d f16 | qs[32] | signs[32] | qh[8] | scales[8] |
# Weights 8k..8k+7 (k = 4 ib + l): iq2s_grid index qs[k] | (bits 2l, 2l+1 of qh[ib]) << 8, sign byte
# signs[k] (bit j set: weight j negative); scales as IQ2_XS. weight = d * (0.5 + ls) * 0.25 * grid * sign.

_QH_PAIRS_AT = np.array([0, 2, 4, 6], np.uint16)


def _prepare_iq2_s(raw: np.ndarray, index: ScaleIndex) -> Scales:
    """mul = d * (0.5 + ls) * 0.25 per sub-block of 16."""
    return _iq2_mul(_f16_field(raw, 0), _nibble_scales(raw[..., 74:82]), index, 0.25)


def _decode_iq2_s(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    r, nb, _ = raw.shape
    high = (raw[..., 66:74, None].astype(np.uint16) >> _QH_PAIRS_AT) & np.uint16(3)   # (R, nb, 8, 4)
    grid_index = _split(raw[..., 2:34], (r, nb, 8, 4)) | (high << np.uint16(8))
    return _signed_grid(_IQ2S_GRID, grid_index, _SIGNS, raw[..., 34:66], scratch)


# IQ3_XXS (98 bytes; block_iq3_xxs):  | d f16 | qs[64] | aux u32[8] |
# qs[k] indexes iq3xxs_grid for weights 4k..4k+3; aux[ib] holds four 7-bit ksigns indices (one per
# 8 weights of ib) and, in its top 4 bits, ls. weight = d * (0.5 + ls) * 0.5 * grid * sign.

def _prepare_iq3_xxs(raw: np.ndarray, index: ScaleIndex) -> Scales:
    """mul = d * (0.5 + ls) * 0.5 per sub-block of 32."""
    aux = raw[..., 66:98].view(np.uint32)                           # (R, nb, 8)
    return _iq2_mul(_f16_field(raw, 0), aux >> np.uint32(28), index, 0.5)


def _decode_iq3_xxs(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    aux = raw[..., 66:98].view(np.uint32)[..., None]                # (R, nb, 8, 1)
    sign_index = (aux >> _SEVEN_BITS_AT) & np.uint32(127)
    return _signed_grid(_IQ3XXS_GRID, raw[..., 2:66], _KSIGNS, sign_index, scratch)


# IQ3_S (110 bytes; block_iq3_s):  | d f16 | qs[64] | qh[8] | signs[32] | scales[4] |
# qs[k] | (bit k % 8 of qh[k // 8]) << 8 indexes iq3s_grid for weights 4k..4k+3; signs[k] holds the signs
# of weights 8k..8k+7; scales: one nibble per 32 weights, low first. weight = d * (1 + 2 ls) * grid * sign.

_BITS_AT = np.arange(8, dtype=np.uint16)


def _prepare_iq3_s(raw: np.ndarray, index: ScaleIndex) -> Scales:
    """mul = d * (1 + 2 ls) per sub-block of 32."""
    return _odd_mul(_f16_field(raw, 0), _nibble_scales(raw[..., 106:110]), index, 1)


def _decode_iq3_s(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    r, nb, _ = raw.shape
    high = (raw[..., 66:74, None].astype(np.uint16) >> _BITS_AT) & np.uint16(1)       # (R, nb, 8, 8)
    grid_index = _split(raw[..., 2:66], (r, nb, 8, 8)) | (high << np.uint16(8))
    return _signed_grid(_IQ3S_GRID, grid_index, _SIGNS, raw[..., 74:106], scratch)


# IQ1_S (50 bytes; block_iq1_s):  | d f16 | qs[32] | qh u16[8] |
# Weights 8k..8k+7 (k = 4 ib + l): iq1s_grid index qs[k] | (bits 3l..3l+2 of qh[ib]) << 8; bits 12-14 of
# qh[ib] are ls, bit 15 the sign of the delta for all 32 weights of ib.
# weight = d * (2 ls + 1) * (grid + delta), here (8 grid +- 1) * (d * (2 ls + 1) / 8).

def _prepare_iq1_s(raw: np.ndarray, index: ScaleIndex) -> Scales:
    """mul = d * (2 ls + 1) / 8 per sub-block of 32."""
    qh = raw[..., 34:50].view(np.uint16)
    return _odd_mul(_f16_field(raw, 0), (qh >> np.uint16(12)) & np.uint16(7), index, 0.125)


def _decode_iq1_s(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    r, nb, _ = raw.shape
    qh = raw[..., 34:50].view(np.uint16)[..., None]                 # (R, nb, 8, 1)
    index = _split(raw[..., 2:34], (r, nb, 8, 4)) | (((qh >> _THREE_BITS_AT) & np.uint16(7)) << np.uint16(8))
    index |= (qh >> np.uint16(15)) << np.uint16(11)                 # delta -1/8: the second half of the table
    q = scratch.get("q", index.shape, np.uint64)
    np.take(_IQ1_GRID, index, out=q, mode="clip")
    return q.view(np.int8).reshape(r, nb * 256)


# IQ1_M (56 bytes; block_iq1_m):  | qs[32] | qh[16] | scales u16[4] |
# Weights 8k..8k+7: iq1s_grid index qs[k] | (bits 0-2 of nibble k % 2 of qh[k // 2]) << 8, bit 3 of that
# nibble the sign of their delta. Sub-block j of 16 weights: ls = bits 3(j % 4)..+2 of scales[j // 4];
# the top nibbles of scales[0..3] are the four nibbles (low first) of the f16 d.
# weight = d * (2 ls + 1) * (grid + delta), here (8 grid +- 1) * (d * (2 ls + 1) / 8).

_TOP_NIBBLE_TO = np.array([12, 8, 4, 0], np.uint16)


def _prepare_iq1_m(raw: np.ndarray, index: ScaleIndex) -> Scales:
    """mul = d * (2 ls + 1) / 8 per sub-block of 16."""
    r, nb, _ = raw.shape
    sc = raw[..., 48:56].view(np.uint16)                            # (R, nb, 4)
    d_bits = np.bitwise_or.reduce((sc & np.uint16(0xF000)) >> _TOP_NIBBLE_TO, axis=-1)
    d = f16_to_f32(d_bits, np.empty((r, nb), np.float32), thread_scratch())
    ls = (sc[..., None] >> _THREE_BITS_AT) & np.uint16(7)           # (R, nb, 4, 4): j = 4 word + field
    return _odd_mul(d, _split(ls, (r, nb, 16)), index, 0.125)


def _decode_iq1_m(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    r, nb, _ = raw.shape
    nib = np.empty((r, nb, 16, 2), np.uint16)                       # [qh byte, nibble]: k = 2 byte + nibble
    _split_bytes(raw[..., 32:48], nib[..., 0], nib[..., 1])
    # The nibble shifted up by 8: its 3 low bits extend the index, its bit 3 lands on bit 11 (the delta).
    index = raw[..., 0:32] | (_split(nib, (r, nb, 32)) << np.uint16(8))
    q = scratch.get("q", index.shape, np.uint64)
    np.take(_IQ1_GRID, index, out=q, mode="clip")
    return q.view(np.int8).reshape(r, nb * 256)


# --- Ternary types: q in {-1, 0, 1}, mul = d per block. ---
# TQ1_0 (54 bytes; block_tq1_0):  | qs[48] | qh[4] | d f16 |
# Each byte holds 5 (qs) or 4 (qh) base-3 digits as a fixed-point fraction: digit n of byte v is
# ((v * 3^n mod 256) * 3) >> 8, and the weight is d * (digit - 1). Natural order: weight 32n + m from
# qs[m] (m < 32), 160 + 16n + m from qs[32 + m], 240 + 4n + j from qh[j]. Layout per block: the digits
# of each byte together (byte 0's five, byte 1's five, ... qh 3's four), one table look-up per byte.

_TRITS = ((np.arange(256, dtype=np.int32)[:, None] * 3 ** np.arange(5) % 256 * 3 >> 8) - 1).astype(np.int8)
_TQ1_FIVE = np.ascontiguousarray(_TRITS).view("V5").reshape(256)
_TQ1_FOUR = np.ascontiguousarray(_TRITS[:, :4]).view("V4").reshape(256)
_TQ1_NATURAL = np.concatenate([
    (32 * np.arange(5)[None, :] + np.arange(32)[:, None]).reshape(-1),          # qs[0:32], 5 digits each
    (160 + 16 * np.arange(5)[None, :] + np.arange(16)[:, None]).reshape(-1),    # qs[32:48]
    (240 + 4 * np.arange(4)[None, :] + np.arange(4)[:, None]).reshape(-1),      # qh[0:4], 4 digits each
])


def _prepare_tq1_0(raw: np.ndarray, index: ScaleIndex) -> Scales:
    """mul = d per block."""
    return Scales(_f16_field(raw, 52)[:, index.block], None)


def _decode_tq1_0(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    r, nb, _ = raw.shape
    q = scratch.get("q", (r, nb, 256), np.int8)
    np.take(_TQ1_FIVE, raw[..., 0:48], out=q[..., :240].view("V5"), mode="clip")
    np.take(_TQ1_FOUR, raw[..., 48:52], out=q[..., 240:].view("V4"), mode="clip")
    return q.reshape(r, nb * 256)


@functools.lru_cache(maxsize=64)
def _order_tq1_0(cols: int) -> np.ndarray:
    return _grid_order((cols // 256, 256), lambda b, p: b * 256 + _TQ1_NATURAL[p])


# TQ2_0 (66 bytes; block_tq2_0):  | qs[64] | d f16 |
# Weight 128 h + 32 s + l is bits 2s..2s+1 of qs[32 h + l], minus 1 (as Q2_K's quants, without scales).
# Layout (s, b, h, l), as Q2_K: a sub-block of 64 layout columns is one s of one block.

def _prepare_tq2_0(raw: np.ndarray, index: ScaleIndex) -> Scales:
    """mul = d per sub-block of 64."""
    return Scales(_f16_field(raw, 64)[:, index.block], None)


def _decode_tq2_0(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    r, nb, _ = raw.shape
    qs = _words(_contiguous_bytes(raw, 0, 64, "q_bytes", scratch)).reshape(r, 1, nb * 8)
    q = scratch.get("q", (r, 4, nb * 8), np.uint64)
    _crumbs(qs, q)
    _subtract_each_byte(q, 1)
    return _as_row(q, np.int8)


# NVFP4 (36 bytes, 64 weights; block_nvfp4):  | d[4] UE4M3 | qs[32] |
# Sub-block s of 16 weights: scale d[s] (unsigned E4M3, halved as ggml_ue4m3_to_fp32 does, 0x7F read as
# 0), weight 16 s + j = nibble 0 of qs[8 s + j], weight 16 s + 8 + j = its nibble 1, as MXFP4 values.
# Natural order: each 8 bytes of qs is one uint64 word, its low nibbles then its high ones.

def _ue4m3_half() -> np.ndarray:
    """All 256 UE4M3 bytes -> their value / 2 as float32 (exact: at most 4 significant bits)."""
    x = np.arange(256)
    exp, man = (x >> 3) & 0xF, x & 0x7
    value = np.where(exp == 0, man * 2.0 ** -9, (1 + man / 8) * 2.0 ** (exp - 7)) * 0.5
    return np.where((x == 0) | (x == 0x7F), 0.0, value).astype(np.float32)


_UE4M3_HALF = _ue4m3_half()


def _prepare_nvfp4(raw: np.ndarray, index: ScaleIndex) -> Scales:
    """mul = the sub-block's halved UE4M3 scale, per sub-block of 16."""
    return Scales(np.take(_UE4M3_HALF, raw[:, index.block, index.scale]), None)


def _decode_nvfp4(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    r, nb, _ = raw.shape
    qs = _words(_contiguous_bytes(raw, 4, 36, "q_bytes", scratch)).reshape(r, nb * 4)
    q = scratch.get("q", (r, nb * 4, 2), np.uint64)                 # [word, low | high]
    _nibbles(qs, q[..., 0], q[..., 1])
    return _look_up(MXFP4_VALUES, q, scratch)


def _format(t: T, sub: int, prepare: Callable, decode: Callable, order: Callable = _natural,
            has_bias: bool = False) -> Format:
    block, type_size = GGML_QUANT_SIZES[t]
    return Format(t, block, type_size, sub, prepare, decode, order, has_bias)


FORMATS: dict[T, Format] = {f.ggml_type: f for f in (
    _format(T.F32, 0, _no_scales, _decode_f32),
    _format(T.F16, 0, _no_scales, _decode_f16),
    _format(T.BF16, 0, _no_scales, _decode_bf16),
    _format(T.Q8_0, 32, _prepare_q8_0, _decode_q8_0),
    _format(T.Q4_0, 16, _prepare_q8_0, _decode_q4_0, _order_q4_0),   # d opens the block, as in Q8_0
    _format(T.Q4_K, 32, _prepare_k4, _decode_q4_k, _order_q4_k, has_bias=True),
    _format(T.Q5_K, 32, _prepare_k4, _decode_q5_k, _order_q5_k, has_bias=True),
    _format(T.Q6_K, 16, _prepare_q6_k, _decode_q6_k, _order_q6_k),
    _format(T.Q4_1, 16, _prepare_d_m, _decode_q4_1, _order_q4_0, has_bias=True),
    _format(T.Q5_0, 16, _prepare_q8_0, _decode_q5_0, _order_q4_0),
    _format(T.Q5_1, 16, _prepare_d_m, _decode_q5_1, _order_q4_0, has_bias=True),
    _format(T.IQ4_NL, 16, _prepare_q8_0, _decode_iq4_nl, _order_q4_0),
    _format(T.MXFP4, 16, _prepare_mxfp4, _decode_mxfp4, _order_q4_0),
    _format(T.Q2_K, 16, _prepare_q2_k, _decode_q2_k, _order_q2_k, has_bias=True),
    _format(T.Q3_K, 16, _prepare_q3_k, _decode_q3_k, _order_q2_k),
    _format(T.IQ4_XS, 16, _prepare_iq4_xs, _decode_iq4_xs, _order_iq4_xs),
    _format(T.IQ2_XXS, 32, _prepare_iq2_xxs, _decode_iq2_xxs),
    _format(T.IQ2_XS, 16, _prepare_iq2_xs, _decode_iq2_xs),
    _format(T.IQ2_S, 16, _prepare_iq2_s, _decode_iq2_s),
    _format(T.IQ3_XXS, 32, _prepare_iq3_xxs, _decode_iq3_xxs),
    _format(T.IQ3_S, 32, _prepare_iq3_s, _decode_iq3_s),
    _format(T.IQ1_S, 32, _prepare_iq1_s, _decode_iq1_s),
    _format(T.IQ1_M, 16, _prepare_iq1_m, _decode_iq1_m),
    _format(T.TQ1_0, 256, _prepare_tq1_0, _decode_tq1_0, _order_tq1_0),
    _format(T.TQ2_0, 64, _prepare_tq2_0, _decode_tq2_0, _order_q2_k),
    _format(T.NVFP4, 16, _prepare_nvfp4, _decode_nvfp4),
)}


@functools.lru_cache(maxsize=256)
def scale_index(t: T, cols: int) -> ScaleIndex:
    """Per layout sub-block of a ``cols``-long row of type ``t``: its block and natural scale number.

    Q8_0 in natural order gets an empty ``scale``: its sub-blocks are its blocks.
    """
    fmt = FORMATS[t]
    if fmt.sub == 0:
        return ScaleIndex(np.empty(0, np.intp), np.empty(0, np.intp))
    order = fmt.column_order(cols)
    first = np.arange(0, cols, fmt.sub) if order is None else order[::fmt.sub]
    if order is None and fmt.sub == fmt.block:
        return ScaleIndex(first // fmt.block, np.empty(0, np.intp))
    return ScaleIndex(first // fmt.block, first % fmt.block // SCALE_GROUP[t])


# Weights sharing one stored scale, per type (Q4_0's d covers its whole block of 32).
SCALE_GROUP = {T.Q8_0: 32, T.Q4_0: 32, T.Q4_K: 32, T.Q5_K: 32, T.Q6_K: 16, T.Q4_1: 32, T.Q5_0: 32, T.Q5_1: 32,
               T.IQ4_NL: 32, T.MXFP4: 32, T.Q2_K: 16, T.Q3_K: 16, T.IQ4_XS: 32,
               T.IQ2_XXS: 32, T.IQ2_XS: 16, T.IQ2_S: 16, T.IQ3_XXS: 32, T.IQ3_S: 32, T.IQ1_S: 32, T.IQ1_M: 16,
               T.TQ1_0: 256, T.TQ2_0: 256, T.NVFP4: 16}
