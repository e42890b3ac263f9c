"""Products with GGUF-quantised weight matrices, straight from their raw bytes.

Shapes (NumPy order; ``cols`` is ggml's ``ne[0]``, the quantised axis)::

    dequantize(w)        w: (rows, cols)             -> (rows, cols) float32
    matvec(w, x)         x: (cols,)                  -> (rows,)      float32
    matmul(w, x)         x: (T, cols)                -> (T, rows)    float32   (prefill)

The rows are cut into chunks whose size depends only on ``cols`` (about
CHUNK_WEIGHTS weights each). For each chunk the quant blocks are decoded into
a float32 scratch buffer small enough to stay in cache, and one BLAS product
consumes it. Runs of consecutive chunks are shared among a small thread pool
(NumPy and BLAS release the GIL); since the chunk grid never depends on the
thread count or on timing, neither does the result.

Invariant 1 (placement changes speed, never tokens): BLAS only ever sees
kernel-owned, page-aligned buffers (weights decoded into scratch, ``x`` copied
into scratch), so results are bit-identical whether ``w.data`` is an mmap, a
RAM copy or a view at any offset inside a buffer-pool slot.

The thread count defaults to 2; set ``COLIBRI_KERNEL_THREADS`` or call
:func:`set_num_threads`.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import GGMLQuantizationType

from colibri_aio.errors import ModelFormatError
from colibri_aio.kernels.qtensor import QTensor
from colibri_aio.kernels.quant_formats import FORMATS, Format, Scales, decode_full
from colibri_aio.kernels.scratch import thread_scratch

__all__ = ["SUPPORTED_TYPES", "dequantize", "matvec", "matmul", "set_num_threads", "get_num_threads"]

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(FORMATS)

# Weights decoded per chunk: 64 Ki float32 = 256 KiB of scratch, which with the
# raw bytes fits the 1 MiB L2 of one core here.
CHUNK_WEIGHTS = 1 << 16
# Weights whose block scales are unpacked in one vectorised step.
SCALE_BATCH_WEIGHTS = 1 << 20

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_num_threads = max(1, int(os.environ.get("COLIBRI_KERNEL_THREADS", "2")))


def set_num_threads(n: int) -> None:
    """Use ``n`` threads (the caller plus ``n - 1`` pool workers) for every kernel call."""
    global _pool, _num_threads
    if n < 1:
        raise ValueError(f"kernel thread count must be >= 1, got {n}")
    with _pool_lock:
        old, _pool, _num_threads = _pool, None, n
    if old is not None:
        old.shutdown(wait=True)


def get_num_threads() -> int:
    """The number of threads a kernel call uses."""
    return _num_threads


def _workers() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max(1, _num_threads - 1), thread_name_prefix="colibri-kernel")
        return _pool


def _format_of(w: QTensor) -> Format:
    fmt = FORMATS.get(w.ggml_type)
    if fmt is None:
        name = getattr(w.ggml_type, "name", str(w.ggml_type))
        raise ModelFormatError(f"unsupported tensor type {name}: this engine runs "
                               + ", ".join(sorted(t.name for t in SUPPORTED_TYPES)))
    return fmt


def _raw_rows(w: QTensor, fmt: Format) -> np.ndarray:
    """The (rows, blocks_per_row, type_size) view of the tensor's bytes."""
    return w.data.reshape(w.rows, w.cols // fmt.block, fmt.type_size)


def _chunk_rows(cols: int) -> int:
    return max(1, CHUNK_WEIGHTS // cols)


def _scale_rows(cols: int) -> int:
    """Rows per scale batch: a whole number of chunks, so batches never cut the chunk grid."""
    c = _chunk_rows(cols)
    return c * max(1, SCALE_BATCH_WEIGHTS // (c * cols))


def _rows_of(s: Scales, a: int, b: int) -> Scales:
    return Scales(*(None if v is None else v[a:b] for v in s))


ChunkFn = Callable[[int, int, np.ndarray, Scales], None]


def _for_chunks(w: QTensor, fmt: Format, chunk_fn: ChunkFn) -> None:
    """Call ``chunk_fn(start, stop, raw_chunk, scales_chunk)`` for every row chunk, across the threads."""
    raw = _raw_rows(w, fmt)
    rows, step, batch = w.rows, _chunk_rows(w.cols), _scale_rows(w.cols)
    n_chunks = -(-rows // step)

    def run(c0: int, c1: int) -> None:
        r0, r1 = c0 * step, min(c1 * step, rows)
        for b0 in range(r0, r1, batch):
            b1 = min(b0 + batch, r1)
            scales = fmt.prepare(raw[b0:b1])
            for s0 in range(b0, b1, step):
                s1 = min(s0 + step, b1)
                chunk_fn(s0, s1, raw[s0:s1], _rows_of(scales, s0 - b0, s1 - b0))

    n = min(_num_threads, n_chunks)
    bounds = [k * n_chunks // n for k in range(n + 1)]
    futures = [_workers().submit(run, bounds[k], bounds[k + 1]) for k in range(1, n)]
    try:
        run(bounds[0], bounds[1])
    finally:
        # Wait for every worker even if ours failed: they write into the caller's output.
        errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e


def _decode_chunk(fmt: Format, raw: np.ndarray, s: Scales, cols: int) -> np.ndarray:
    """The chunk as a scratch matrix (n, cols + offsets): decoded weights, then -dmin*m per sub-block."""
    n_off = 0 if s.neg_offset is None else s.neg_offset.shape[1]
    scratch = thread_scratch()
    wbuf = scratch.get("w", (raw.shape[0], cols + n_off), np.float32)
    fmt.decode(raw, s, wbuf[:, :cols], scratch)
    if n_off:
        wbuf[:, cols:] = s.neg_offset
    return wbuf


def _extended_x(fmt: Format, x: np.ndarray) -> np.ndarray:
    """x (T, cols) copied into scratch, followed by its sums over each offset sub-block."""
    t, cols = x.shape
    n_off = cols // fmt.sub if fmt.sub else 0
    xx = thread_scratch().get("x", (t, cols + n_off), np.float32)
    np.copyto(xx[:, :cols], x, casting="same_kind")
    if n_off:
        np.sum(xx[:, :cols].reshape(t, n_off, fmt.sub), axis=-1, out=xx[:, cols:])
    return xx


def _check_x(w: QTensor, x: np.ndarray, ndim: int) -> None:
    if x.ndim != ndim or x.shape[-1] != w.cols:
        want = "(cols,)" if ndim == 1 else "(T, cols)"
        raise ValueError(f"x of shape {x.shape} does not fit {w.ggml_type.name}{w.shape}: want {want} "
                         f"with cols={w.cols}")


def dequantize(w: QTensor) -> np.ndarray:
    """All weights of ``w`` as a new float32 array of shape ``w.shape``."""
    fmt = _format_of(w)
    out = np.empty((w.rows, w.cols), np.float32)

    def chunk(s0: int, s1: int, raw: np.ndarray, s: Scales) -> None:
        decode_full(fmt, raw, s, out[s0:s1], thread_scratch())

    _for_chunks(w, fmt, chunk)
    return out.reshape(w.shape)


def matvec(w: QTensor, x: np.ndarray) -> np.ndarray:
    """``W @ x`` for one position: x (cols,) float32 -> (rows,) float32."""
    fmt = _format_of(w)
    _check_x(w, x, 1)
    xx = _extended_x(fmt, x.reshape(1, -1))[0]
    y = np.empty(w.rows, np.float32)

    def chunk(s0: int, s1: int, raw: np.ndarray, s: Scales) -> None:
        wbuf = _decode_chunk(fmt, raw, s, w.cols)
        yb = thread_scratch().get("y", (s1 - s0,), np.float32)
        np.matmul(wbuf, xx, out=yb)
        y[s0:s1] = yb

    _for_chunks(w, fmt, chunk)
    return y


def matmul(w: QTensor, x: np.ndarray) -> np.ndarray:
    """``x @ W.T`` for a batch of positions: x (T, cols) float32 -> (T, rows) float32."""
    fmt = _format_of(w)
    _check_x(w, x, 2)
    t = x.shape[0]
    y = np.empty((t, w.rows), np.float32)
    if t == 0:
        return y
    xx = _extended_x(fmt, x)

    def chunk(s0: int, s1: int, raw: np.ndarray, s: Scales) -> None:
        wbuf = _decode_chunk(fmt, raw, s, w.cols)
        yb = thread_scratch().get("y", (t, s1 - s0), np.float32)
        np.matmul(xx, wbuf.T, out=yb)
        y[:, s0:s1] = yb

    _for_chunks(w, fmt, chunk)
    return y
