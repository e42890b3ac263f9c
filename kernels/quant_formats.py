"""How each GGML type's blocks become numbers, vectorised over a chunk of rows.

A quantised row is decoded in two parts, both in *layout order* (a fixed
permutation of the row's columns chosen per type so that NumPy works on long
contiguous runs instead of 16- or 32-element pieces):

* ``decode(raw, scratch)`` -> the integer quant values, ``(rows, cols)`` int8
  or uint8 (or float32 for the float types, which have no scales);
* ``prepare(raw, index)`` -> :class:`Scales`, one value per sub-block of
  ``sub`` consecutive layout columns, ``(rows, sub_blocks)`` float32: the
  factor ``mul`` and, for Q4_K/Q5_K, the additive ``bias`` (``-dmin * m``),
  so that ``weight = q * mul + bias``. ``index`` (from :func:`scale_index`)
  names, per layout sub-block, the block and the natural scale it uses; the
  small integer scales are gathered into layout order before any float work,
  so every pass runs over whole rows.

``raw`` is always the ``(rows, blocks_per_row, type_size)`` uint8 view of the
GGUF bytes; nibbles and high bits are unpacked eight at a time on uint64 words.
``column_order(cols)`` gives, for each layout position, the natural column it
holds (``None`` when layout order is natural order).

Byte layouts follow ggml's ``block_q8_0``, ``block_q4_0``, ``block_q4_K``,
``block_q5_K`` and ``block_q6_K``.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

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


def _bytes_x8(c: int) -> np.uint64:
    return np.uint64(int.from_bytes(bytes([c]) * 8, "little"))


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
    """mul = d per sub-block (Q8_0 and Q4_0 share the leading f16 d)."""
    d = _f16_field(raw, 0)                                                  # (R, nb)
    return Scales(d if index.scale.size == 0 else d[:, index.block], None)  # empty scale: natural order


def _decode_q8_0(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    return raw[..., 2:].view(np.int8)                                      # (R, nb, 32), strided


# --- Q4_0: d (f16) + 16 bytes; weight l is the low nibble of byte l, weight 16 + l the high one;
# minus 8. Layout (h, b, l): all low-nibble halves of the row, then all high ones. ---

def _decode_q4_0(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    r, nb, _ = raw.shape
    qs = _words(_contiguous_bytes(raw, 2, 18, "q_bytes", scratch)).reshape(r, nb * 2)
    q = scratch.get("q", (r, 2, nb * 2), np.uint64)
    _nibbles(qs, q[:, 0], q[:, 1])
    _subtract_each_byte(q, 8)
    return q.view(np.int8).reshape(r, nb * 32)


@functools.lru_cache(maxsize=64)
def _order_q4_0(cols: int) -> np.ndarray:
    return _grid_order((2, cols // 32, 16), lambda h, b, l: b * 32 + h * 16 + l)


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


_PLANES = np.arange(2).reshape(2, 1)


def _prepare_k4(raw: np.ndarray, index: ScaleIndex) -> Scales:
    """mul = d * sc and bias = -dmin * m per layout sub-block."""
    r, nb, _ = raw.shape
    d_dmin = f16_to_f32(raw[..., 0:4].view(np.uint16), np.empty((r, nb, 2), np.float32), thread_scratch())
    np.negative(d_dmin[..., 1], out=d_dmin[..., 1])
    f = d_dmin[:, index.block, _PLANES]                                    # (R, 2, S): [d | -dmin]
    np.multiply(f, unpack_k4_scales(raw)[:, index.block, _PLANES, index.scale], out=f)
    return Scales(f[:, 0], f[:, 1])


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
_ONE_EACH = _bytes_x8(1)


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

_Q6_SHIFTS = (np.arange(4, dtype=np.uint64) * 2).reshape(4, 1)
_TWO_BITS = _bytes_x8(3)


def _prepare_q6_k(raw: np.ndarray, index: ScaleIndex) -> Scales:
    """mul = d * sc per layout sub-block of 16."""
    mul = _f16_field(raw, 208)[:, index.block]
    np.multiply(mul, raw[..., 192:208].view(np.int8)[:, index.block, index.scale], out=mul)
    return Scales(mul, None)


def _decode_q6_k(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    r, nb, _ = raw.shape
    ql = scratch.get("q_bytes", (r, 2, nb, 2, 32), np.uint8)               # [part, b, h, l]
    np.copyto(ql, raw[..., 0:128].reshape(r, nb, 2, 2, 32).transpose(0, 3, 1, 2, 4))
    qh = _words(_contiguous_bytes(raw, 128, 192, "qh_bytes", scratch)).reshape(r, 1, nb * 8)
    q = scratch.get("q", (r, 2, 2, nb * 8), np.uint64)                     # [nibble, part, (b, h, l)]
    _nibbles(_words(ql).reshape(r, 2, nb * 8), q[:, 0], q[:, 1])
    high = scratch.get("q_high", (r, 4, nb * 8), np.uint64)
    np.right_shift(qh, _Q6_SHIFTS, out=high)
    np.bitwise_and(high, _TWO_BITS, out=high)
    np.left_shift(high, np.uint64(4), out=high)
    q4 = _split(q, (r, 4, nb * 8))
    np.bitwise_or(q4, high, out=q4)
    _subtract_each_byte(q, 32)
    return q.view(np.int8).reshape(r, nb * 256)


@functools.lru_cache(maxsize=64)
def _order_q6_k(cols: int) -> np.ndarray:
    return _grid_order((4, cols // 256, 2, 32), lambda k, b, h, l: b * 256 + h * 128 + k * 32 + l)


def _format(t: T, sub: int, prepare: Callable, decode: Callable, order: Callable = _natural,
            has_bias: bool = False) -> Format:
    block, type_size = GGML_QUANT_SIZES[t]
    return Format(t, block, type_size, sub, prepare, decode, order, has_bias)


FORMATS: dict[T, Format] = {f.ggml_type: f for f in (
    _format(T.F32, 0, _no_scales, _decode_f32),
    _format(T.F16, 0, _no_scales, _decode_f16),
    _format(T.BF16, 0, _no_scales, _decode_bf16),
    _format(T.Q8_0, 32, _prepare_q8_0, _decode_q8_0),
    _format(T.Q4_0, 16, _prepare_q8_0, _decode_q4_0, _order_q4_0),   # d is read exactly as in Q8_0
    _format(T.Q4_K, 32, _prepare_k4, _decode_q4_k, _order_q4_k, has_bias=True),
    _format(T.Q5_K, 32, _prepare_k4, _decode_q5_k, _order_q5_k, has_bias=True),
    _format(T.Q6_K, 16, _prepare_q6_k, _decode_q6_k, _order_q6_k),
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
SCALE_GROUP = {T.Q8_0: 32, T.Q4_0: 32, T.Q4_K: 32, T.Q5_K: 32, T.Q6_K: 16}
