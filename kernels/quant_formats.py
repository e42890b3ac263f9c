"""How each GGML type's blocks become float32 weights, vectorised over a run of rows.

Every format is split into two steps so the row-chunk driver in
:mod:`colibri_aio.kernels.quant` can keep the hot loop short:

* ``prepare(raw)`` unpacks the per-block scales of a whole run of rows at
  once (the small arrays: f16 ``d``/``dmin``, 6-bit K-quant scales);
* ``decode(raw, scales, out, scratch)`` turns the quant bits of one chunk of
  rows into ``out`` (float32, ``(rows, cols)``), multiplying by the scales.

``raw`` is always the ``(rows, blocks_per_row, type_size)`` uint8 view of the
GGUF bytes. The block-minimum term of Q4_K/Q5_K (``- dmin * m``) is not
applied in ``decode``: it is returned per sub-block as ``Scales.neg_offset``
so a product can add it as ``neg_offset @ (sum of x over each sub-block)``,
which spares one float32 pass over the weights. ``decode_full`` gives true
weights (for :func:`dequantize`).

Byte layouts follow ggml's ``block_q8_0``, ``block_q4_0``, ``block_q4_K``,
``block_q5_K`` and ``block_q6_K``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from colibri_aio.kernels.scratch import Scratch


class Scales(NamedTuple):
    """Per-row-run scale arrays; every array has the row axis first so it slices by rows."""

    mul: np.ndarray | None           # factor broadcast against the quant values
    neg_offset: np.ndarray | None    # (rows, sub_blocks_per_row) float32: -dmin*m, or None


@dataclass(frozen=True, slots=True)
class Format:
    """One GGML type: its block geometry and its two decoding steps."""

    ggml_type: T
    block: int          # weights per block
    type_size: int      # bytes per block
    sub: int            # weights per neg_offset entry; 0 when the type has no offset term
    prepare: Callable[[np.ndarray], Scales]
    decode: Callable[[np.ndarray, Scales, np.ndarray, Scratch], None]


def _split(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A view of ``a`` with its column axis split; never a silent copy (``out=`` must land)."""
    return a.reshape(shape, copy=False)


def _f16(raw: np.ndarray, start: int) -> np.ndarray:
    """The f16 at byte ``start`` of every block as float32, shape (rows, blocks, 1)."""
    return raw[..., start:start + 2].view(np.float16).astype(np.float32)


# --- float types: a straight conversion; copying still matters (see quant.py) ---

def _no_scales(raw: np.ndarray) -> Scales:
    return Scales(None, None)


def _decode_f32(raw: np.ndarray, s: Scales, out: np.ndarray, scratch: Scratch) -> None:
    np.copyto(out, _split(raw, (raw.shape[0], -1)).view(np.float32))


def _decode_f16(raw: np.ndarray, s: Scales, out: np.ndarray, scratch: Scratch) -> None:
    np.copyto(out, _split(raw, (raw.shape[0], -1)).view(np.float16))


def _decode_bf16(raw: np.ndarray, s: Scales, out: np.ndarray, scratch: Scratch) -> None:
    # bf16 is the top half of an f32: widen the uint16 and shift it up.
    bits = out.view(np.uint32)
    np.copyto(bits, _split(raw, (raw.shape[0], -1)).view(np.uint16))
    np.left_shift(bits, 16, out=bits)


# --- Q8_0: d (f16) + 32 x int8 ---

def _prepare_q8_0(raw: np.ndarray) -> Scales:
    return Scales(_f16(raw, 0), None)                                    # (R, nb, 1)


def _decode_q8_0(raw: np.ndarray, s: Scales, out: np.ndarray, scratch: Scratch) -> None:
    r, nb, _ = raw.shape
    np.multiply(raw[..., 2:].view(np.int8), s.mul, out=_split(out, (r, nb, 32)))


# --- Q4_0: d (f16) + 16 bytes; low nibbles are weights 0..15, high nibbles 16..31, minus 8 ---

def _prepare_q4_0(raw: np.ndarray) -> Scales:
    return Scales(_f16(raw, 0)[..., None], None)                          # (R, nb, 1, 1)


def _decode_q4_0(raw: np.ndarray, s: Scales, out: np.ndarray, scratch: Scratch) -> None:
    r, nb, _ = raw.shape
    qs = raw[..., 2:]
    q = scratch.get("q4_0", (r, nb, 2, 16), np.uint8)
    np.bitwise_and(qs, 0x0F, out=q[:, :, 0])
    np.right_shift(qs, 4, out=q[:, :, 1])
    np.subtract(q, 8, out=q)  # wraps modulo 256: read as int8 it is exactly nibble - 8
    np.multiply(q.view(np.int8), s.mul, out=_split(out, (r, nb, 2, 16)))


# --- K-quants: 256-weight super-blocks; Q4_K/Q5_K share the 12-byte 6-bit scale packing ---

def _unpack_k4_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(R, nb, 12) packed bytes -> (sc, m), each (R, nb, 8) uint8 in 0..63.

    Bytes 0-3 hold sc[0:4] in their low 6 bits, bytes 4-7 hold m[0:4]; the top
    2 bits of bytes 0-7 and the nibbles of bytes 8-11 make sc[4:8] and m[4:8].
    """
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    m = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    return sc, m


def _prepare_k4(raw: np.ndarray) -> Scales:
    """Scales of Q4_K/Q5_K: d*sc per 32-weight sub-block, and -dmin*m per sub-block."""
    r, nb, _ = raw.shape
    sc, m = _unpack_k4_scales(raw[..., 4:16])
    mul = (_f16(raw, 0) * sc).reshape(r, nb, 4, 2, 1)
    neg_offset = (_f16(raw, 2) * m).reshape(r, nb * 8)
    np.negative(neg_offset, out=neg_offset)
    return Scales(mul, neg_offset)


def _low_high_nibbles(qs: np.ndarray, q: np.ndarray) -> None:
    """qs (R, nb, 4, 32) -> q (R, nb, 4, 2, 32): sub-block 2g is the low nibbles of group g, 2g+1 the high."""
    np.bitwise_and(qs, 0x0F, out=q[:, :, :, 0])
    np.right_shift(qs, 4, out=q[:, :, :, 1])


def _decode_q4_k(raw: np.ndarray, s: Scales, out: np.ndarray, scratch: Scratch) -> None:
    r, nb, _ = raw.shape
    q = scratch.get("qk", (r, nb, 4, 2, 32), np.uint8)
    _low_high_nibbles(_split(raw[..., 16:144], (r, nb, 4, 32)), q)
    np.multiply(q, s.mul, out=_split(out, (r, nb, 4, 2, 32)))


_BIT_OF_SUB_BLOCK = np.arange(8, dtype=np.uint8).reshape(8, 1)


def _decode_q5_k(raw: np.ndarray, s: Scales, out: np.ndarray, scratch: Scratch) -> None:
    r, nb, _ = raw.shape
    q = scratch.get("qk", (r, nb, 4, 2, 32), np.uint8)
    _low_high_nibbles(_split(raw[..., 48:176], (r, nb, 4, 32)), q)
    # Bit j of qh[l] is the fifth bit of weight l of sub-block j.
    high = scratch.get("q5_high", (r, nb, 8, 32), np.uint8)
    np.right_shift(raw[..., None, 16:48], _BIT_OF_SUB_BLOCK, out=high)
    np.bitwise_and(high, 1, out=high)
    np.left_shift(high, 4, out=high)
    q8 = _split(q, (r, nb, 8, 32))
    np.bitwise_or(q8, high, out=q8)
    np.multiply(q, s.mul, out=_split(out, (r, nb, 4, 2, 32)))


# Q6_K: ql[128] qh[64] scales[16] (int8) d (f16). Two halves of 128 weights; in
# half h, weight 32k + l (k = 0..3) takes the low (k < 2) or high (k >= 2)
# nibble of ql[64h + 32(k % 2) + l] and bits 2k..2k+1 of qh[32h + l], minus 32.
_QH_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)


def _prepare_q6_k(raw: np.ndarray) -> Scales:
    r, nb, _ = raw.shape
    sc = raw[..., 192:208].view(np.int8)
    mul = (_f16(raw, 208) * sc).reshape(r, nb, 2, 4, 2, 1)    # one scale per 16 weights
    return Scales(mul, None)


def _decode_q6_k(raw: np.ndarray, s: Scales, out: np.ndarray, scratch: Scratch) -> None:
    r, nb, _ = raw.shape
    q = scratch.get("q6", (r, nb, 2, 2, 2, 32), np.uint8)  # [half, nibble, ql part, l]
    ql = _split(raw[..., 0:128], (r, nb, 2, 2, 32))
    np.bitwise_and(ql, 0x0F, out=q[:, :, :, 0])
    np.right_shift(ql, 4, out=q[:, :, :, 1])
    high = scratch.get("q6_high", (r, nb, 2, 4, 32), np.uint8)
    qh = _split(raw[..., 128:192], (r, nb, 2, 1, 32))
    np.right_shift(qh, _QH_SHIFTS, out=high)
    np.bitwise_and(high, 3, out=high)
    np.left_shift(high, 4, out=high)
    np.subtract(high, 32, out=high)  # wraps: (nibble + high) read as int8 is q - 32
    q4 = _split(q, (r, nb, 2, 4, 32))
    np.add(q4, high, out=q4)
    np.multiply(q.view(np.int8).reshape(r, nb, 2, 4, 2, 16), s.mul,
                out=_split(out, (r, nb, 2, 4, 2, 16)))


def _format(t: T, sub: int, prepare: Callable, decode: Callable) -> Format:
    block, type_size = GGML_QUANT_SIZES[t]
    return Format(t, block, type_size, sub, prepare, decode)


FORMATS: dict[T, Format] = {f.ggml_type: f for f in (
    _format(T.F32, 0, _no_scales, _decode_f32),
    _format(T.F16, 0, _no_scales, _decode_f16),
    _format(T.BF16, 0, _no_scales, _decode_bf16),
    _format(T.Q8_0, 0, _prepare_q8_0, _decode_q8_0),
    _format(T.Q4_0, 0, _prepare_q4_0, _decode_q4_0),
    _format(T.Q4_K, 32, _prepare_k4, _decode_q4_k),
    _format(T.Q5_K, 32, _prepare_k4, _decode_q5_k),
    _format(T.Q6_K, 0, _prepare_q6_k, _decode_q6_k),
)}


def decode_full(fmt: Format, raw: np.ndarray, s: Scales, out: np.ndarray, scratch: Scratch) -> None:
    """True float32 weights of ``raw`` into ``out`` (the offset term applied)."""
    fmt.decode(raw, s, out, scratch)
    if s.neg_offset is not None:
        grouped = _split(out, (out.shape[0], -1, fmt.sub))
        np.add(grouped, s.neg_offset[..., None], out=grouped)
