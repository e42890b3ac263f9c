"""Compiled (numba) products with GGUF-quantised weights, straight from the raw block bytes.

Shapes follow :mod:`.quant` (NumPy order; ``cols`` is ggml's ``ne[0]``)::

    dequantize(w)     w: (rows, cols)   -> (rows, cols) float32
    matvec(w, x)      x: (cols,)        -> (rows,)      float32
    matmul(w, x)      x: (T, cols)      -> (T, rows)    float32

Every kernel walks the blocks of a row in file order, decodes each block's
scales and quants in registers and accumulates in float32; no dequantised
matrix is ever materialised.

matmul has two paths (:func:`set_matmul`, or ``COLIBRI_MATMUL`` at import):

* ``"fused"``: the matvec kernel once per position over a chunk of rows that
  stays in L2, so the bytes come from memory once but are decoded T times;
* ``"blas"`` (default): for :data:`BLAS_MIN_POSITIONS` or more positions, a
  chunk of rows (:func:`_blas_step`) is decoded once into a per-thread float32
  scratch buffer that stays in L2, then multiplied by every position in one
  single-threaded sgemm. Fewer positions, decode included,
  take the fused path. Prefill of 128 positions on the 8-layer Qwen3-30B-A3B
  Q8_0 cut: 77.4 vs 50.3 tok/s, 0.59 vs 0.38 of llama.cpp
  (evidence/decode_20261129T210129Z.md).

Summation order of the fused kernels, the same in every one, so their results
are bit-identical across placements, thread counts, repetitions and between
matvec and the matching row of a fused matmul::

    lane l (0..31) of a row:  acc[l] = (((w[l] x[l] + w[32+l] x[32+l]) + w[64+l] x[64+l]) + ...)
                              with w the weight without its additive term
    additive term (Q4_K/Q5_K): bias = sum over sub-blocks s, in order, of (-dmin m_s) * xsum_s
                              with xsum_s = x summed over sub-block s, left to right
    y = ((acc[0] + acc[1]) + ... + acc[31]) + bias

The 32 lanes are independent element-wise updates, so LLVM vectorises them
without reassociating anything (``fastmath=False``); alignment of the bytes
changes which load instructions run, never the arithmetic.

The BLAS path sums in sgemm's order instead: as accurate (the decoded weights
are gguf's own float32 values), the same bits for the same inputs, but a row
may differ from matvec's in the last bits, and may depend on how many positions
share the call. Its chunk grid depends on the row length only and BLAS sees
only page-aligned scratch, so placement and thread count change no bit.

Threads: a call cuts the rows into a fixed grid of chunks (its size depends
only on the shape) and ``threads`` Python threads take chunks from a shared
counter; the kernels release the GIL. A row is always computed whole, by one
call, so neither the grid nor the thread that ran a chunk changes a bit.
``set_parallel("prange")`` runs the fused kernels' chunks through numba's own
thread pool instead: it measured slower and far noisier on a shared 2-core machine
(a descheduled thread stalls its static share), and numba's ``workqueue``
layer aborts the process when two Python threads launch kernels at once.

A second, approximate kernel (:func:`matvec_q8`) quantises ``x`` to int8 per
block of 32 as llama.cpp does and sums integer products; it is a measured
candidate only (slower here and ~5e-3 relative error), never used by default.
"""
from __future__ import annotations

import itertools
import os
import time
import warnings

import numba
import numba.core.config
import numpy as np
from gguf import GGMLQuantizationType as T
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from colibri_aio.kernels.qtensor import QTensor
from colibri_aio.kernels.scratch import thread_scratch
from colibri_aio.kernels.threads import get_num_threads, set_num_threads, workers

__all__ = ["SUPPORTED_TYPES", "MATMUL_PATHS", "dequantize", "matvec", "matmul", "matvec_q8", "warm_up",
           "set_num_threads", "get_num_threads", "set_parallel", "set_matmul", "get_matmul"]

LANES = 32
# Weights per chunk of rows: small enough that a descheduled thread leaves
# little for the other to wait on, big enough that a chunk costs far more
# than a hand-off (~10 us).
CHUNK_WEIGHTS = 1 << 18

_F16_TO_F32 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

_KW = dict(cache=True, nogil=True, fastmath=False, error_model="numpy", boundscheck=False)

# numba leaves LLVM's SLP vectoriser off by default; the lane accumulators below are 32
# independent scalars once they live on the stack, and only SLP packs them into vector
# registers. Packing never reorders arithmetic (no fastmath), so results are unchanged; it
# only affects kernels compiled after this line (compiled code is cached with its setting).
numba.core.config.SLP_VECTORIZE = 1


@intrinsic
def _stack_f32(typingctx, n):
    """A pointer to ``n`` (a literal int) float32 on the caller's stack.

    A heap array for the lane accumulators might alias the weights or x as far
    as LLVM knows, so it keeps them in memory and does not vectorise; a stack
    slot is provably private and ends up in registers.
    """
    if not isinstance(n, types.IntegerLiteral):
        return None
    size = n.literal_value

    def codegen(context, builder, sig, args):
        return cgutils.alloca_once(builder, ir.FloatType(), size=size)

    return types.CPointer(types.float32)(n), codegen


# --- scalar decoding helpers (inlined by LLVM) ---

@njit(inline="always", **_KW)
def _f16(raw: np.ndarray, off: int, tab: np.ndarray) -> np.float32:
    """The little-endian f16 at ``raw[off:off+2]`` as float32 (exact, via a 65536-entry table)."""
    return tab[np.int64(raw[off]) | (np.int64(raw[off + 1]) << 8)]


@njit(inline="always", **_KW)
def _k4_scale_min(raw: np.ndarray, off: int, j: int) -> tuple[int, int]:
    """6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K block whose 12 packed bytes start at off.

    bytes 0-3: sc[0..3] low 6 bits | top 2 bits -> sc[4..7] bits 4-5
    bytes 4-7: m[0..3]  low 6 bits | top 2 bits -> m[4..7]  bits 4-5
    bytes 8-11: low nibble -> sc[4..7] bits 0-3, high nibble -> m[4..7] bits 0-3
    """
    if j < 4:
        return np.int64(raw[off + j]) & 63, np.int64(raw[off + j + 4]) & 63
    a, b, c = np.int64(raw[off + j - 4]), np.int64(raw[off + j]), np.int64(raw[off + j + 4])
    return (c & 0xF) | ((a >> 6) << 4), (c >> 4) | ((b >> 6) << 4)


@njit(inline="always", **_KW)
def _lane_sum(acc: np.ndarray) -> np.float32:
    """acc[0] + acc[1] + ... + acc[LANES-1], left to right."""
    s = np.float32(0.0)
    for l in range(LANES):
        s += acc[l]
    return s


@njit(**_KW)
def _sub_sums(x: np.ndarray, xs: np.ndarray) -> None:
    """xs[t, s] = x[t, 32s] + ... + x[t, 32s+31], left to right (the Q4_K/Q5_K additive term's weights)."""
    for t in range(x.shape[0]):
        for s in range(xs.shape[1]):
            v = np.float32(0.0)
            for l in range(LANES):
                v += x[t, s * LANES + l]
            xs[t, s] = v


# --- fused matvec kernels: rows [r0, r1) of one type ---
#
# Q8_0 block (34 bytes): d f16 | q int8[32]; w = d * q.

@njit(**_KW)
def _mv_q8_0(raw: np.ndarray, tab: np.ndarray, x: np.ndarray, xs: np.ndarray, y: np.ndarray,
             r0: int, r1: int) -> None:
    q = raw.view(np.int8)
    nb = x.shape[0] // 32
    acc = carray(_stack_f32(32), (LANES,))
    for r in range(r0, r1):
        acc[:] = 0.0
        for b in range(nb):
            off = (r * nb + b) * 34
            d = _f16(raw, off, tab)
            qb, xb = q[off + 2:off + 34], x[b * 32:b * 32 + 32]
            for l in range(32):
                acc[l] += (d * np.float32(qb[l])) * xb[l]
        y[r] = _lane_sum(acc)


# Q4_0 block (18 bytes): d f16 | qs[16]; w[l] = d * ((qs[l] & 15) - 8), w[16+l] = d * ((qs[l] >> 4) - 8).
# Weight c of a block sits in lane c (blocks are 32 wide).

@njit(**_KW)
def _mv_q4_0(raw: np.ndarray, tab: np.ndarray, x: np.ndarray, xs: np.ndarray, y: np.ndarray,
             r0: int, r1: int) -> None:
    nb = x.shape[0] // 32
    acc = carray(_stack_f32(32), (LANES,))
    for r in range(r0, r1):
        acc[:] = 0.0
        for b in range(nb):
            off = (r * nb + b) * 18
            d = _f16(raw, off, tab)
            qb, xb = raw[off + 2:off + 18], x[b * 32:b * 32 + 32]
            for l in range(16):
                acc[l] += (d * np.float32((np.int32(qb[l]) & 15) - 8)) * xb[l]
            for l in range(16):
                acc[16 + l] += (d * np.float32((np.int32(qb[l]) >> 4) - 8)) * xb[16 + l]
        y[r] = _lane_sum(acc)


# Q4_K block (144 bytes): d f16 | dmin f16 | scales[12] | qs[128].
# Group g (0..3) of 64 weights: w[64g + l]      = d sc[2g]   (qs[32g + l] & 15) - dmin m[2g]
#                               w[64g + 32 + l] = d sc[2g+1] (qs[32g + l] >> 4) - dmin m[2g+1]

@njit(**_KW)
def _mv_q4_k(raw: np.ndarray, tab: np.ndarray, x: np.ndarray, xs: np.ndarray, y: np.ndarray,
             r0: int, r1: int) -> None:
    nb = x.shape[0] // 256
    acc = carray(_stack_f32(32), (LANES,))
    for r in range(r0, r1):
        acc[:] = 0.0
        bias = np.float32(0.0)
        for b in range(nb):
            off = (r * nb + b) * 144
            d, dmin = _f16(raw, off, tab), _f16(raw, off + 2, tab)
            for g in range(4):
                sc0, m0 = _k4_scale_min(raw, off + 4, 2 * g)
                sc1, m1 = _k4_scale_min(raw, off + 4, 2 * g + 1)
                d0, d1 = d * np.float32(sc0), d * np.float32(sc1)
                c, qo = b * 256 + g * 64, off + 16 + g * 32
                qb, xb = raw[qo:qo + 32], x[c:c + 64]
                for l in range(32):
                    acc[l] += (d0 * np.float32(qb[l] & 15)) * xb[l]
                for l in range(32):
                    acc[l] += (d1 * np.float32(qb[l] >> 4)) * xb[32 + l]
                s = (b * 8 + 2 * g)
                bias += (-(dmin * np.float32(m0))) * xs[0, s]
                bias += (-(dmin * np.float32(m1))) * xs[0, s + 1]
        y[r] = _lane_sum(acc) + bias


# Q5_K block (176 bytes): d | dmin | scales[12] | qh[32] | qs[128]; as Q4_K plus a fifth bit:
# bit 2g of qh[l] for w[64g + l], bit 2g+1 for w[64g + 32 + l].

@njit(**_KW)
def _mv_q5_k(raw: np.ndarray, tab: np.ndarray, x: np.ndarray, xs: np.ndarray, y: np.ndarray,
             r0: int, r1: int) -> None:
    nb = x.shape[0] // 256
    acc = carray(_stack_f32(32), (LANES,))
    for r in range(r0, r1):
        acc[:] = 0.0
        bias = np.float32(0.0)
        for b in range(nb):
            off = (r * nb + b) * 176
            d, dmin = _f16(raw, off, tab), _f16(raw, off + 2, tab)
            for g in range(4):
                sc0, m0 = _k4_scale_min(raw, off + 4, 2 * g)
                sc1, m1 = _k4_scale_min(raw, off + 4, 2 * g + 1)
                d0, d1 = d * np.float32(sc0), d * np.float32(sc1)
                c, qo, ho = b * 256 + g * 64, off + 48 + g * 32, off + 16
                qb, hb, xb = raw[qo:qo + 32], raw[ho:ho + 32], x[c:c + 64]
                for l in range(32):
                    q = np.int32(qb[l] & 15) | (((np.int32(hb[l]) >> (2 * g)) & 1) << 4)
                    acc[l] += (d0 * np.float32(q)) * xb[l]
                for l in range(32):
                    q = np.int32(qb[l] >> 4) | (((np.int32(hb[l]) >> (2 * g + 1)) & 1) << 4)
                    acc[l] += (d1 * np.float32(q)) * xb[32 + l]
                s = (b * 8 + 2 * g)
                bias += (-(dmin * np.float32(m0))) * xs[0, s]
                bias += (-(dmin * np.float32(m1))) * xs[0, s + 1]
        y[r] = _lane_sum(acc) + bias


# Q6_K block (210 bytes): ql[128] | qh[64] | scales int8[16] | d f16. Half h (0, 1) of 128 weights,
# with L = ql + 64h, H = qh + 32h, S = scales + 8h, and l in 0..31:
#   w[128h +      l] = d S[l/16    ] ((L[l]      & 15) | ((H[l] >> 0 & 3) << 4)) - 32)
#   w[128h + 32 + l] = d S[l/16 + 2] ((L[l + 32] & 15) | ((H[l] >> 2 & 3) << 4)) - 32)
#   w[128h + 64 + l] = d S[l/16 + 4] ((L[l]      >> 4) | ((H[l] >> 4 & 3) << 4)) - 32)
#   w[128h + 96 + l] = d S[l/16 + 6] ((L[l + 32] >> 4) | ((H[l] >> 6 & 3) << 4)) - 32)

@njit(inline="always", **_KW)
def _q6_quant(lk: np.ndarray, hb: np.ndarray, l: int, k: int) -> np.float32:
    """Quant k (0..3) of lane l of a Q6_K half: lk = L[32(k % 2):][:32], hb = H[:32]."""
    low = (np.int32(lk[l]) >> (4 * (k >> 1))) & 15
    high = (np.int32(hb[l]) >> (2 * k)) & 3
    return np.float32((low | (high << 4)) - 32)


@njit(**_KW)
def _mv_q6_k(raw: np.ndarray, tab: np.ndarray, x: np.ndarray, xs: np.ndarray, y: np.ndarray,
             r0: int, r1: int) -> None:
    sc = raw.view(np.int8)
    nb = x.shape[0] // 256
    acc = carray(_stack_f32(32), (LANES,))
    for r in range(r0, r1):
        acc[:] = 0.0
        for b in range(nb):
            off = (r * nb + b) * 210
            d = _f16(raw, off + 208, tab)
            for h in range(2):
                lo, ho, so, c = off + 64 * h, off + 128 + 32 * h, off + 192 + 8 * h, b * 256 + 128 * h
                hb = raw[ho:ho + 32]
                for k in range(4):
                    da = d * np.float32(sc[so + 2 * k])
                    db = d * np.float32(sc[so + 2 * k + 1])
                    lk, xb = raw[lo + 32 * (k & 1):lo + 32 * (k & 1) + 32], x[c + 32 * k:c + 32 * k + 32]
                    for l in range(16):
                        acc[l] += (da * _q6_quant(lk, hb, l, k)) * xb[l]
                    for l in range(16, 32):
                        acc[l] += (db * _q6_quant(lk, hb, l, k)) * xb[l]
        y[r] = _lane_sum(acc)


# --- sub-block decoders: weights 32j .. 32j + 31 of row r (any type) into a 32-lane buffer,
# without their additive term, which is returned (Q4_K/Q5_K; 0 otherwise). Used by the fused
# matmul, the float types' matvec and dequantize. Each expression is the fused matvec's own, so
# a fused matmul row equals the matvec result bit for bit. ---

@njit(inline="always", **_KW)
def _sub_float(raw: np.ndarray, tab: np.ndarray, base: int, wb: np.ndarray, kind: int) -> None:
    """kind 0: F32, 1: F16, 2: BF16 (the top half of an f32); base = first element index."""
    if kind == 0:
        f = raw.view(np.float32)[base:base + 32]
        for l in range(32):
            wb[l] = f[l]
    elif kind == 1:
        h = raw.view(np.uint16)[base:base + 32]
        for l in range(32):
            wb[l] = tab[h[l]]
    else:
        h = raw.view(np.uint16)[base:base + 32]
        u = wb.view(np.uint32)
        for l in range(32):
            u[l] = np.uint32(h[l]) << 16


@njit(inline="always", **_KW)
def _sub_k4(raw: np.ndarray, tab: np.ndarray, r: int, j: int, nsub: int, wb: np.ndarray, five: bool) -> np.float32:
    """Sub-block j of a Q4_K row (five=False) or Q5_K row (five=True); see the matvec kernels' layout."""
    size, qs = (176, 48) if five else (144, 16)
    b, s = j // 8, j % 8
    g, h = s >> 1, s & 1
    off = (r * (nsub // 8) + b) * size
    d, dmin = _f16(raw, off, tab), _f16(raw, off + 2, tab)
    sc, m = _k4_scale_min(raw, off + 4, s)
    ds = d * np.float32(sc)
    qb, hb = raw[off + qs + 32 * g:off + qs + 32 * g + 32], raw[off + 16:off + 48]
    for l in range(32):
        q = (np.int32(qb[l]) >> (4 * h)) & 15
        if five:
            q |= ((np.int32(hb[l]) >> s) & 1) << 4
        wb[l] = ds * np.float32(q)
    return -(dmin * np.float32(m))


@njit(inline="always", **_KW)
def _sub_q6_k(raw: np.ndarray, tab: np.ndarray, r: int, j: int, nsub: int, wb: np.ndarray) -> None:
    sc = raw.view(np.int8)
    b, s = j // 8, j % 8
    h, k = s >> 2, s & 3
    off = (r * (nsub // 8) + b) * 210
    d = _f16(raw, off + 208, tab)
    lo, ho, so = off + 64 * h + 32 * (k & 1), off + 128 + 32 * h, off + 192 + 8 * h + 2 * k
    lk, hb = raw[lo:lo + 32], raw[ho:ho + 32]
    da, db = d * np.float32(sc[so]), d * np.float32(sc[so + 1])
    for l in range(16):
        wb[l] = da * _q6_quant(lk, hb, l, k)
    for l in range(16, 32):
        wb[l] = db * _q6_quant(lk, hb, l, k)


@njit(inline="always", **_KW)
def _sub32(code: int, raw: np.ndarray, tab: np.ndarray, r: int, j: int, nsub: int, wb: np.ndarray) -> np.float32:
    if code <= 2:
        _sub_float(raw, tab, (r * nsub + j) * 32, wb, code)
    elif code == 3:
        off = (r * nsub + j) * 34
        d, qb = _f16(raw, off, tab), raw.view(np.int8)[off + 2:off + 34]
        for l in range(32):
            wb[l] = d * np.float32(qb[l])
    elif code == 4:
        off = (r * nsub + j) * 18
        d, qb = _f16(raw, off, tab), raw[off + 2:off + 18]
        for l in range(16):
            wb[l] = d * np.float32((np.int32(qb[l]) & 15) - 8)
        for l in range(16):
            wb[16 + l] = d * np.float32((np.int32(qb[l]) >> 4) - 8)
    elif code == 5:
        return _sub_k4(raw, tab, r, j, nsub, wb, False)
    elif code == 6:
        return _sub_k4(raw, tab, r, j, nsub, wb, True)
    else:
        _sub_q6_k(raw, tab, r, j, nsub, wb)
    return np.float32(0.0)


# Type codes of the compiled dispatch (one kernel per code; the branch is per sub-block, not per weight).
CODES = {T.F32: 0, T.F16: 1, T.BF16: 2, T.Q8_0: 3, T.Q4_0: 4, T.Q4_K: 5, T.Q5_K: 6, T.Q6_K: 7}
SUPPORTED_TYPES: frozenset[T] = frozenset(CODES)
_HAS_BIAS = (5, 6)
POSITION_GROUP = 8  # positions per pass over a row: 8 x 32 float32 accumulators


@njit(**_KW)
def _mm_rows(code: int, raw: np.ndarray, tab: np.ndarray, x: np.ndarray, xs: np.ndarray, y: np.ndarray,
             r0: int, r1: int, lanes: int) -> None:
    """y[t, r] for rows [r0, r1) and every position t; each sub-block decoded once per group of
    POSITION_GROUP positions (its bytes stay in L1 between groups). Also the float types' matvec."""
    n_pos, cols = x.shape
    nsub = cols // 32
    with_bias = code == 5 or code == 6
    wb = carray(_stack_f32(32), (32,))
    acc = carray(_stack_f32(256), (POSITION_GROUP, LANES))
    bias = carray(_stack_f32(8), (POSITION_GROUP,))
    for r in range(r0, r1):
        for p0 in range(0, n_pos, POSITION_GROUP):
            npos = min(POSITION_GROUP, n_pos - p0)
            acc[:] = 0.0
            bias[:] = 0.0
            for j in range(nsub):
                bj = _sub32(code, raw, tab, r, j, nsub, wb)
                for t in range(npos):
                    at, xb = acc[t], x[p0 + t, 32 * j:32 * j + 32]
                    # lanes is 32 at run time; a trip count unknown at compile time keeps LLVM
                    # from unrolling this loop and then vectorising across positions with gathers.
                    for l in range(lanes):
                        at[l] += wb[l] * xb[l]
                    if with_bias:
                        bias[t] += bj * xs[p0 + t, j]
            for t in range(npos):
                v = _lane_sum(acc[t])
                y[p0 + t, r] = v + bias[t] if with_bias else v


# --- decoding rows to float32 (dequantize, and matmul's BLAS path) ---
#
# Each type's layout as in its matvec kernel. A sub-block is decoded into a stack buffer and
# then copied out: stored straight into the output, LLVM must assume the stores may overwrite
# the quantised bytes still to be read and neither reorders nor vectorises them (x8 slower).
# Each weight is gguf's own float32 value, the additive term included (Q4_K/Q5_K).

@njit(inline="always", **_KW)
def _put32(o: np.ndarray, c: int, wb: np.ndarray) -> None:
    """o[c:c+32] = wb."""
    for l in range(32):
        o[c + l] = wb[l]


@njit(**_KW)
def _dq_q8_0(raw: np.ndarray, tab: np.ndarray, out: np.ndarray, r0: int, r1: int) -> None:
    q = raw.view(np.int8)
    nb = out.shape[1] // 32
    wb = carray(_stack_f32(32), (32,))
    for r in range(r0, r1):
        o = out[r - r0]
        for b in range(nb):
            off = (r * nb + b) * 34
            d = _f16(raw, off, tab)
            for l in range(32):
                wb[l] = d * np.float32(q[off + 2 + l])
            _put32(o, 32 * b, wb)


@njit(**_KW)
def _dq_q4_0(raw: np.ndarray, tab: np.ndarray, out: np.ndarray, r0: int, r1: int) -> None:
    nb = out.shape[1] // 32
    wb = carray(_stack_f32(32), (32,))
    for r in range(r0, r1):
        o = out[r - r0]
        for b in range(nb):
            off = (r * nb + b) * 18
            d = _f16(raw, off, tab)
            qb = raw[off + 2:off + 18]
            for l in range(16):
                wb[l] = d * np.float32((np.int32(qb[l]) & 15) - 8)
            for l in range(16):
                wb[16 + l] = d * np.float32((np.int32(qb[l]) >> 4) - 8)
            _put32(o, 32 * b, wb)


@njit(**_KW)
def _dq_k4(raw: np.ndarray, tab: np.ndarray, out: np.ndarray, r0: int, r1: int, five: bool) -> None:
    """Q4_K (five=False) or Q5_K (five=True): w = d sc q + (-(dmin m))."""
    size, qs = (176, 48) if five else (144, 16)
    nb = out.shape[1] // 256
    wb = carray(_stack_f32(32), (32,))
    for r in range(r0, r1):
        o = out[r - r0]
        for b in range(nb):
            off = (r * nb + b) * size
            d, dmin = _f16(raw, off, tab), _f16(raw, off + 2, tab)
            hb = raw[off + 16:off + 48]
            for g in range(4):
                c, qb = b * 256 + g * 64, raw[off + qs + g * 32:off + qs + g * 32 + 32]
                sc0, m0 = _k4_scale_min(raw, off + 4, 2 * g)
                sc1, m1 = _k4_scale_min(raw, off + 4, 2 * g + 1)
                d0, d1 = d * np.float32(sc0), d * np.float32(sc1)
                b0, b1 = -(dmin * np.float32(m0)), -(dmin * np.float32(m1))
                if five:
                    for l in range(32):
                        q = (np.int32(qb[l]) & 15) | (((np.int32(hb[l]) >> (2 * g)) & 1) << 4)
                        wb[l] = d0 * np.float32(q) + b0
                    _put32(o, c, wb)
                    for l in range(32):
                        q = (np.int32(qb[l]) >> 4) | (((np.int32(hb[l]) >> (2 * g + 1)) & 1) << 4)
                        wb[l] = d1 * np.float32(q) + b1
                    _put32(o, c + 32, wb)
                else:
                    for l in range(32):
                        wb[l] = d0 * np.float32(np.int32(qb[l]) & 15) + b0
                    _put32(o, c, wb)
                    for l in range(32):
                        wb[l] = d1 * np.float32(np.int32(qb[l]) >> 4) + b1
                    _put32(o, c + 32, wb)


@njit(**_KW)
def _dq_q6_k(raw: np.ndarray, tab: np.ndarray, out: np.ndarray, r0: int, r1: int) -> None:
    sc = raw.view(np.int8)
    nb = out.shape[1] // 256
    wb = carray(_stack_f32(32), (32,))
    for r in range(r0, r1):
        o = out[r - r0]
        for b in range(nb):
            off = (r * nb + b) * 210
            d = _f16(raw, off + 208, tab)
            for h in range(2):
                lo, ho, so, c = off + 64 * h, off + 128 + 32 * h, off + 192 + 8 * h, b * 256 + 128 * h
                hb = raw[ho:ho + 32]
                for k in range(4):
                    da = d * np.float32(sc[so + 2 * k])
                    db = d * np.float32(sc[so + 2 * k + 1])
                    lk = raw[lo + 32 * (k & 1):lo + 32 * (k & 1) + 32]
                    for l in range(16):
                        wb[l] = da * _q6_quant(lk, hb, l, k)
                    for l in range(16, 32):
                        wb[l] = db * _q6_quant(lk, hb, l, k)
                    _put32(o, c + 32 * k, wb)


@njit(**_KW)
def _dq_rows(code: int, raw: np.ndarray, tab: np.ndarray, out: np.ndarray, r0: int, r1: int) -> None:
    """out[r - r0] = the weights of row r for rows [r0, r1), with Q4_K/Q5_K's additive term."""
    if code == 3:
        _dq_q8_0(raw, tab, out, r0, r1)
    elif code == 4:
        _dq_q4_0(raw, tab, out, r0, r1)
    elif code == 5 or code == 6:
        _dq_k4(raw, tab, out, r0, r1, code == 6)
    elif code == 7:
        _dq_q6_k(raw, tab, out, r0, r1)
    else:  # the float types
        nsub = out.shape[1] // 32
        wb = carray(_stack_f32(32), (32,))
        for r in range(r0, r1):
            for j in range(nsub):
                _sub32(code, raw, tab, r, j, nsub, wb)
                _put32(out[r - r0], 32 * j, wb)


@njit(**_KW)
def _mv_code(code: int, raw: np.ndarray, tab: np.ndarray, x: np.ndarray, xs: np.ndarray, y: np.ndarray,
             r0: int, r1: int, lanes: int) -> None:
    """matvec rows [r0, r1): the fused kernel of the type, or decode-a-row for the others."""
    if code == 3:
        _mv_q8_0(raw, tab, x, xs, y, r0, r1)
    elif code == 5:
        _mv_q4_k(raw, tab, x, xs, y, r0, r1)
    elif code == 6:
        _mv_q5_k(raw, tab, x, xs, y, r0, r1)
    elif code == 7:
        _mv_q6_k(raw, tab, x, xs, y, r0, r1)
    elif code == 4:
        _mv_q4_0(raw, tab, x, xs, y, r0, r1)
    else:
        _mm_rows(code, raw, tab, x.reshape(1, x.shape[0]), xs, y.reshape(1, y.shape[0]), r0, r1, lanes)


@njit(**_KW)
def _mm_code(code: int, raw: np.ndarray, tab: np.ndarray, x: np.ndarray, xs: np.ndarray, y: np.ndarray,
             r0: int, r1: int, lanes: int) -> None:
    """matmul rows [r0, r1): for Q8_0, Q4_0, Q4_K, Q6_K the fused matvec once per position. A chunk of rows (CHUNK_WEIGHTS
    weights, < 300 KiB of quantised bytes) stays in L2 across the positions, so the bytes are read
    from memory once; decoding is redone per position, which measured faster than decoding once
    into float32 and re-reading that. Q5_K and the float types decode each sub-block once."""
    if code == 3 or code == 4 or code == 5 or code == 7:
        for t in range(x.shape[0]):
            _mv_code(code, raw, tab, x[t], xs[t:t + 1], y[t], r0, r1, lanes)
    else:
        _mm_rows(code, raw, tab, x, xs, y, r0, r1, lanes)


# --- the same chunks through numba's own thread pool ---

@njit(parallel=True, cache=True, fastmath=False, error_model="numpy")
def _mv_prange(code: int, raw: np.ndarray, tab: np.ndarray, x: np.ndarray, xs: np.ndarray, y: np.ndarray,
               step: int, lanes: int) -> None:
    rows = y.shape[0]
    for i in prange((rows + step - 1) // step):
        _mv_code(code, raw, tab, x, xs, y, i * step, min(rows, (i + 1) * step), lanes)


@njit(parallel=True, cache=True, fastmath=False, error_model="numpy")
def _mm_prange(code: int, raw: np.ndarray, tab: np.ndarray, x: np.ndarray, xs: np.ndarray, y: np.ndarray,
               step: int, lanes: int) -> None:
    rows = y.shape[1]
    for i in prange((rows + step - 1) // step):
        _mm_code(code, raw, tab, x, xs, y, i * step, min(rows, (i + 1) * step), lanes)


# --- int8 activations (candidate; changes numerics) ---
#
# x is cut into blocks of 32, each stored as dx = max|x| / 127 and qx = round(x / dx) in int8
# (llama.cpp's block_q8_0). A Q8_0 row then is sum over blocks of (d * dx) * (sum_l q[l] qx[l]),
# the inner sum exact in int32, the outer one in float32, left to right.

@njit(**_KW)
def _quantize_x_q8(x: np.ndarray, qx: np.ndarray, dx: np.ndarray) -> None:
    for b in range(x.shape[0] // 32):
        amax = np.float32(0.0)
        for l in range(32):
            amax = max(amax, abs(x[b * 32 + l]))
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
        dx[b] = d
        for l in range(32):
            qx[b * 32 + l] = np.int8(np.round(x[b * 32 + l] * inv))


@njit(**_KW)
def _mv_q8_0_i8(raw: np.ndarray, tab: np.ndarray, qx: np.ndarray, dx: np.ndarray, y: np.ndarray,
                r0: int, r1: int) -> None:
    q = raw.view(np.int8)
    nb = qx.shape[0] // 32
    for r in range(r0, r1):
        s = np.float32(0.0)
        for b in range(nb):
            off = (r * nb + b) * 34
            isum = np.int32(0)
            qb, xb = q[off + 2:off + 34], qx[b * 32:b * 32 + 32]
            for l in range(32):
                isum += np.int32(qb[l]) * np.int32(xb[l])
            s += (_f16(raw, off, tab) * dx[b]) * np.float32(isum)
        y[r] = s


# --- Python side: chunk grid, threads, checks ---

_parallel = os.environ.get("COLIBRI_JIT_PARALLEL", "pool")


def set_parallel(mode: str) -> None:
    """``"pool"`` (Python threads; default) or ``"prange"`` (numba's thread pool) for the same chunks."""
    global _parallel
    if mode not in ("pool", "prange"):
        raise ValueError(f"parallel mode must be 'pool' or 'prange', got {mode!r}")
    _parallel = mode


def _code(w: QTensor) -> int:
    code = CODES.get(w.ggml_type)
    if code is None:
        raise TypeError(f"no compiled kernel for {getattr(w.ggml_type, 'name', w.ggml_type)}")
    return code


def _step(cols: int) -> int:
    """Rows per chunk: depends on the row length only."""
    return max(1, CHUNK_WEIGHTS // cols)


def _run_chunks(rows: int, step: int, fn) -> None:
    """fn(r0, r1) for every chunk of ``step`` rows, on up to ``get_num_threads()`` threads taking chunks in turn."""
    chunks = [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]
    n = min(get_num_threads(), len(chunks))
    if n <= 1:
        for r0, r1 in chunks:
            fn(r0, r1)
        return
    taken = itertools.count()  # next() is atomic under the GIL

    def run() -> None:
        while (i := next(taken)) < len(chunks):
            fn(*chunks[i])

    futures = [workers().submit(run) for _ in range(n - 1)]
    try:
        run()
    finally:
        errors = [f.exception() for f in futures]  # every worker writes into the caller's output
    for e in errors:
        if e is not None:
            raise e


def _x2d(w: QTensor, x: np.ndarray, ndim: int) -> np.ndarray:
    if x.ndim != ndim or x.shape[-1] != w.cols:
        want = "(cols,)" if ndim == 1 else "(T, cols)"
        raise ValueError(f"x of shape {x.shape} does not fit {w.ggml_type.name}{w.shape}: want {want} "
                         f"with cols={w.cols}")
    return np.ascontiguousarray(x.reshape(-1, w.cols), dtype=np.float32)


def _raw(w: QTensor) -> np.ndarray:
    """The tensor's bytes as a plain contiguous uint8 ndarray (an np.memmap becomes a view of the same bytes)."""
    return np.ascontiguousarray(np.asarray(w.data))


def _sums(code: int, x: np.ndarray) -> np.ndarray:
    xs = np.empty((x.shape[0], max(1, x.shape[1] // 32)), np.float32)
    if code in _HAS_BIAS:
        _sub_sums(x, xs)
    return xs


def matvec(w: QTensor, x: np.ndarray) -> np.ndarray:
    """``W @ x`` for one position: x (cols,) float32 -> (rows,) float32."""
    code = _code(w)
    x2 = _x2d(w, x, 1)
    xs, xv = _sums(code, x2), x2[0]
    y, raw = np.empty(w.rows, np.float32), _raw(w)
    step = _step(w.cols)
    if _parallel == "prange":
        _mv_prange(code, raw, _F16_TO_F32, xv, xs, y, step, LANES)
    else:
        _run_chunks(w.rows, step, lambda r0, r1: _mv_code(code, raw, _F16_TO_F32, xv, xs, y, r0, r1, LANES))
    return y


def matmul(w: QTensor, x: np.ndarray) -> np.ndarray:
    """``x @ W.T`` for a batch of positions: x (T, cols) float32 -> (T, rows) float32.

    With the ``"fused"`` path, or fewer than :data:`BLAS_MIN_POSITIONS` positions, row t
    equals ``matvec(w, x[t])`` bit for bit. With the ``"blas"`` path (see :func:`set_matmul`)
    it is as accurate but may differ from it in the last bits; either way the same
    inputs give the same bits whatever the thread count or where ``w``'s bytes live.
    """
    code = _code(w)
    x2 = _x2d(w, x, 2)
    y = np.empty((x2.shape[0], w.rows), np.float32)
    if x2.shape[0] == 0:
        return y
    blas = _matmul_path == "blas" and x2.shape[0] >= BLAS_MIN_POSITIONS
    (_matmul_blas if blas else _matmul_fused)(code, _raw(w), x2, y)
    return y


def _matmul_fused(code: int, raw: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
    """y = x @ W.T with the fused kernels, row chunks of :func:`_step` on the kernel threads."""
    xs, step = _sums(code, x), _step(x.shape[1])
    if _parallel == "prange":
        _mm_prange(code, raw, _F16_TO_F32, x, xs, y, step, LANES)
    else:
        _run_chunks(y.shape[1], step, lambda r0, r1: _mm_code(code, raw, _F16_TO_F32, x, xs, y, r0, r1, LANES))


# --- prefill through BLAS: rows decoded to float32 once per chunk, one sgemm for every position ---

MATMUL_PATHS = ("blas", "fused")
# An sgemm of up to about this many multiply-adds runs OpenBLAS's small-matrix kernels, which
# skip packing and measured x3-6 faster than its general path at 4-16 positions; a batch that
# narrow gets chunks of as many rows as fit this, at most BLAS_MAX_CHUNK_WEIGHTS weights.
BLAS_SMALL_MACS = 1 << 19
BLAS_MAX_CHUNK_WEIGHTS = 1 << 18
# Wider batches: rows per chunk hold about this many weights, a float32 copy (256 KiB) that
# stays in L2 while the general sgemm streams every position past it.
BLAS_CHUNK_WEIGHTS = 1 << 16
# Fewest positions that take the BLAS path. Below it (decode is one position) the fused
# kernels win: on 2 threads the BLAS path measured x0.79-1.14 of fused at 2-3 positions and
# x1.08-1.54 at 4 (Q8_0, Q4_K, Q6_K; expert and attention shapes), rising with the batch.
BLAS_MIN_POSITIONS = 4
DEFAULT_MATMUL = "blas"  # prefill x1.54 end to end (evidence/decode_20261129T210129Z.md)


def _initial_matmul() -> str:
    """COLIBRI_MATMUL if it names a path, else the default (with a warning for a bad name)."""
    name = os.environ.get("COLIBRI_MATMUL", DEFAULT_MATMUL)
    if name not in MATMUL_PATHS:
        warnings.warn(f"COLIBRI_MATMUL={name!r} is not one of {', '.join(MATMUL_PATHS)}; "
                      f"using {DEFAULT_MATMUL!r}", RuntimeWarning, stacklevel=2)
        return DEFAULT_MATMUL
    return name


_matmul_path = _initial_matmul()


def set_matmul(path: str) -> None:
    """How :func:`matmul` multiplies :data:`BLAS_MIN_POSITIONS` or more positions.

    ``"blas"``: decode a chunk of rows to float32 into a per-thread scratch buffer,
    then one single-threaded BLAS sgemm with every position; ``"fused"``: the fused
    matvec kernel once per position over the quantised bytes. Also set at import by
    the ``COLIBRI_MATMUL`` environment variable.
    """
    global _matmul_path
    if path not in MATMUL_PATHS:
        raise ValueError(f"matmul path must be one of {', '.join(MATMUL_PATHS)}, got {path!r}")
    _matmul_path = path


def get_matmul() -> str:
    """The path :func:`matmul` takes for :data:`BLAS_MIN_POSITIONS` or more positions."""
    return _matmul_path


def _blas_step(n_pos: int, cols: int) -> int:
    """Rows per BLAS chunk: a function of the shape only (never of the thread count), a multiple
    of 8 (sgemm's register tiles), so the float32 scratch holds at most max(8 rows, BLAS_MAX_CHUNK_WEIGHTS)."""
    small = BLAS_SMALL_MACS // (n_pos * cols) // 8 * 8
    if small >= 8:
        return min(small, max(8, BLAS_MAX_CHUNK_WEIGHTS // cols // 8 * 8))
    return max(8, BLAS_CHUNK_WEIGHTS // cols // 8 * 8)


def _matmul_blas(code: int, raw: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
    """y = x @ W.T, chunk by chunk: decode the chunk's rows, one sgemm, copy the columns out.

    BLAS reads and writes only page-aligned scratch (x copied once, the chunk's weights,
    its output), so which instructions it picks cannot depend on where the caller's
    arrays or the raw bytes start. Runs on the kernel pool whatever :func:`set_parallel`
    says: numba's pool cannot call BLAS.
    """
    n_pos, cols = x.shape
    xa = thread_scratch().get("blas_x", (n_pos, cols), np.float32)
    xa[...] = x

    def chunk(r0: int, r1: int) -> None:
        s = thread_scratch()
        wc = s.get("blas_w", (r1 - r0, cols), np.float32)
        _dq_rows(code, raw, _F16_TO_F32, wc, r0, r1)
        yc = s.get("blas_y", (n_pos, r1 - r0), np.float32)
        # np.dot, not np.matmul: the matmul ufunc keeps the GIL for a single small product,
        # which serialised the two threads' sgemm calls (measured x0.5 at 4-8 positions).
        np.dot(xa, wc.T, out=yc)
        y[:, r0:r1] = yc

    _run_chunks(y.shape[1], _blas_step(n_pos, cols), chunk)


def dequantize(w: QTensor) -> np.ndarray:
    """All weights of ``w`` as a new float32 array of shape ``w.shape``."""
    code = _code(w)
    out, raw = np.empty((w.rows, w.cols), np.float32), _raw(w)
    _run_chunks(w.rows, _step(w.cols), lambda r0, r1: _dq_rows(code, raw, _F16_TO_F32, out[r0:r1], r0, r1))
    return out.reshape(w.shape)


def matvec_q8(w: QTensor, x: np.ndarray) -> np.ndarray:
    """Q8_0 ``W @ x`` with x quantised to int8 per block of 32 (approximate; a candidate, not a default)."""
    if w.ggml_type != T.Q8_0:
        raise TypeError(f"matvec_q8 takes Q8_0 weights, not {w.ggml_type.name}")
    xv = _x2d(w, x, 1)[0]
    qx, dx = np.empty(w.cols, np.int8), np.empty(w.cols // 32, np.float32)
    _quantize_x_q8(xv, qx, dx)
    y, raw = np.empty(w.rows, np.float32), _raw(w)
    _run_chunks(w.rows, _step(w.cols), lambda r0, r1: _mv_q8_0_i8(raw, _F16_TO_F32, qx, dx, y, r0, r1))
    return y


def warm_up(types: tuple[T, ...] | None = None) -> float:
    """Compile (or load from numba's on-disk cache) every kernel a call can reach; returns seconds.

    One tiny call per entry point and type signature; the engine calls this at
    start so that the first token pays no compilation.
    """
    t0 = time.perf_counter()
    for t in types or tuple(CODES):
        cols = 256  # a whole number of blocks of every supported type
        w = QTensor(np.zeros(QTensor.nbytes_for(t, (1, cols)), np.uint8), t, (1, cols))
        x = np.zeros((max(2, BLAS_MIN_POSITIONS), cols), np.float32)
        y = np.empty((x.shape[0], 1), np.float32)
        matvec(w, x[0])
        matmul(w, x)
        for path in (_matmul_fused, _matmul_blas):  # either may run whatever set_matmul says now
            path(_code(w), _raw(w), x, y)
        dequantize(w)
    return time.perf_counter() - t0


def numba_version() -> str:
    return numba.__version__
