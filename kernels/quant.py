"""Products with GGUF-quantised weight matrices, straight from their raw bytes.

Shapes (NumPy order; ``cols`` is ggml's ``ne[0]``, the quantised axis)::

    dequantize(w)        w: (rows, cols)             -> (rows, cols) float32
    matvec(w, x)         x: (cols,)                  -> (rows,)      float32
    matmul(w, x)         x: (T, cols)                -> (T, rows)    float32   (prefill)

The rows are cut into chunks whose size depends only on ``cols`` (about
MATVEC_CHUNK_WEIGHTS or MATMUL_CHUNK_WEIGHTS weights each). Runs of
consecutive chunks are shared among a small thread pool (NumPy and BLAS
release the GIL); the chunk grid never depends on the thread count or on
timing, so neither does the result.

Per chunk, with q the integer quants and (mul, bias) the per-sub-block scales
of :mod:`.quant_formats` (``weight = q * mul + bias``):

* matvec never scales the weights one by one: it forms ``q * x`` (long
  contiguous passes), sums it per sub-block with a BLAS product by a ones
  vector, and only then applies ``mul`` and ``bias`` per sub-block;
* matmul decodes ``q * mul`` into a float32 scratch matrix whose extra
  columns hold ``bias``, and multiplies it by ``[x | x summed per sub-block]``.

Invariant 1 (placement changes speed, never tokens): BLAS only ever reads
kernel-owned, page-aligned buffers (weights decoded into scratch, ``x`` copied
into scratch), so results are bit-identical whether ``w.data`` is an mmap, a
RAM copy or a view at any offset inside a buffer-pool slot.

The thread count defaults to 2; set ``COLIBRI_KERNEL_THREADS`` or call
:func:`set_num_threads`.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType

from colibri_aio.errors import ModelFormatError
from colibri_aio.kernels.qtensor import QTensor
from colibri_aio.kernels.threads import get_num_threads, set_num_threads, workers
from colibri_aio.kernels.quant_formats import FORMATS, Format, Scales, scale_index
from colibri_aio.kernels.scratch import aligned_empty, thread_scratch

__all__ = ["SUPPORTED_TYPES", "dequantize", "matvec", "matmul", "set_num_threads", "get_num_threads"]

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(FORMATS)

# Weights per chunk of rows. matvec does about ten NumPy calls per chunk, so
# big chunks pay off although their float32 scratch (1 MiB) spills from L2;
# larger ones made OpenBLAS slower here. matmul's 256 KiB scratch stays in L2.
MATVEC_CHUNK_WEIGHTS = 1 << 18
MATMUL_CHUNK_WEIGHTS = 1 << 16
# Positions per sgemm call. OpenBLAS runs an sgemm above about 1e6
# multiply-adds on its own threads; called from two kernel threads at once that
# collapsed to ~0.01 G weights/s here. 8 positions x one chunk stays below it.
GEMM_POSITIONS = 8
# Raw bytes whose block scales are unpacked in one vectorised step: few enough
# that the rows are still in L2 when their chunks are decoded, many enough that
# the ~25 NumPy calls of a K-quant scale unpacking are amortised.
SCALE_BATCH_BYTES = 1 << 19

_ONES = aligned_empty((1024,), np.float32)
_ONES.fill(1.0)


# --- the chunk grid ---

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


def _scale_rows(chunk_rows: int, row_bytes: int) -> int:
    """Rows per scale batch: a whole number of chunks, so batches never cut the chunk grid."""
    return chunk_rows * max(1, SCALE_BATCH_BYTES // (chunk_rows * row_bytes))


def _rows_of(s: Scales, a: int, b: int) -> Scales:
    return Scales(*(None if v is None else v[a:b] for v in s))


ChunkFn = Callable[[int, int, np.ndarray, Scales], None]


def _for_chunks(w: QTensor, fmt: Format, chunk_weights: int, chunk_fn: ChunkFn) -> None:
    """Call ``chunk_fn(start, stop, raw_chunk, scales_chunk)`` for every row chunk, across the threads.

    Chunks are ``chunk_weights // cols`` rows (at least one) and scale batches a
    whole number of chunks; that grid depends on the shape only. Threads take
    batches from a shared counter, so a thread the OS deschedules holds up no
    one; which thread ran a chunk never changes its result, since every thread
    decodes into identical page-aligned scratch.
    """
    raw = _raw_rows(w, fmt)
    rows, step = w.rows, max(1, chunk_weights // w.cols)
    batch = _scale_rows(step, raw.shape[1] * raw.shape[2])
    index = scale_index(fmt.ggml_type, w.cols)
    batches = [(b0, min(b0 + batch, rows)) for b0 in range(0, rows, batch)]
    taken = itertools.count()  # next() on it is atomic under the GIL

    def run() -> None:
        while (i := next(taken)) < len(batches):
            b0, b1 = batches[i]
            scales = fmt.prepare(raw[b0:b1], index)
            for s0 in range(b0, b1, step):
                s1 = min(s0 + step, b1)
                chunk_fn(s0, s1, raw[s0:s1], _rows_of(scales, s0 - b0, s1 - b0))

    futures = [workers().submit(run) for _ in range(min(get_num_threads(), len(batches)) - 1)]
    try:
        run()
    finally:
        # Wait for every worker even if ours failed: they write into the caller's output.
        errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e


# --- activations, in layout order, in scratch ---

def _layout_x(fmt: Format, x: np.ndarray, extra: int) -> np.ndarray:
    """x (T, cols) permuted to the format's layout, in scratch with ``extra`` free columns after it."""
    t, cols = x.shape
    xx = thread_scratch().get("x", (t, cols + extra), np.float32)
    order = fmt.column_order(cols)
    np.copyto(xx[:, :cols], x if order is None else x[:, order], casting="same_kind")
    return xx


def _sub_block_sums(fmt: Format, xp: np.ndarray, out: np.ndarray) -> None:
    """out (T, S) = xp (T, cols) summed over each sub-block of ``fmt.sub`` layout columns."""
    t, cols = xp.shape
    np.sum(xp.reshape(t, cols // fmt.sub, fmt.sub), axis=-1, out=out)


def _check_x(w: QTensor, x: np.ndarray, ndim: int) -> None:
    if x.ndim != ndim or x.shape[-1] != w.cols:
        want = "(cols,)" if ndim == 1 else "(T, cols)"
        raise ValueError(f"x of shape {x.shape} does not fit {w.ggml_type.name}{w.shape}: want {want} "
                         f"with cols={w.cols}")


# --- per-chunk kernels ---

def _chunk_matvec(fmt: Format, raw: np.ndarray, s: Scales, xp: np.ndarray, v: np.ndarray) -> np.ndarray:
    """y (n,) for one chunk; xp is x in layout order, v = [ones per sub-block | x sums per sub-block]."""
    scratch = thread_scratch()
    n, cols = raw.shape[0], xp.shape[0]
    y = scratch.get("y", (n,), np.float32)
    if fmt.sub == 0:
        np.matmul(fmt.decode(raw, scratch), xp, out=y)
        return y
    q = fmt.decode(raw, scratch)
    e = scratch.get("e", (n, cols), np.float32)
    np.copyto(e.reshape(q.shape, copy=False), q)
    np.multiply(e, xp, out=e)
    n_sub = cols // fmt.sub
    # z = [(q . x per sub-block) * mul | bias]; y = z @ v
    z = scratch.get("z", (n, v.shape[0]), np.float32)
    p = scratch.get("p", (n * n_sub,), np.float32)
    np.matmul(e.reshape(n * n_sub, fmt.sub), _ONES[:fmt.sub], out=p)
    np.multiply(p.reshape(n, n_sub), s.mul, out=z[:, :n_sub])
    if s.bias is not None:
        z[:, n_sub:] = s.bias
    np.matmul(z, v, out=y)
    return y


def _chunk_weights(fmt: Format, raw: np.ndarray, s: Scales, cols: int, with_bias: bool) -> np.ndarray:
    """The chunk as float32 scratch (n, cols [+ sub-blocks]): q * mul in layout order [, then bias]."""
    scratch = thread_scratch()
    if fmt.sub == 0:
        return fmt.decode(raw, scratch)
    n, n_sub = raw.shape[0], cols // fmt.sub
    q = fmt.decode(raw, scratch)
    wbuf = scratch.get("w", (n, cols + (n_sub if with_bias else 0)), np.float32)
    np.multiply(q.reshape(n, n_sub, fmt.sub), s.mul[..., None],
                out=wbuf[:, :cols].reshape((n, n_sub, fmt.sub), copy=False))
    if with_bias:
        wbuf[:, cols:] = s.bias
    return wbuf


# --- public API ---

def dequantize(w: QTensor) -> np.ndarray:
    """All weights of ``w`` as a new float32 array of shape ``w.shape``."""
    fmt = _format_of(w)
    out = np.empty((w.rows, w.cols), np.float32)
    order = fmt.column_order(w.cols)
    natural = None if order is None else np.argsort(order)

    def chunk(s0: int, s1: int, raw: np.ndarray, s: Scales) -> None:
        wbuf = _chunk_weights(fmt, raw, s, w.cols, with_bias=False)
        if s.bias is not None:
            grouped = wbuf.reshape(s1 - s0, -1, fmt.sub)
            np.add(grouped, s.bias[..., None], out=grouped)
        if natural is None:
            out[s0:s1] = wbuf
        else:
            np.take(wbuf, natural, axis=1, out=out[s0:s1])

    _for_chunks(w, fmt, MATMUL_CHUNK_WEIGHTS, chunk)
    return out.reshape(w.shape)


def matvec(w: QTensor, x: np.ndarray) -> np.ndarray:
    """``W @ x`` for one position: x (cols,) float32 -> (rows,) float32."""
    fmt = _format_of(w)
    _check_x(w, x, 1)
    cols = w.cols
    n_sub = cols // fmt.sub if fmt.sub else 0
    n_bias = n_sub if fmt.has_bias else 0
    # One scratch row: [x in layout order | ones per sub-block | x sums per sub-block]
    xx = _layout_x(fmt, x.reshape(1, cols), n_sub + n_bias)[0]
    xp, v = xx[:cols], xx[cols:]
    v[:n_sub] = 1.0
    if n_bias:
        _sub_block_sums(fmt, xp.reshape(1, cols), v[n_sub:].reshape(1, n_bias))
    y = np.empty(w.rows, np.float32)

    def chunk(s0: int, s1: int, raw: np.ndarray, s: Scales) -> None:
        y[s0:s1] = _chunk_matvec(fmt, raw, s, xp, v)

    _for_chunks(w, fmt, MATVEC_CHUNK_WEIGHTS, chunk)
    return y


def matmul(w: QTensor, x: np.ndarray) -> np.ndarray:
    """``x @ W.T`` for a batch of positions: x (T, cols) float32 -> (T, rows) float32."""
    fmt = _format_of(w)
    _check_x(w, x, 2)
    t, cols = x.shape
    if t == 1:
        return matvec(w, x[0]).reshape(1, w.rows)
    y = np.empty((t, w.rows), np.float32)
    if t == 0:
        return y
    with_bias = fmt.has_bias
    n_bias = cols // fmt.sub if with_bias else 0
    xx = _layout_x(fmt, x, n_bias)        # [x in layout order | x sums per sub-block]
    if with_bias:
        _sub_block_sums(fmt, xx[:, :cols], xx[:, cols:])

    def chunk(s0: int, s1: int, raw: np.ndarray, s: Scales) -> None:
        wbuf = _chunk_weights(fmt, raw, s, cols, with_bias)
        yb = thread_scratch().get("y", (s1 - s0, t), np.float32)
        for p0 in range(0, t, GEMM_POSITIONS):
            p1 = min(p0 + GEMM_POSITIONS, t)
            # W @ X.T rather than X @ W.T: same products, and OpenBLAS's faster path here.
            np.matmul(wbuf, xx[p0:p1].T, out=yb[:, p0:p1])
        y[:, s0:s1] = yb.T

    _for_chunks(w, fmt, MATMUL_CHUNK_WEIGHTS, chunk)
    return y
