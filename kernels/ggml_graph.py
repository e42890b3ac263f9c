"""Descriptions as ggml graphs: the builder a block is traced with, and the graphs of a net's decode steps.

:class:`GgmlBuilder` implements :class:`colibri_aio.arch.graph.Builder` by
adding nodes to a ggml graph: a family's description of its block, traced
once, becomes a graph that runs at every decode step. It knows operations
(products, RMSNorm, RoPE, attention over a KV cache, routing, experts over a
stack of matrices), not families.

Every leaf is pointed at its memory once, when the graph is built: the
trunk's arrays (resident for the net's life; a repacked matrix's copy), the
KV cache's arrays, and buffers of :class:`DecodeGraphs` that change in place
from step to step (the position, each cache's slot and mask, the residual
stream between graphs). Graphs of one net share one arena for their
intermediates: they run one after another. Only the experts graph is
re-pointed at every call, at the slots the experts were read into.

Numerics are llama.cpp's products: activations rounded to the weight type's
partner before each product; ggml's norms, RoPE and softmax. Attention runs in
float32 over the cache's keys and values (an f16 cache is widened in the graph
by ``ggml_get_rows``, a whole row at a time, as the per-operation path and
prefill widen it), so a position gives nearly the same logits decoded alone or
within a prefill and greedy replies do not change with KV reuse.
``COLIBRI_GGML_ATTENTION=f16`` attends as llama.cpp's flash attention does over
an f16 cache (queries rounded to f16, values summed in f16): its logits bit
for bit on the Q8_0 and F32 fixtures, but a last prompt token decoded alone
then moves by ~1e-2. Within this backend the result depends only on the
token ids: the same graphs run whatever the placement, the context size
(masked keys are skipped, never summed) or the order the experts arrive in.

Every graph also sums what a non-finite value would show in (each quantised
product's input, q, k, v, the heads' output): rounding to 8 bits and flash
attention's online softmax can both give finite numbers from broken weights,
so the caller checks that sum and lets the per-operation pass name the place.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

import ggml.ggml as G

from colibri_aio.kernels.ggml_cpu import GgmlKernels, Graph, Mat, aligned_buffer, split_stacks
from colibri_aio.kernels.ops import MIN_WEIGHT_SUM, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, Routing, attention_temperature
from colibri_aio.kernels.qtensor import QTensor

if TYPE_CHECKING:
    from colibri_aio.arch.graph import RopeParams
    from colibri_aio.arch.kvcache import KVCache

__all__ = ["CONTEXT_BUCKET", "STEP_SCRATCH", "BatchInputs", "DecodeGraphs", "ExpertsShape", "GgmlBuilder", "Node", "Row",
           "SpanInputs", "StepInputs"]

CONTEXT_BUCKET = 256        # attention graphs are built for the context rounded up to this many keys
# The most bytes a one-graph step's intermediates may take (every block keeps its float32 copy of the KV cache in
# one graph, where the per-block graphs share one arena): beyond it, at long contexts, steps run block by block.
STEP_SCRATCH = 256 << 20
_MASK_ROWS = max(1, int(getattr(G, "GGML_KQ_MASK_PAD", 1)))  # flash attention wants the mask this tall
_F32, _F16, _I32, _I64 = G.GGML_TYPE_F32, G.GGML_TYPE_F16, G.GGML_TYPE_I32, G.GGML_TYPE_I64
_GID = {np.dtype(np.float32): _F32, np.dtype(np.float16): _F16, np.dtype(np.int32): _I32, np.dtype(np.int64): _I64}
_NODES = 8192                # capacity of a per-block graph; a step graph gets more


class Node:
    """A value of a traced description: a ggml tensor and its shape in NumPy order (positions first)."""

    __slots__ = ("t", "shape")

    def __init__(self, t: Any, shape: tuple[int, ...]) -> None:
        self.t, self.shape = t, shape


class BatchInputs:
    """What changes from step to step for a step of one or more rows together, in buffers the graphs read in
    place: each row's position (RoPE) and query temperature. A row's cache slot and masks are its own
    :class:`StepInputs`."""

    def __init__(self, n_rows: int) -> None:
        self.pos32 = np.zeros(n_rows, np.int32)
        self._temperatures: dict[tuple[int, float], np.ndarray] = {}  # (floor_scale, scale) -> (rows,) f32

    def begin(self, positions: Sequence[int]) -> None:
        self.pos32[:] = positions
        for (floor_scale, scale), t in self._temperatures.items():
            t[:] = attention_temperature(self.pos32, floor_scale, scale)

    def temperature(self, floor_scale: int, scale: float) -> np.ndarray:
        """The buffer holding this step's query temperatures (llama4's NoPE layers)."""
        key = (floor_scale, scale)
        if key not in self._temperatures:
            self._temperatures[key] = attention_temperature(self.pos32, floor_scale, scale)
        return self._temperatures[key]


class StepInputs(BatchInputs):
    """What changes from one decode step of one sequence to the next: besides its position and temperature,
    the slot each cache writes it to, and each cache's mask of the keys it may see."""

    def __init__(self) -> None:
        super().__init__(1)
        self.position = 0
        self._slots: dict[int, np.ndarray] = {}          # ring size (0: a whole-context cache) -> (1,) int64
        self._masks: dict[tuple[int, int, bool], np.ndarray] = {}  # (ring size or 0, keys, chunked) -> (rows, keys)

    def begin(self, position: int) -> None:  # type: ignore[override]
        self.position = position
        super().begin([position])
        for size, slot in self._slots.items():
            slot[0] = position % size if size else position
        for key, mask in self._masks.items():
            self._fill(key, mask)

    def slot(self, ring: int) -> np.ndarray:
        """The buffer holding this step's slot in a cache of ``ring`` positions (0: the whole context)."""
        if ring not in self._slots:
            self._slots[ring] = np.array([self.position % ring if ring else self.position], np.int64)
        return self._slots[ring]

    def mask(self, ring: int, n_kv: int, chunked: bool = False) -> np.ndarray:
        """The mask over ``n_kv`` keys of a cache of ``ring`` positions (0: the whole context, keys up to the
        position visible; a ring: the slots holding a position of the window, 0 .. position; ``chunked``:
        of the position's chunk of ``ring`` positions)."""
        key = (ring, n_kv, chunked)
        if key not in self._masks:
            self._masks[key] = np.full((_MASK_ROWS, n_kv), -np.inf, np.float16)
            self._fill(key, self._masks[key])
        return self._masks[key]

    def _fill(self, key: tuple[int, int, bool], mask: np.ndarray) -> None:
        ring, n_kv, chunked = key
        p = self.position
        if ring:   # slot j holds position p - ((p - j) mod ring): seen when it is not before the first
            held = p - (p - np.arange(n_kv)) % ring
            mask[0] = np.where(held >= (p // ring * ring if chunked else 0), 0.0, -np.inf)
        else:
            mask[0, :p + 1] = 0
            mask[0, p + 1:] = -np.inf


class SpanInputs(BatchInputs):
    """What the graphs of a span read: ``n`` consecutive positions of one sequence run together (a prompt's
    chunk). Each position is its row's (RoPE); in a whole-context cache its slot is its position and each
    row's query sees the keys up to its own (causal). A sliding-window (or chunked) ring is attended as the
    keys it held before the span followed by the span's own, then given the span's last keys
    (:meth:`ring_slots`, :meth:`ring_mask`), so a span may run past the window."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.start = 0
        self._slots = np.zeros(n, np.int64)
        self._masks: dict[int, np.ndarray] = {}        # keys -> (rows padded, keys) f16
        self._ring_slots: dict[int, np.ndarray] = {}   # ring size -> (min(n, ring),) int64
        self._ring_masks: dict[tuple[int, bool], np.ndarray] = {}  # (ring size, chunked) -> (rows, ring + n) f16

    def begin(self, start: int) -> None:  # type: ignore[override]
        self.start = start
        super().begin(range(start, start + len(self.pos32)))
        self._slots[:] = self.pos32
        for n_kv, mask in self._masks.items():
            self._fill(n_kv, mask)
        for ring, slots in self._ring_slots.items():
            slots[:] = self.pos32[len(self.pos32) - len(slots):] % ring
        for (ring, chunked), mask in self._ring_masks.items():
            self._fill_ring(ring, chunked, mask)

    def _rows(self) -> int:
        return -(-len(self.pos32) // _MASK_ROWS) * _MASK_ROWS   # queries padded to what flash attention wants

    def slot(self, ring: int) -> np.ndarray:
        """The slots the span's keys go to in a whole-context cache: their positions."""
        return self._slots

    def mask(self, ring: int, n_kv: int, chunked: bool = False) -> np.ndarray:
        """The causal mask over the first ``n_kv`` keys of a whole-context cache, one row per position."""
        if n_kv not in self._masks:
            self._masks[n_kv] = np.zeros((self._rows(), n_kv), np.float16)
            self._fill(n_kv, self._masks[n_kv])
        return self._masks[n_kv]

    def _fill(self, n_kv: int, mask: np.ndarray) -> None:
        n = len(self.pos32)
        mask[:n] = np.where(np.arange(n_kv)[None, :] <= self.pos32[:, None], 0.0, -np.inf)

    def ring_slots(self, ring: int) -> np.ndarray:
        """The ring slots the span's last min(n, ring) positions go to, after the span has read the ring
        (the earlier ones of a longer span no later position of the window needs)."""
        if ring not in self._ring_slots:
            n = len(self.pos32)
            self._ring_slots[ring] = (self.pos32[n - min(n, ring):] % ring).astype(np.int64)
        return self._ring_slots[ring]

    def ring_mask(self, ring: int, chunked: bool) -> np.ndarray:
        """The mask over the ring's ``ring`` slots as they were before the span, then the span's n keys:
        slot j held the last position before the span that it stores, (start - 1) - ((start - 1 - j) mod ring),
        none when that is negative; a query at p sees a key at p' when p - ring < p' <= p (a window of
        ``ring`` positions), and with ``chunked`` when p' is in p's chunk of ``ring`` positions."""
        key = (ring, chunked)
        if key not in self._ring_masks:
            self._ring_masks[key] = np.zeros((self._rows(), ring + len(self.pos32)), np.float16)
            self._fill_ring(ring, chunked, self._ring_masks[key])
        return self._ring_masks[key]

    def _fill_ring(self, ring: int, chunked: bool, mask: np.ndarray) -> None:
        last = self.start - 1
        held = last - (last - np.arange(ring)) % ring                         # (ring,) -1.. when never written
        keys = np.concatenate([np.where(held >= 0, held, np.iinfo(np.int64).min // 2), self.pos32])
        p = self.pos32[:, None].astype(np.int64)
        seen = (keys[None, :] <= p) & (keys[None, :] > p - ring)
        if chunked:
            seen &= keys[None, :] >= p // ring * ring
        mask[:len(self.pos32)] = np.where(seen, 0.0, -np.inf)


@dataclass(slots=True, eq=False)
class Row:
    """One sequence of a decode step (or a span of one: :class:`SpanInputs`): its KV cache, its step inputs
    and the keys a whole-context cache's attention reads (its context bucket)."""

    cache: KVCache
    inputs: StepInputs | SpanInputs
    n_kv: int
    # a span's keys and values for its rings, per (block, "k" or "v"), until it has run whole (commit_span)
    staged: dict[tuple[int, str], np.ndarray] = field(default_factory=dict)


def _ne(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """ggml's (ne0, ne1, ne2) of a NumPy shape of at most three axes."""
    if len(shape) > 3:
        raise ValueError(f"graphs take at most three axes, not {shape}")
    ne = tuple(reversed(shape)) + (1,) * (3 - len(shape))
    return ne  # type: ignore[return-value]


class GgmlBuilder:
    """Adds each operation of a description to one ggml graph (:class:`~colibri_aio.arch.graph.Builder`).

    ``rows``: the sequences of the step, one value row each (T = len(rows)): each one's KV cache (written in
    place by ``ggml_set_rows``), changing buffers and context bucket; ``batch``: the positions of several
    rows (None for one). Several rows give each row the bits it has alone: attention and the recurrent
    state are per row, products over all rows only for the weights whose multi-row products carry each
    row's single-row bits (:meth:`GgmlKernels.rows_alike`; the others are one product per row), and every
    other operation is row by row in ggml.
    """

    def __init__(self, kernels: GgmlKernels, graph: Graph, rows: Sequence[Row], rope: RopeParams,
                 eps: float, f16_attention: bool = False, batch: BatchInputs | None = None,
                 n_rows: int | None = None, rows_together: bool = False) -> None:
        """``n_rows`` without ``rows``: a graph of that many rows that reads no sequence's cache or position
        (an FFN, the head); ``rows_together``: its products take all rows at once whatever their type (the
        positions of one span, which owe no row the bits it has alone)."""
        if len(rows) > 1 and batch is None:
            raise ValueError("a graph of several rows needs their positions (batch)")
        self.kernels, self.graph, self.ctx = kernels, graph, graph.ctx
        self.rows, self.batch = list(rows), batch
        self.n_rows = len(self.rows) if n_rows is None else n_rows
        self.rows_together = rows_together
        if self.rows:
            self.inputs, self.cache, self.n_kv = rows[0].inputs, rows[0].cache, rows[0].n_kv
        self.rope_params, self.eps = rope, eps
        self.f16_attention = f16_attention
        self.checks: list[Any] = []          # sums whose total is finite when nothing broke
        self.weight_bytes = 0                # bytes of the weights the graph multiplies by (its thread count)
        self.fused_products = 0              # products made one over adjacent matrices (linears)
        self._leaves: dict[tuple, Any] = {}
        self._keep: list[np.ndarray] = []    # copies leaves point at (made contiguous, float32)

    # --- leaves ---

    def leaf(self, x: Any) -> Any:
        """The ggml tensor of ``x``: a node's own, or a leaf over a block tensor's memory (made once)."""
        if isinstance(x, Node):
            return x.t
        if isinstance(x, QTensor):
            key = ("q", x.data.ctypes.data, x.shape, x.ggml_type)
            if key not in self._leaves:
                self._leaves[key] = self.weight(self.kernels.mat(x), self.kernels.address(x.data))
            return self._leaves[key]
        a = np.asarray(x)
        key = ("a", a.ctypes.data, a.shape, a.strides, a.dtype.str)
        if key not in self._leaves:
            if a.dtype not in _GID:
                a = a.astype(np.float32)
            if not a.flags.c_contiguous:
                a = np.ascontiguousarray(a)
            if a.ctypes.data != key[1]:
                self._keep.append(a)
            self._leaves[key] = self.over(a)
        return self._leaves[key]

    def over(self, a: np.ndarray) -> Any:
        """A leaf over the C-contiguous array ``a``'s memory (a buffer that changes in place, or a tensor)."""
        t = self.graph.leaf(_GID[a.dtype], *_ne(a.shape))
        t.contents.data = a.ctypes.data
        return t

    def weight(self, m: Mat, address: int) -> Any:
        t = self.graph.weight(m)
        t.contents.data = address
        self.weight_bytes += m.nbytes
        return t

    def input(self, buffer: np.ndarray) -> Node:
        """A value read from ``buffer`` (positions first) at every run."""
        return Node(self.over(buffer), buffer.shape)

    def node(self, x: Any) -> Node:
        if isinstance(x, Node):
            return x
        a = x.data if isinstance(x, QTensor) else np.asarray(x)
        return Node(self.leaf(x), tuple(x.shape) if isinstance(x, QTensor) else a.shape)

    def _contiguous(self, t: Any) -> Any:
        return t if G.ggml_is_contiguous(t) else G.ggml_cont(self.ctx, t)

    def _check(self, t: Any) -> None:
        self.checks.append(G.ggml_sum(self.ctx, t))

    def check_total(self) -> Node:
        """One value, finite when every sum the operations kept is: the graph's check."""
        total = self.checks[0]
        for t in self.checks[1:]:
            total = G.ggml_add(self.ctx, total, t)
        return Node(total, (1,))

    # --- the Builder operations ---

    def linear(self, w: Any, x: Any) -> Node:
        return self.linears([w], x)[0]

    def linears(self, ws: Sequence[Any], x: Any) -> list[Node]:
        """Products on one input; quantised matrices whose bytes follow each other with one type (a block's
        q, k and v as a GGUF stores them) are one product over their rows together, as the per-operation
        backend runs them."""
        xn = self.node(x)
        t = xn.shape[0]
        k, runs = self.kernels, []
        for w in ws:
            if isinstance(w, QTensor):
                m, at = k.mat(w), k.address(w.data)
                last = runs[-1] if runs else None
                if last is not None and last[0] is not None and (last[0].gid, last[0].packed) == (m.gid, m.packed) \
                        and last[1] + last[2] == at and last[0].cols == m.cols:
                    runs[-1] = (Mat(m.gid, last[0].rows + m.rows, m.cols, m.packed), last[1], last[2] + w.nbytes,
                                last[3] + [m.rows])
                    continue
                runs.append((m, at, w.nbytes, [m.rows]))
            else:
                runs.append((None, w, 0, [np.asarray(w).shape[0]]))
        if any(m is not None for m, *_ in runs):
            self._check(xn.t)             # rounded to the weight type's partner before the product
        out = []
        for m, at, _, rows in runs:
            wt = self.leaf(at) if m is None else self.weight(m, at)
            y = self._product(wt, xn.t, t, m)
            if len(rows) == 1:
                out.append(Node(y, (t, rows[0])))
                continue
            self.fused_products += 1
            nb1, start = y.contents.nb[1], 0
            for r in rows:
                view = G.ggml_view_2d(self.ctx, y, r, t, nb1, 4 * start)
                out.append(Node(view if t == 1 else G.ggml_cont(self.ctx, view), (t, r)))
                start += r
        return out

    def _product(self, wt: Any, x: Any, t: int, m: Mat | None) -> Any:
        """``ggml_mul_mat(wt, x)`` of x's t rows (ggml's axis 1); of several rows of a step, one product per row
        where a product over all of them would not give each row its bits alone (``m``: None for a float
        matrix)."""
        if self.n_rows == 1 or t == 1 or self.rows_together or (m is not None and self.kernels.rows_alike(m)):
            return G.ggml_mul_mat(self.ctx, wt, x)
        return self._stack_rows([G.ggml_mul_mat(self.ctx, wt, self._contiguous(row))
                                 for row in self._row_views(x, t, 1)], 1)

    def _row_views(self, x: Any, t: int, axis: int) -> list[Any]:
        """Each of the t rows of x along ggml's ``axis`` (1 or 2) as a view of its own."""
        x = self._contiguous(x)
        c = x.contents
        if axis == 1:
            return [G.ggml_view_3d(self.ctx, x, c.ne[0], 1, c.ne[2], c.nb[1], c.nb[2], i * c.nb[1]) for i in range(t)]
        return [G.ggml_view_3d(self.ctx, x, c.ne[0], c.ne[1], 1, c.nb[1], c.nb[2], i * c.nb[2]) for i in range(t)]

    def _stack_rows(self, rows: Sequence[Any], axis: int) -> Any:
        """Views of one row each side by side again along ggml's ``axis``."""
        acc = self._contiguous(rows[0])
        for r in rows[1:]:
            acc = G.ggml_concat(self.ctx, acc, self._contiguous(r), axis)
        return acc

    def _binary(self, op: Callable, a: Any, b: Any) -> Node:
        an, bn = self.node(a), self.node(b)
        shape = np.broadcast_shapes(an.shape, bn.shape)
        if an.shape != shape:             # ggml repeats the second operand; both operations commute
            an, bn = bn, an
        return Node(op(self.ctx, an.t, bn.t), shape)

    def add(self, a: Any, b: Any) -> Node:
        return self._binary(G.ggml_add, a, b)

    def mul(self, a: Any, b: Any) -> Node:
        return self._binary(G.ggml_mul, a, b)

    def rms_norm(self, x: Any, weight: Any) -> Node:
        xn = self.node(x)
        return self.mul(Node(G.ggml_rms_norm(self.ctx, xn.t, self.eps), xn.shape), weight)

    def heads(self, x: Any, n: int, width: int) -> Node:
        xn = self.node(x)
        return Node(G.ggml_reshape_3d(self.ctx, self._contiguous(xn.t), width, n, xn.shape[0]), (xn.shape[0], n, width))

    def flat(self, x: Any) -> Node:
        xn = self.node(x)
        t, n, width = xn.shape
        return Node(G.ggml_reshape_2d(self.ctx, self._contiguous(xn.t), n * width, t), (t, n * width))

    def split(self, x: Any, sizes: Sequence[int]) -> list[Node]:
        xn = self.node(x)
        c = xn.t.contents
        ne = _ne(xn.shape)
        out, start = [], 0
        for size in sizes:
            view = G.ggml_view_3d(self.ctx, xn.t, size, ne[1], ne[2], c.nb[1], c.nb[2], start * c.nb[0])
            out.append(Node(G.ggml_cont(self.ctx, view), (*xn.shape[:-1], size)))
            start += size
        return out

    def concat(self, a: Any, b: Any) -> Node:
        an, bn = self.node(a), self.node(b)
        return Node(G.ggml_concat(self.ctx, an.t, bn.t, 0), (*an.shape[:-1], an.shape[-1] + bn.shape[-1]))

    def rope(self, x: Any, neox: bool) -> Node:
        xn, p = self.node(x), self.rope_params
        mode = G.GGML_ROPE_TYPE_NEOX if neox else G.GGML_ROPE_TYPE_NORMAL
        factors = None if p.freq_factors is None else self._freq_factors(p.freq_factors)
        t = G.ggml_rope_ext(self.ctx, self._contiguous(xn.t), self._positions(), factors, p.n_rot, mode, p.n_ctx_orig,
                            p.freq_base, p.freq_scale, p.ext_factor, p.attn_factor, p.beta_fast, p.beta_slow)
        return Node(t, xn.shape)

    def head_products(self, m: Any, x: Any) -> Node:
        xn = self.node(x)
        t, h, _ = xn.shape
        mat = None
        if isinstance(m, QTensor):   # the file's bytes, (H * b) rows of a: a 3-D view (a, b, H) of one leaf
            heads, rows, cols = m.shape
            flat = QTensor(m.data, m.ggml_type, (heads * rows, cols))
            mt, mat = G.ggml_reshape_3d(self.ctx, self.leaf(flat), cols, rows, heads), self.kernels.mat(flat)
        else:
            mt, rows = self.leaf(m), np.asarray(m).shape[1]
        xp = G.ggml_cont(self.ctx, G.ggml_permute(self.ctx, xn.t, 0, 2, 1, 3))          # (a, T, H)
        y = self._product(mt, xp, t, mat)                                                # (b, T, H)
        return Node(G.ggml_cont(self.ctx, G.ggml_permute(self.ctx, y, 0, 2, 1, 3)), (t, h, rows))

    def attend(self, layer: int, q: Any, k: Any, v: Any | None, *, scale: float | None = None,
               sinks: Any | None = None) -> Node:
        qn, kn = self.node(q), self.node(k)
        vn = None if v is None else self.node(v)
        if len(self.rows) == 1:
            return self._attend_row(self.rows[0], layer, qn, kn, vn, scale, sinks)
        t = qn.shape[0]          # one query per row, each over its own sequence's cache
        picks = [self._row_views(n.t, t, 2) if n is not None else [None] * t for n in (qn, kn, vn)]
        outs = [self._attend_row(row, layer, Node(qr, (1, *qn.shape[1:])), Node(kr, (1, *kn.shape[1:])),
                                 None if vr is None else Node(vr, (1, *vn.shape[1:])),  # type: ignore[union-attr]
                                 scale, sinks)
                for row, qr, kr, vr in zip(self.rows, *picks)]
        return Node(self._stack_rows([o.t for o in outs], 1), (t, outs[0].shape[1]))

    def _attend_row(self, row: Row, layer: int, qn: Node, kn: Node, vn: Node | None, scale: float | None,
                    sinks: Any | None) -> Node:
        """One sequence's attention: its rows' keys and values into its cache, its queries over the cache."""
        cache, ctx = row.cache, self.ctx
        keys, values = cache.k[layer], cache.v[layer]
        held, heads_kv, dk = keys.shape
        dv = values.shape[2]
        t, heads = qn.shape[0], qn.shape[1]
        ring = held if cache.is_ring(layer) else 0
        if ring and isinstance(row.inputs, SpanInputs) and vn is not None:
            return self._attend_span_ring(row, layer, qn, kn, vn, scale, sinks)
        n_kv = held if ring else row.n_kv
        gid, item = _GID[keys.dtype], keys.dtype.itemsize
        slot = self.over(row.inputs.slot(ring))
        # the position's key and value into the cache, before any node reads the cache (graph order)
        rows = self.graph.leaf(gid, heads_kv * dk, held)
        rows.contents.data = keys.ctypes.data
        self._effect(G.ggml_set_rows(ctx, rows, G.ggml_reshape_2d(ctx, self._contiguous(kn.t), heads_kv * dk, t), slot))
        checked = [qn.t, kn.t]
        if vn is not None:
            v_rows = self.graph.leaf(gid, heads_kv * dv, held)
            v_rows.contents.data = values.ctypes.data
            self._effect(G.ggml_set_rows(ctx, v_rows, G.ggml_reshape_2d(ctx, self._contiguous(vn.t), heads_kv * dv, t),
                                         slot))
            checked.append(vn.t)
        k_all = self._strided(gid, dk, n_kv, heads_kv, heads_kv * dk * item, keys.ctypes.data)
        widen = gid != _F32 and not self.f16_attention
        if vn is None:                    # the values are each key's first dv numbers (MLA's latent)
            if widen:
                k_all = self._widened(k_all, n_kv, heads_kv)
            c = k_all.contents
            v_all = G.ggml_view_3d(ctx, k_all, dv, n_kv, heads_kv, c.nb[1], c.nb[2], 0)
        else:
            v_all = self._strided(gid, dv, n_kv, heads_kv, heads_kv * dv * item, values.ctypes.data)
            if widen:
                k_all, v_all = self._widened(k_all, n_kv, heads_kv), self._widened(v_all, n_kv, heads_kv)
        mask = self.over(row.inputs.mask(ring, n_kv, cache.chunked[layer]))
        att = G.ggml_flash_attn_ext(ctx, G.ggml_permute(ctx, qn.t, 0, 2, 1, 3), k_all, v_all, mask,
                                    1.0 / math.sqrt(dk) if scale is None else scale, 0.0, 0.0)
        G.ggml_flash_attn_ext_set_prec(att, G.GGML_PREC_F32)
        if sinks is not None:
            G.ggml_flash_attn_ext_add_sinks(att, self.leaf(sinks))
        out = G.ggml_reshape_2d(ctx, att, dv * heads, t)
        for c in (*checked, out):
            self._check(c)
        return Node(out, (t, heads * dv))

    def _attend_span_ring(self, row: Row, layer: int, qn: Node, kn: Node, vn: Node, scale: float | None,
                          sinks: Any | None) -> Node:
        """A span's attention in a sliding-window (or chunked) ring of block ``layer``: its queries over the
        keys and values the ring held before the span followed by the span's own (float32, the ring widened),
        masked by position (:meth:`SpanInputs.ring_mask`). Its last keys and values are staged, rounded as
        the ring stores them, and go into the ring once the whole span has run (:meth:`DecodeGraphs.
        commit_span`): a span given up (a non-finite value) leaves the ring as it was, so the per-operation
        pass that runs it again finds the keys before it."""
        cache, ctx, inputs = row.cache, self.ctx, row.inputs
        keys, values = cache.k[layer], cache.v[layer]
        ring, heads_kv, dk = keys.shape
        dv = values.shape[2]
        t, heads = qn.shape[0], qn.shape[1]
        gid, item = _GID[keys.dtype], keys.dtype.itemsize

        def with_span(array: np.ndarray, width: int, fresh: Node) -> Any:     # (width, ring + t, heads) f32
            old = self._strided(gid, width, ring, heads_kv, heads_kv * width * item, array.ctypes.data)
            old = self._widened(old, ring, heads_kv) if gid != _F32 else G.ggml_cont(ctx, old)
            new = G.ggml_cont(ctx, G.ggml_permute(ctx, self._contiguous(fresh.t), 0, 2, 1, 3))
            if gid != _F32:   # the span's own keys as the cache stores them, as every other read sees them
                new = G.ggml_cast(ctx, G.ggml_cast(ctx, new, gid), _F32)
            return G.ggml_concat(ctx, old, new, 1)

        mask = self.over(inputs.ring_mask(ring, cache.chunked[layer]))  # type: ignore[union-attr]
        att = G.ggml_flash_attn_ext(ctx, G.ggml_permute(ctx, qn.t, 0, 2, 1, 3), with_span(keys, dk, kn),
                                    with_span(values, dv, vn), mask, 1.0 / math.sqrt(dk) if scale is None else scale,
                                    0.0, 0.0)
        G.ggml_flash_attn_ext_set_prec(att, G.GGML_PREC_F32)
        if sinks is not None:
            G.ggml_flash_attn_ext_add_sinks(att, self.leaf(sinks))
        out = G.ggml_reshape_2d(ctx, att, dv * heads, t)
        kept = len(inputs.ring_slots(ring))  # type: ignore[union-attr]
        order = np.arange(kept, dtype=np.int64)
        self._keep.append(order)
        for name, width, fresh in (("k", dk, kn), ("v", dv, vn)):
            staged = row.staged[(layer, name)] = np.empty((kept, heads_kv * width), keys.dtype)
            self._keep.append(staged)
            flat = G.ggml_reshape_2d(ctx, self._contiguous(fresh.t), heads_kv * width, t)
            last = G.ggml_view_2d(ctx, flat, heads_kv * width, kept, flat.contents.nb[1],
                                  (t - kept) * flat.contents.nb[1])
            self._effect(G.ggml_set_rows(ctx, self.over(staged), last, self.over(order)))
        for c in (qn.t, kn.t, vn.t, out):
            self._check(c)
        return Node(out, (t, heads * dv))

    def swiglu(self, gate: Any, up: Any) -> Node:
        gn = self.node(gate)
        return Node(G.ggml_swiglu_split(self.ctx, gn.t, self.leaf(up)), gn.shape)

    def sigmoid(self, x: Any) -> Node:
        xn = self.node(x)
        return Node(G.ggml_sigmoid(self.ctx, xn.t), xn.shape)

    def temperature(self, x: Any, floor_scale: int, scale: float) -> Node:
        xn = self.node(x)
        inputs = self.batch if self.batch is not None else self.inputs
        temperature = inputs.temperature(floor_scale, scale)                    # (T,): one per row
        return Node(G.ggml_mul(self.ctx, xn.t, self.over(temperature.reshape(-1, 1, 1))), xn.shape)

    def silu(self, x: Any) -> Node:
        xn = self.node(x)
        return Node(G.ggml_silu(self.ctx, xn.t), xn.shape)

    def softplus(self, x: Any) -> Node:
        xn = self.node(x)
        return Node(G.ggml_softplus(self.ctx, self._contiguous(xn.t)), xn.shape)

    def l2_norm(self, x: Any) -> Node:
        """llama.cpp's form: RMSNorm with eps/n, times 1/sqrt(n)."""
        xn = self.node(x)
        n = xn.shape[-1]
        normed = G.ggml_rms_norm(self.ctx, self._contiguous(xn.t), self.eps / n)
        return Node(G.ggml_scale(self.ctx, normed, 1.0 / math.sqrt(n)), xn.shape)

    def repeat_heads(self, x: Any, times: int) -> Node:
        xn = self.node(x)
        t, n, d = xn.shape
        one = G.ggml_reshape_4d(self.ctx, self._contiguous(xn.t), d, 1, n, t)
        wide = G.ggml_repeat_4d(self.ctx, one, d, times, n, t)
        return Node(G.ggml_reshape_3d(self.ctx, wide, d, n * times, t), (t, n * times, d))

    def causal_conv(self, layer: int, x: Any, weight: Any) -> Node:
        """ggml_ssm_conv over the state's K-1 inputs and this call's; the window's last K-1 inputs are
        written to the state the step leaves (:meth:`KVCache.commit` makes it the sequence's)."""
        if len(self.rows) > 1:
            raise NotImplementedError("a recurrent state of several sequences in one graph")
        ctx, cache = self.ctx, self.cache
        xn = self.node(x)
        t, channels = xn.shape
        width = cache.conv[layer].shape[1]
        state = self.over(cache.conv[layer])                                        # (K-1, C)
        window = G.ggml_concat(ctx, state, G.ggml_cont(ctx, G.ggml_transpose(ctx, xn.t)), 0)  # (K-1+T, C)
        c = window.contents
        last = G.ggml_view_2d(ctx, window, width, channels, c.nb[1], t * c.nb[0])
        self._effect(G.ggml_cpy(ctx, last, self.over(cache.conv_next[layer])))
        out = G.ggml_ssm_conv(ctx, G.ggml_reshape_3d(ctx, window, width + t, channels, 1), self.leaf(weight))
        return Node(G.ggml_reshape_2d(ctx, out, channels, t), (t, channels))

    def delta_net(self, layer: int, q: Any, k: Any, v: Any, g: Any, beta: Any) -> Node:
        """ggml_gated_delta_net from the layer's state; the state it ends with is written to the state the
        step leaves."""
        if len(self.rows) > 1:
            raise NotImplementedError("a recurrent state of several sequences in one graph")
        ctx, cache = self.ctx, self.cache
        qn, kn, vn, gn, bn = (self.node(a) for a in (q, k, v, g, beta))
        t, heads, dk = qn.shape
        dv = vn.shape[2]

        def four(node: Node, *ne: int) -> Any:
            return G.ggml_reshape_4d(ctx, self._contiguous(node.t), *ne)

        state = G.ggml_reshape_4d(ctx, self.over(cache.ssm[layer]), dv, dv, heads, 1)
        result = G.ggml_gated_delta_net(ctx, four(qn, dk, heads, t, 1), four(kn, dk, heads, t, 1),
                                        four(vn, dv, heads, t, 1), four(gn, 1, heads, t, 1),
                                        four(bn, 1, heads, t, 1), state, 1)
        out = G.ggml_view_1d(ctx, result, dv * heads * t, 0)
        new_state = G.ggml_view_1d(ctx, result, dv * dv * heads, dv * heads * t * 4)
        self._effect(G.ggml_cpy(ctx, new_state, G.ggml_reshape_1d(ctx, self.over(cache.ssm_next[layer]),
                                                                  dv * dv * heads)))
        out = G.ggml_reshape_3d(ctx, G.ggml_cont(ctx, out), dv, heads, t)
        self._check(out)
        return Node(out, (t, heads, dv))

    def _freq_factors(self, factors: tuple[float, ...]) -> Any:
        key = ("freq_factors", factors)
        if key not in self._leaves:
            a = np.asarray(factors, np.float32)
            self._keep.append(a)
            self._leaves[key] = self.over(a)
        return self._leaves[key]

    # --- what the decode driver adds: routing, experts, the order of effects ---

    def route(self, logits: Node, used: int, routing: Routing, bias: np.ndarray | None) -> tuple[Node, Node, Node]:
        """llama.cpp's ``build_moe_ffn`` selection of each row (as :func:`colibri_aio.kernels.ops.route`):
        the experts in descending selection score (T, E) int32, the first ``used`` of them (a view), their
        weights (T, used). Every operation is row by row: a row's choice is the one it makes alone."""
        ctx, (t, experts) = self.ctx, logits.shape
        if routing.gating == "softmax":
            probs = G.ggml_soft_max(ctx, logits.t)
        elif routing.gating == "sigmoid":
            probs = G.ggml_sigmoid(ctx, logits.t)
        else:
            probs = logits.t
        selection = probs if bias is None else G.ggml_add(ctx, probs, self.leaf(bias))
        if routing.group_count > 1:
            selection = self._limit_groups(selection, experts, t, routing)
        order = G.ggml_argsort(ctx, selection, G.GGML_SORT_ORDER_DESC)                # (E, T)
        top = G.ggml_view_2d(ctx, order, used, t, order.contents.nb[1], 0)
        w = G.ggml_reshape_2d(ctx, G.ggml_get_rows(ctx, G.ggml_reshape_3d(ctx, probs, 1, experts, t), top), used, t)
        if routing.gating == "softmax_weight":
            w = G.ggml_soft_max(ctx, w)
        if routing.normalize:
            w = G.ggml_div(ctx, w, G.ggml_clamp(ctx, G.ggml_sum_rows(ctx, w), float(MIN_WEIGHT_SUM), math.inf))
        if routing.scale not in (0.0, 1.0):
            w = G.ggml_scale(ctx, w, routing.scale)
        if w.contents.view_src:          # an output must be a node that writes its own memory
            w = G.ggml_cont(ctx, w)
        self._check(w)
        return Node(order, (t, experts)), Node(top, (t, used)), Node(w, (t, used))

    def _limit_groups(self, selection: Any, experts: int, t: int, routing: Routing) -> Any:
        """Selection with the experts outside the ``group_used`` best groups (by the sum of their two best
        selection values) at -inf, row by row. Groups tied with the last one kept are kept too (the NumPy
        reference keeps the lower-numbered one of exact ties)."""
        ctx, n, per = self.ctx, routing.group_count, experts // routing.group_count
        groups = G.ggml_reshape_3d(ctx, selection, per, n, t)
        best2 = G.ggml_argsort_top_k(ctx, groups, 2)                                     # (2, n, T)
        values = G.ggml_get_rows(ctx, G.ggml_reshape_4d(ctx, groups, 1, per, n, t), best2)  # (1, 2, n, T)
        score = G.ggml_sum_rows(ctx, G.ggml_reshape_3d(ctx, values, 2, n, t))            # (1, n, T)
        score = G.ggml_reshape_2d(ctx, score, n, t)
        ranked = G.ggml_argsort(ctx, score, G.GGML_SORT_ORDER_DESC)                      # (n, T)
        last = G.ggml_view_2d(ctx, ranked, 1, t, ranked.contents.nb[1], 4 * (routing.group_used - 1))
        kth = G.ggml_get_rows(ctx, G.ggml_reshape_3d(ctx, score, 1, n, t), last)         # (1, 1, T)
        kth = G.ggml_reshape_2d(ctx, kth, 1, t)
        dropped = G.ggml_step(ctx, G.ggml_neg(ctx, G.ggml_sub(ctx, score, kth)))          # 1 below the kth
        mask = G.ggml_log(ctx, G.ggml_scale_bias(ctx, dropped, -1.0, 1.0))               # 0 kept, -inf dropped
        mask = G.ggml_repeat(ctx, G.ggml_reshape_3d(ctx, mask, 1, n, t), groups)
        return G.ggml_reshape_2d(ctx, G.ggml_add(ctx, groups, mask), experts, t)

    def experts_in_pool(self, shape: ExpertsShape, h: Node, x2: Node, top: Node, weights: Node, table: np.ndarray,
                        bases: Sequence[int], strides: Sequence[int], biases: Sequence[np.ndarray] | None,
                        shared: Node | None) -> Node:
        """x2 + the chosen experts' weighted outputs in rank order (+ the shared expert's): the next residual
        stream, each expert read from a stack of ``shape.depth`` entries (pool slots, or a mapped tensor's
        experts) whose gate, up and down matrices start at ``bases`` in entry 0, ``strides`` bytes apart; ``table`` (E,) int32: each expert's slot, read as
        the graph runs; ``top``: the chosen experts in rank order."""
        ctx, used, t = self.ctx, shape.used, h.shape[0]
        table_leaf = self.graph.leaf(_I32, 1, len(table))
        table_leaf.contents.data = table.ctypes.data
        # One lookup per (rank, row): the table is one column of E rows, so the (used, t) choices go in as one
        # list (get_rows over a 2-D index wants a table per row).
        chosen = G.ggml_reshape_1d(ctx, G.ggml_cont(ctx, top.t), used * t) if t > 1 else top.t
        slot_ids = G.ggml_reshape_2d(ctx, G.ggml_get_rows(ctx, table_leaf, chosen), used, t)
        mats = ((shape.gate, 2), (shape.down, 1)) if shape.gate_up else ((shape.gate, 1), (shape.gate, 1),
                                                                         (shape.down, 1))
        addrs = (bases[0], bases[2]) if shape.gate_up else bases
        steps = (strides[0], strides[2]) if shape.gate_up else strides
        stacks = []
        for (m, rows), base, stride in zip(mats, addrs, steps):
            st = self.graph.stack(m.gid, m.cols, rows * m.rows, shape.depth, m.packed)
            st.contents.data = base
            self.graph.set_stride(st.contents, stride)
            stacks.append(st)
            self.weight_bytes += used * rows * m.nbytes
        bias_leaves = None if biases is None else [self.leaf(b) for b in biases]
        ys = expert_terms(ctx, replace(shape, each=False) if t > 1 else shape, h.t, slot_ids, top.t, weights.t,
                          stacks, bias_leaves, t)
        return Node(rank_sum(ctx, ys, x2.t, None if shared is None else shared.t), x2.shape)

    def _effect(self, t: Any) -> None:
        G.ggml_build_forward_expand(self.graph.gf, t)

    def _positions(self) -> Any:
        key = ("positions",)
        if key not in self._leaves:
            self._leaves[key] = self.over((self.batch if self.batch is not None else self.inputs).pos32)
        return self._leaves[key]

    def _strided(self, gid: int, width: int, n_kv: int, heads: int, row_bytes: int, address: int) -> Any:
        """A leaf over a (positions, heads, width) cache seen as (width, positions, heads), as attention reads it."""
        t = self.graph.leaf(gid, width, n_kv, heads)
        c = t.contents
        c.nb[1], c.nb[2] = row_bytes, width * G.ggml_type_size(gid)
        c.nb[3] = row_bytes * n_kv
        c.data = address
        return t

    def _widened(self, cache: Any, n_kv: int, heads: int) -> Any:
        """The f16 cache leaf as a float32 copy laid out (width, positions, heads) contiguous: the values of
        ``ggml_cast`` (f16 -> f32 is exact), a whole row at a time (F16C; ~6x faster than element by element)."""
        ctx = self.ctx
        positions = G.ggml_arange(ctx, 0.0, float(n_kv), 1.0)
        index = G.ggml_cast(ctx, G.ggml_repeat_4d(ctx, G.ggml_reshape_2d(ctx, positions, n_kv, 1), n_kv, heads, 1, 1),
                            _I32)                               # (positions, heads): row p of every head
        return G.ggml_get_rows(ctx, cache, index)


@dataclass(frozen=True, slots=True)
class ExpertsShape:
    """What a graph of one block's routed experts depends on: the matrices' types and shapes (gate; down),
    the experts per position, the stack's depth, whether each expert's up matrix follows its gate (one
    product of 2F rows), the activation, per-expert biases, whether a shared expert's output is added,
    and ``each``: one product per expert instead of ``ggml_mul_mat_id`` over a stack."""

    gate: Mat
    down: Mat
    used: int
    depth: int
    gate_up: bool
    activation: str = "swiglu"
    biased: bool = False
    shared: bool = False
    each: bool = False
    n_experts: int = 0        # rows of the bias tensors (the block's expert count), when biased
    weights_first: bool = False   # each rank's weight multiplies its input, not its output (llama4)


def expert_terms(ctx: Any, s: ExpertsShape, h: Any, slot_ids: Any, expert_ids: Any, w: Any, stacks: Sequence[Any],
                 biases: Sequence[Any] | None, t: int = 1) -> list[Any]:
    """Each rank's weighted expert output (D, t) for t rows: w_r * down_r(act(gate_r h + b, up_r h + b)) + b,
    over the stacks by ``ggml_mul_mat_id`` (every (row, rank) cell its own dot products: a row's bits are
    its own alone); or, for one row with ``s.each``, ``stacks`` holding each rank's gate, up and down."""
    if s.each:
        ys = []
        for r in range(s.used):
            wg, wu, wd = stacks[3 * r: 3 * r + 3]
            wr = G.ggml_view_2d(ctx, w, 1, 1, w.contents.nb[1], 4 * r)
            hr = G.ggml_mul(ctx, h, wr) if s.weights_first else h
            gate, up = G.ggml_mul_mat(ctx, wg, hr), G.ggml_mul_mat(ctx, wu, hr)
            expert = G.ggml_view_2d(ctx, expert_ids, 1, 1, expert_ids.contents.nb[1], 4 * r)
            if biases is not None:      # the same addition as the stacked path's, on a stack of one
                gate, up = (G.ggml_add_id(ctx, G.ggml_reshape_3d(ctx, t, s.gate.rows, 1, 1), b, expert)
                            for t, b in ((gate, biases[0]), (up, biases[1])))
            y = G.ggml_mul_mat(ctx, wd, _activation(ctx, s.activation, gate, up))
            if biases is not None:
                y = G.ggml_add_id(ctx, G.ggml_reshape_3d(ctx, y, s.down.rows, 1, 1), biases[2], expert)
            ys.append(G.ggml_reshape_2d(ctx, y if s.weights_first else G.ggml_mul(ctx, y, wr), s.down.rows, 1))
        return ys
    h3 = G.ggml_reshape_3d(ctx, h, s.gate.cols, 1, t)
    if s.weights_first:      # (D, used, t): rank r's input is w_r * h
        h3 = G.ggml_mul(ctx, G.ggml_repeat_4d(ctx, h3, s.gate.cols, s.used, t, 1),
                        G.ggml_reshape_3d(ctx, w, 1, s.used, t))
    if s.gate_up:
        a = G.ggml_swiglu(ctx, G.ggml_mul_mat_id(ctx, stacks[0], h3, slot_ids))
        wd = stacks[1]
    else:
        gate, up = G.ggml_mul_mat_id(ctx, stacks[0], h3, slot_ids), G.ggml_mul_mat_id(ctx, stacks[1], h3, slot_ids)
        if biases is not None:
            gate, up = G.ggml_add_id(ctx, gate, biases[0], expert_ids), G.ggml_add_id(ctx, up, biases[1], expert_ids)
        a = _activation(ctx, s.activation, gate, up)
        wd = stacks[2]
    y = G.ggml_mul_mat_id(ctx, wd, a, slot_ids)                       # (D, used, t)
    if biases is not None:
        y = G.ggml_add_id(ctx, y, biases[2], expert_ids)
    if not s.weights_first:
        y = G.ggml_mul(ctx, y, G.ggml_reshape_3d(ctx, w, 1, s.used, t))
    nb1, nb2 = y.contents.nb[1], y.contents.nb[2]
    return [G.ggml_view_2d(ctx, y, s.down.rows, t, nb2, r * nb1) for r in range(s.used)]


def _activation(ctx: Any, name: str, gate: Any, up: Any) -> Any:
    if name == "swiglu":
        return G.ggml_swiglu_split(ctx, gate, up)
    if name == "swiglu_oai":
        return G.ggml_swiglu_oai(ctx, gate, up, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT)
    raise ValueError(f"unknown expert activation {name!r}")


def rank_sum(ctx: Any, ys: Sequence[Any], x2: Any, shared: Any | None = None) -> Any:
    """x2 + ((y0 + y1) + y2) + ...: the weighted expert outputs summed in rank order, then the shared
    expert's output when there is one, then the residual (the per-operation path's order)."""
    acc = ys[0]
    for y in ys[1:]:
        acc = G.ggml_add(ctx, acc, y)
    if shared is not None:
        acc = G.ggml_add(ctx, acc, shared)
    return G.ggml_add(ctx, x2, acc)


Trace = Callable[[GgmlBuilder], Sequence[tuple[Node, np.ndarray]]]


class DecodeGraphs:
    """The graphs of one net's decode steps on one :class:`GgmlKernels`, and the buffers they share.

    A step decodes one position of each of its rows: one sequence, or several together (a batch), each with
    its own KV cache (:meth:`begin`). :meth:`traced` builds a graph from a description for the step's rows
    (once per context bucket of each row) with every leaf pointed for good and every output at a buffer of
    the caller's; :meth:`experts` runs a block's routed experts from wherever their bytes are this time.
    All graphs here share one arena, so only one runs at a time (the kernels' lock).
    """

    # graphs kept (least recently used dropped): a batch of new rows traces its own, and each costs a
    # context of tensor headers
    MAX_GRAPHS = 512
    # span sizes whose graphs are kept (the least recent dropped): a prompt runs in chunks of one size and a
    # remainder, so a few sizes serve prompt after prompt
    SPAN_SIZES = 4

    def __init__(self, kernels: GgmlKernels, rope: RopeParams, eps: float, f16_attention: bool = False) -> None:
        self.kernels, self.rope, self.eps = kernels, rope, eps
        self.f16_attention = f16_attention
        self.rows: dict[int, Row] = {}         # a sequence's number (its slot) -> its cache, inputs, bucket
        self.current: tuple[int, ...] = ()     # the sequences of this step
        self.span: Row | None = None           # the span this step runs instead (begin_span), if any
        self._span_rows: OrderedDict[int, Row] = OrderedDict()   # span size -> its cache, inputs, bucket
        self.spans = 0                      # spans (prompt chunks) run on these graphs
        self._batches: dict[tuple[int, ...], BatchInputs] = {}
        self.steps = 0                      # decode steps run on these graphs
        self.fused_products = 0             # products over adjacent matrices in the graphs built so far
        self._graphs: OrderedDict[tuple, Graph | None] = OrderedDict()
        self._scratch, self._scratch_addr = aligned_buffer(0)
        self._experts_ids = np.zeros(64, np.int32)
        self._experts_terms: dict[int, np.ndarray] = {}

    def begin(self, rows: Sequence[tuple[int, KVCache, int]]) -> None:
        """The next step decodes, for each (sequence number, its cache, position), that position: point
        every step buffer at it. A sequence entering a new context bucket (or given another cache) drops the
        graphs built for its last one."""
        for index, cache, position in rows:
            n_kv = min(cache.n_ctx, -(-(position + 1) // CONTEXT_BUCKET) * CONTEXT_BUCKET)
            row = self.rows.get(index)
            if row is None or row.cache is not cache or row.n_kv != n_kv:
                if row is not None:
                    self._drop(index)
                row = self.rows[index] = Row(cache, StepInputs() if row is None else row.inputs, n_kv)
            row.inputs.begin(position)
        self.span = None
        self.current = tuple(index for index, _, _ in rows)
        if len(rows) > 1:
            batch = self._batches.get(self.current)
            if batch is None:
                batch = self._batches[self.current] = BatchInputs(len(rows))
            batch.begin([position for _, _, position in rows])

    def begin_span(self, index: int, cache: KVCache, start: int, n: int) -> None:
        """The next graphs run positions start .. start + n - 1 of sequence ``index`` together, each row one
        position (a prompt's chunk; a ring's keys go in at :meth:`commit_span`). Its graphs are traced once per
        span size, cache and context bucket."""
        n_kv = min(cache.n_ctx, -(-(start + n) // CONTEXT_BUCKET) * CONTEXT_BUCKET)
        row = self._span_rows.get(n)
        if row is None or row.cache is not cache or row.n_kv != n_kv:
            self._drop_span(n)
            row = self._span_rows[n] = Row(cache, SpanInputs(n), n_kv)
        self._span_rows.move_to_end(n)
        while len(self._span_rows) > self.SPAN_SIZES:
            self._drop_span(next(iter(self._span_rows)))
        row.inputs.begin(start)                                  # type: ignore[call-arg]
        self.span, self.current = row, (index,)

    def _drop_span(self, n: int) -> None:
        """Free the graphs of spans of ``n`` positions (their cache, bucket or turn changed)."""
        self._span_rows.pop(n, None)
        for key in [key for key in self._graphs if key[1] == ("span",) and key[2] == n]:
            graph = self._graphs.pop(key)
            if graph is not None:
                graph.free()

    def commit_span(self) -> None:
        """The span ran whole: the keys and values it staged for its rings go into them, each position to its
        slot (:meth:`SpanInputs.ring_slots`)."""
        row = self.span
        if row is None:
            return
        for (layer, name), staged in row.staged.items():
            ring = (row.cache.k if name == "k" else row.cache.v)[layer]
            ring.reshape(len(ring), -1)[row.inputs.ring_slots(len(ring))] = staged  # type: ignore[union-attr]

    def wrote(self, layer: int) -> None:
        """Each sequence of the step (or the span's) has its positions' keys and values of block ``layer`` in
        its cache."""
        if self.span is not None:
            inputs = self.span.inputs
            self.span.cache.wrote(layer, int(inputs.pos32[-1]) + 1)
            return
        for index in self.current:
            row = self.rows[index]
            row.cache.wrote(layer, row.inputs.position + 1)       # type: ignore[union-attr]

    def _drop(self, index: int) -> None:
        """Free the graphs of sequence ``index`` (its bucket or cache changed)."""
        for key in [key for key in self._graphs if index in key[1]]:
            graph = self._graphs.pop(key)
            if graph is not None:
                graph.free()
        for batch in [b for b in self._batches if index in b and len(b) > 1]:
            del self._batches[batch]

    def traced(self, key: tuple, trace: Trace, n_nodes: int = _NODES, max_arena: int | None = None,
               rows: int | None = None) -> Graph | None:
        """The graph of ``trace`` for this step's rows and their context buckets (built on first use): its
        outputs written into the buffers it pairs them with. None when its intermediates would take more than
        ``max_arena`` bytes. ``rows``: a graph of so many rows that reads no sequence's cache or position (an
        FFN, the head), which every step of as many rows shares, begun or not."""
        span = self.span
        if span is not None:    # a span's graphs: its rows' products together, whatever their type
            full = (key, ("span",), len(span.inputs.pos32), rows is None)
        else:
            full = (key, self.current, len(self.current)) if rows is None else (key, (), rows)
        if full in self._graphs:
            self._graphs.move_to_end(full)
            return self._graphs[full]
        k = self.kernels
        graph = Graph(n_nodes, n_nodes)
        if rows is None and span is not None:
            f = GgmlBuilder(k, graph, [span], self.rope, self.eps, self.f16_attention)
        elif rows is None:
            seqs = [self.rows[i] for i in self.current]
            f = GgmlBuilder(k, graph, seqs, self.rope, self.eps, self.f16_attention,
                            self._batches.get(self.current) if len(seqs) > 1 else None)
        else:
            f = GgmlBuilder(k, graph, [], self.rope, self.eps, self.f16_attention, n_rows=rows,
                            rows_together=span is not None)
        outputs = list(trace(f))
        k.finish_graph(graph, [node.t for node, _ in outputs], f.weight_bytes, own_arena=False)
        graph.key = full                                                # type: ignore[attr-defined]
        graph.keep = (f._keep, [buf for _, buf in outputs])  # type: ignore[attr-defined]  # memory it points at
        for out, (_, buf) in zip(graph.outputs, outputs):
            out.data = buf.ctypes.data
        if max_arena is not None and graph.arena_size > max_arena:
            graph.free()
            self._keep_graph(full, None)
            return None
        self.fused_products += f.fused_products
        self._place(graph)
        self._keep_graph(full, graph)
        return graph

    def _place(self, graph: Graph) -> None:
        """Put ``graph``'s intermediates in the arena every graph here shares, grown (and the others moved)
        when it needs more."""
        if graph.arena_size > self._scratch.size:
            self._scratch, self._scratch_addr = aligned_buffer(graph.arena_size)
            for other in self._graphs.values():
                if other is not None:
                    other.place(self._scratch_addr)
        graph.place(self._scratch_addr)

    def _keep_graph(self, key: tuple, graph: Graph | None) -> None:
        self._graphs[key] = graph
        while len(self._graphs) > self.MAX_GRAPHS:
            _, old = self._graphs.popitem(last=False)
            if old is not None:
                old.free()

    def run(self, graph: Graph) -> None:
        with self.kernels.lock:
            self.kernels.run(graph)

    def experts(self, shape: ExpertsShape, h: np.ndarray, x2: np.ndarray, out: np.ndarray, experts: Sequence,
                expert_ids: Sequence[int], weights: np.ndarray, biases: Sequence[np.ndarray] | None = None,
                shared: np.ndarray | None = None, terms: bool = False) -> np.ndarray:
        """Block experts ``experts`` (FFNWeights in rank order; ``expert_ids`` their numbers) on ``h`` (1, D):
        ``out`` = x2 + their weighted sum in rank order (+ ``shared``), or with ``terms`` each weighted output,
        returned (used, D), for a caller summing experts that arrived in several batches. ``weights``: (1, used)."""
        k, used = self.kernels, len(experts)
        a = k.address
        _check_layout(experts, shape)
        addrs = [(a(e.gate.data), a(e.up.data), a(e.down.data)) for e in experts]
        ids = self._experts_ids[:2 * used]
        ids[used:] = expert_ids
        stacks = [] if shape.each else split_stacks(addrs, [1] * used)
        if len(stacks) == 1:       # one stride apart (pool slots): ggml_mul_mat_id over them
            (stack,) = stacks
            for member, index in zip(stack.members, stack.index):
                ids[member] = index
            shape, bases = _on_stack(shape, stack)
            strides = (stack.stride,) * len(bases)
        else:                      # one product per expert
            shape = replace(shape, depth=0, gate_up=False, each=True)
            bases = tuple(p for trio in addrs for p in trio)
            strides = ()
        key = ("experts", shape, terms)
        target = self._terms(shape, used) if terms else out
        with k.lock:
            graph = k.graph(key, 16 * used + 16, lambda g: _build_experts(g, shape, terms),
                            sum(m.nbytes for m in (shape.gate, shape.gate, shape.down)) * used)
            addrs_in = [h.ctypes.data, x2.ctypes.data, *bases, ids.ctypes.data, ids.ctypes.data + 4 * used,
                        weights.ctypes.data, *(b.ctypes.data for b in biases or ()),
                        *(() if shared is None else (shared.ctypes.data,))]
            for leaf, addr in zip(graph.inputs, addrs_in):
                leaf.data = addr
            for st, stride in zip(graph.stacks, strides):
                graph.set_stride(st, stride)
            graph.outputs[0].data = target.ctypes.data
            k.run(graph)
        return target

    def experts_over_rows(self, shape: ExpertsShape, h: np.ndarray, x2: np.ndarray, out: np.ndarray,
                          batch: Mapping[int, Any], routed: np.ndarray, weights: np.ndarray,
                          biases: Sequence[np.ndarray] | None = None, shared: np.ndarray | None = None) -> bool:
        """Block experts for t rows at once, as llama.cpp runs a batch's: ``out`` = x2 + each row's weighted
        expert outputs in rank order (+ ``shared``), (t, D). ``routed`` (t, used) int32: each row's experts
        in rank order, every one in ``batch`` (their FFNWeights); ``weights`` (t, used). One
        ``ggml_mul_mat_id`` per matrix over the (used, t) cells, each row's input rounded once: every expert's
        cells are one product, in the order :meth:`expert_cells` gives them, so each cell has the bits it has
        there and the sum the bits of the rank-ordered sum of those. False (nothing written) when the experts
        are not one stack."""
        if shape.each:
            return False
        a = self.kernels.address
        t, used = routed.shape
        members, member_of = np.unique(routed, return_inverse=True)
        _check_layout([batch[int(m)] for m in members], shape)
        addrs = [(a(e.gate.data), a(e.up.data), a(e.down.data)) for e in (batch[int(m)] for m in members)]
        stacks = split_stacks(addrs, np.bincount(member_of.ravel(), minlength=len(members)).tolist())
        if len(stacks) != 1:
            return False
        (stack,) = stacks
        index = np.empty(len(members), np.int32)
        index[list(stack.members)] = stack.index
        ids = np.concatenate([index[member_of.reshape(-1)], routed.reshape(-1)]).astype(np.int32)
        shape, bases = _on_stack(shape, stack)
        self._run_on_stack(("experts", shape, False, t), lambda g: _build_experts(g, shape, False, t), shape, stack,
                           len(members), [h.ctypes.data, x2.ctypes.data, *bases, ids.ctypes.data,
                                          ids.ctypes.data + 4 * t * used, weights.ctypes.data,
                                          *(b.ctypes.data for b in biases or ()),
                                          *(() if shared is None else (shared.ctypes.data,))], out)
        return True

    def _run_on_stack(self, key: tuple, build: Callable[[Graph], list], shape: ExpertsShape, stack: Any, members: int,
                      addrs: Sequence[int], out: np.ndarray) -> None:
        """Run the kernels' template graph ``key`` (built by ``build`` on first use) over one stack of
        ``members`` experts: its intermediates in the arena this object's graphs share (one template per
        number of rows, and a prompt's chunks give many), its leaves at ``addrs``, its output into ``out``."""
        k = self.kernels
        with k.lock:
            graph = k.graph(key, 16 + 16, build,
                            sum(m.nbytes for m in (shape.gate, shape.gate, shape.down)) * members, own_arena=False)
            self._place(graph)
            for leaf, addr in zip(graph.inputs, addrs):
                leaf.data = addr
            for st in graph.stacks:
                graph.set_stride(st, stack.stride)
            graph.outputs[0].data = out.ctypes.data
            k.run(graph)

    def expert_cells(self, shape: ExpertsShape, h: np.ndarray, batch: Mapping[int, Any], cells: np.ndarray,
                     weights: np.ndarray, biases: Sequence[np.ndarray] | None = None) -> np.ndarray | None:
        """Each (row, rank) cell's weighted expert output, (N, D), for N cells of a batched step at once: cell
        ``j`` is expert ``cells[j]`` (int32; its FFNWeights ``batch[cells[j]]``, one expert may serve several
        cells) on input ``h[j]`` (N, D) with weight ``weights[j]`` (N,). One ``ggml_mul_mat_id`` per matrix
        over all cells, each expert's weights loaded once for every cell routed to it; each cell is its own
        dot products, so it carries the bits :meth:`experts` gives its row alone (the kernels'
        :meth:`~GgmlKernels.cells_alike` measures this per type: the caller asks it first). None when the
        experts are run one by one (``COLIBRI_GGML_EXPERTS=each``: the caller runs its rows one by one).

        Experts that are not one stack of matrices one stride apart (some in the pool, some mapped) run as one
        product per stack, each over all the cells of its experts: a cell's bits never depend on the stack it
        is in, and an expert's cells are always together, in the order given."""
        if shape.each:
            return None
        k = self.kernels
        a = k.address
        members, first_of, counts = np.unique(cells, return_inverse=True, return_counts=True)
        _check_layout([batch[int(m)] for m in members], shape)
        addrs = [(a(e.gate.data), a(e.up.data), a(e.down.data)) for e in (batch[int(m)] for m in members)]
        stacks = split_stacks(addrs, counts.tolist())
        out = np.empty((len(cells), shape.down.rows), np.float32)
        if len(stacks) == 1:
            self._stack_cells(shape, stacks[0], h, cells, first_of, weights, biases, out)
            return out
        stack_of = np.empty(len(members), np.intp)
        for i, stack in enumerate(stacks):
            stack_of[list(stack.members)] = i
        for i, stack in enumerate(stacks):
            picked = np.flatnonzero(stack_of[first_of] == i)
            out[picked] = self._stack_cells(shape, stack, np.ascontiguousarray(h[picked]), cells[picked],
                                            first_of[picked], np.ascontiguousarray(weights[picked]), biases,
                                            np.empty((len(picked), shape.down.rows), np.float32))
        return out

    def _stack_cells(self, shape: ExpertsShape, stack: Any, h: np.ndarray, cells: np.ndarray, member_of: np.ndarray,
                     weights: np.ndarray, biases: Sequence[np.ndarray] | None, out: np.ndarray) -> np.ndarray:
        """:meth:`expert_cells` of the cells whose experts are one stack: cell j is expert ``cells[j]``, the
        batch's member ``member_of[j]``; its weighted output into ``out[j]``."""
        n = len(cells)
        index = np.zeros(int(member_of.max()) + 1, np.int32)
        index[list(stack.members)] = stack.index
        ids = np.empty(2 * n, np.int32)
        ids[:n] = index[member_of]
        ids[n:] = cells
        shape, bases = _on_stack(shape, stack, used=1)
        self._run_on_stack(("cells", shape, n), lambda g: _build_cells(g, shape, n), shape, stack, len(stack.members),
                           [h.ctypes.data, *bases, ids.ctypes.data, ids.ctypes.data + 4 * n, weights.ctypes.data,
                            *(b.ctypes.data for b in biases or ())], out)
        return out

    def _terms(self, shape: ExpertsShape, used: int) -> np.ndarray:
        buf = self._experts_terms.get(used)
        if buf is None or buf.shape[1] != shape.down.rows:
            buf = self._experts_terms[used] = np.zeros((used, shape.down.rows), np.float32)
        return buf

    def close(self) -> None:
        for graph in self._graphs.values():
            if graph is not None:
                graph.free()
        self._graphs.clear()


def _on_stack(shape: ExpertsShape, stack: Any, **changes: Any) -> tuple[ExpertsShape, tuple[int, ...]]:
    """The experts graph's shape for a stack of experts (its depth; gate and up as one product of 2F rows where
    each expert's up follows its gate) and the addresses of its stacks' first entries."""
    gate_up = (shape.activation == "swiglu" and not shape.biased
               and stack.base[1] - stack.base[0] == shape.gate.nbytes)
    shape = replace(shape, depth=stack.depth, gate_up=gate_up, **changes)
    return shape, ((stack.base[0], stack.base[2]) if gate_up else stack.base)


def _check_layout(experts: Sequence, shape: ExpertsShape) -> None:
    """Experts delivered in the layout the graph was built for (repacked or the file's), or an error: the other
    layout's bytes would multiply into plausible but wrong numbers."""
    for e in experts:
        if (e.gate.packed, e.up.packed, e.down.packed) != (shape.gate.packed, shape.gate.packed, shape.down.packed):
            raise RuntimeError("an expert arrived in another layout (repacked or not) than its graph expects")


def _build_experts(g: Graph, s: ExpertsShape, terms: bool, t: int = 1) -> list:
    """The experts graph :meth:`DecodeGraphs.experts` (or :meth:`~DecodeGraphs.experts_over_rows`, ``t`` rows)
    points: leaves h, x2, the stacks (or each rank's gate, up, down), the stack index of each rank, each rank's
    expert, the weights, the biases, the shared output. ``terms``: its output is each rank's weighted output
    (used, D) instead of their sum with x2."""
    ctx, used = g.ctx, s.used
    h = g.leaf(_F32, s.gate.cols, t)
    x2 = g.leaf(_F32, s.down.rows, t)
    stacks = [g.weight(m) for _ in range(used) for m in (s.gate, s.gate, s.down)] if s.each else _stacks(g, s)
    slot_ids, expert_ids = g.leaf(_I32, used, t), g.leaf(_I32, used, t)
    w = g.leaf(_F32, used, t)
    biases = _bias_leaves(g, s)
    shared = g.leaf(_F32, s.down.rows, t) if s.shared else None
    ys = expert_terms(ctx, s, h, slot_ids, expert_ids, w, stacks, biases, t)
    if not terms:
        return [rank_sum(ctx, ys, x2, shared)]
    acc = ys[0]
    for y in ys[1:]:
        acc = G.ggml_concat(ctx, acc, y, 1)
    return [G.ggml_cont(ctx, acc)]


def _build_cells(g: Graph, s: ExpertsShape, n: int) -> list:
    """The graph :meth:`DecodeGraphs.expert_cells` points: leaves h (D, n), the stacks, each cell's stack
    index and expert, its weight, the biases; its output each cell's weighted expert output (D, n)."""
    ctx = g.ctx
    h = g.leaf(_F32, s.gate.cols, n)
    stacks = _stacks(g, s)
    slot_ids, expert_ids = g.leaf(_I32, 1, n), g.leaf(_I32, 1, n)
    w = g.leaf(_F32, 1, n)
    (y,) = expert_terms(ctx, s, h, slot_ids, expert_ids, w, stacks, _bias_leaves(g, s), n)
    return [G.ggml_cont(ctx, y)]


def _stacks(g: Graph, s: ExpertsShape) -> list:
    """The experts' stacks a layer's graph indexes (gate and up fused into one where they lie so), in the
    layout the source delivers them (repacked or the file's)."""
    if s.gate_up:
        return [g.stack(s.gate.gid, s.gate.cols, 2 * s.gate.rows, s.depth, s.gate.packed),
                g.stack(s.down.gid, s.down.cols, s.down.rows, s.depth, s.down.packed)]
    return [g.stack(m.gid, m.cols, m.rows, s.depth, m.packed) for m in (s.gate, s.gate, s.down)]


def _bias_leaves(g: Graph, s: ExpertsShape) -> list | None:
    """Every expert's gate, up and down biases (gpt-oss), one leaf each; None when the experts have none."""
    if not s.biased:
        return None
    return [g.leaf(_F32, rows, s.n_experts) for rows in (s.gate.rows, s.gate.rows, s.down.rows)]
