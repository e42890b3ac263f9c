"""Products on ggml's CPU kernels (through ggml-python), over memory we own: the fast backend.

ggml serves here as a library of kernels, not as a framework. A context made
with ``no_alloc`` holds tensor headers only; every header's ``data`` points
at our memory (trunk arrays, buffer-pool slots, activations), so no weight is
ever copied, and ggml never allocates anything we did not give it.

A call builds (once) or reuses a small graph: :meth:`GgmlKernels.linears`
puts several products that share one input in one graph (q/k/v),
:meth:`GgmlKernels.expert_ffns` a whole batch of expert FFNs (gate, up,
activation, down per expert). Graphs are cached by their *signature* (types,
shapes, positions), not by the weights: the q/k/v graph of layer 0 serves
every layer, the graph of eight experts every batch of eight. A call only
re-points the leaves' ``data`` (weights, input, output) and runs
``ggml_graph_compute``; each ctypes call here costs 0.1-2 us, a graph launch
~5 us (evidence/ggml_overhead_*.md).

Numerics are llama.cpp's, not the NumPy reference's: ggml quantises the
activation to the weight type's partner (Q8_0 for Q8_0/Q4_0, Q8_K for the
K-quants, F16 for F16 weights, BF16 for BF16) before each product, and its
SiLU uses a fast exp. The relative error against float32 products of the same
weights is ~1e-3..1e-2 (tests/test_kernels_ggml.py states it per type).

Bit-identity (design invariant 1) holds within this backend: ggml computes
each output row whole, by one thread, with unaligned loads, and splits the
activation's quantisation on block boundaries, so neither the thread count
nor the byte address of the weights changes a bit; an expert's output does
not depend on which other experts share its graph (each product is its own
node). A product of one position takes ggml's vec_dot path and one of several
positions its tiled GEMM (llamafile), so a prefill row may differ in its last
bits from the same position decoded alone, as in llama.cpp.

ggml-python builds ggml from source at install with ``GGML_NATIVE`` on
(``-march=native``): the instruction set is chosen at build time, for the
machine that built it. :func:`probe` refuses a library built for features
this CPU lacks, instead of letting it die on an illegal instruction.
"""
from __future__ import annotations

import ctypes
import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

import ggml.ggml as G  # ggml-python; this module is only imported when the ggml backend is asked for

from colibri_aio.kernels import ggml_blocks
from colibri_aio.kernels.backend import FFNWeights
from colibri_aio.kernels.blocks import AttentionSpec, BlockInput, DenseWeights, Routed, scatter
from colibri_aio.kernels.qtensor import QTensor

__all__ = ["GgmlKernels", "GgmlUnavailable", "probe", "supported_types", "version"]

# Features ggml reports as compiled in (ggml_cpu_has_*) and the /proc/cpuinfo flag each needs.
_ISA_FLAGS = {"sse3": "pni", "ssse3": "ssse3", "avx": "avx", "avx2": "avx2", "f16c": "f16c", "fma": "fma",
              "bmi2": "bmi2", "avx_vnni": "avx_vnni", "avx512": "avx512f", "avx512_vbmi": "avx512vbmi",
              "avx512_vnni": "avx512_vnni", "avx512_bf16": "avx512_bf16", "amx_int8": "amx_int8"}

_ALIGN = 64                      # byte alignment of the activation buffers we hand to ggml
_GRAPH_NODES = 4096              # capacity of one graph (a batch of 128 experts is 512 nodes)
_TEMPLATES = 256                 # graphs kept per backend (least recently used dropped)
_WEIGHTS = 1 << 15               # weight tensors remembered (see _Weight)
PARALLEL_BYTES = 1 << 18         # graphs with fewer weight bytes run on one thread (GgmlKernels)


class GgmlUnavailable(RuntimeError):
    """ggml-python cannot serve on this machine; the message says why."""


def version() -> str:
    """ggml's own version string, and ggml-python's."""
    fn = G.lib.ggml_version
    fn.restype = ctypes.c_char_p
    import ggml
    return f"ggml {fn().decode()} (ggml-python {ggml.__version__})"


def built_features() -> list[str]:
    """The x86 features the library was compiled for (ggml_cpu_has_* are compile-time answers)."""
    return [f for f in _ISA_FLAGS if getattr(G, f"ggml_cpu_has_{f}", lambda: 0)()]


def _cpu_flags() -> set[str] | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def probe() -> str:
    """Check that ggml can run here; returns a one-line description, raises GgmlUnavailable."""
    flags = _cpu_flags()
    if flags is not None:
        missing = [f for f in built_features() if _ISA_FLAGS[f] not in flags]
        if missing:
            raise GgmlUnavailable(f"ggml-python was built for {', '.join(missing)}, which this CPU lacks "
                                  f"(reinstall it on this machine: pip install --force-reinstall --no-binary "
                                  f":all: ggml-python)")
    return f"{version()}, built for {'/'.join(built_features()) or 'generic x86'}"


# --- types ---

def _ggml_type(t: GGMLQuantizationType) -> int | None:
    """ggml's type id for a GGUF type when ggml's CPU backend can multiply by it, else None.

    GGUF stores ggml's own enum, so the ids agree; a type counts only if ggml
    knows it by the same name, agrees on its block geometry and has a CPU
    dot product (the integer and F64 types have none).
    """
    gid = getattr(G, f"GGML_TYPE_{t.name}", None)
    if gid is None or gid != int(t) or t not in GGML_QUANT_SIZES:
        return None
    block, type_size = GGML_QUANT_SIZES[t]
    if G.ggml_blck_size(gid) != block or G.ggml_type_size(gid) != type_size:
        return None
    if not G.ggml_get_type_traits_cpu(gid).contents.vec_dot:
        return None
    if t != GGMLQuantizationType.F32 and not G.ggml_get_type_traits(gid).contents.to_float:
        return None
    return gid


def supported_types() -> frozenset[GGMLQuantizationType]:
    """Every GGUF type ggml's CPU kernels multiply (ggml 0.15: F32, F16, BF16, all Q*, IQ*, TQ*, MXFP4...)."""
    return frozenset(t for t in GGMLQuantizationType if _ggml_type(t) is not None)


# --- memory ---

def fill_mask(pos: np.ndarray, mask: np.ndarray, positions: np.ndarray) -> None:
    """RoPE positions (I32) and the causal mask (F16, T x S_kv): 0 up to each position, -inf after."""
    pos[:] = positions
    mask[:] = np.where(np.arange(mask.shape[1])[None, :] > positions[:, None], -np.inf, 0.0)


def _aligned(nbytes: int) -> tuple[np.ndarray, int]:
    """A zeroed byte buffer of at least ``nbytes`` starting on an _ALIGN boundary, and its address."""
    raw = np.zeros(max(nbytes, 1) + _ALIGN, np.uint8)
    start = (-raw.ctypes.data) % _ALIGN
    buf = raw[start:start + max(nbytes, 1)]
    return buf, buf.ctypes.data


def _float_buffer(n: int) -> tuple[np.ndarray, int]:
    buf, addr = _aligned(4 * n)
    return buf.view(np.float32), addr


# --- graphs ---

class _Graph:
    """One ggml graph, built once: a context of tensor headers, a plan, its intermediates' memory.

    Leaves are either *fixed* (their data given when the graph is built: a
    trunk weight, a KV cache) or *inputs*, re-pointed at every call in the
    order of ``inputs``. Never take a view of an input leaf: a view copies its
    source's address when it is made. ``outputs`` are result nodes the caller
    points at its own memory; every other node gets a fixed place in
    ``_arena`` (views: their source's place plus their offset) when the graph
    is built. ``keep`` holds whatever the fixed leaves point into.
    """

    def __init__(self, n_tensors: int) -> None:
        n_tensors += 8
        size = n_tensors * G.ggml_tensor_overhead() + G.ggml_graph_overhead_custom(_GRAPH_NODES, False)
        self.ctx = G.ggml_init(G.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=True))
        if not self.ctx:
            raise MemoryError("ggml_init failed")
        self.gf = G.ggml_new_graph_custom(self.ctx, _GRAPH_NODES, False)
        self.inputs: list[ctypes.Structure] = []
        self.outputs: list[ctypes.Structure] = []
        self.keep: list[object] = []
        self.plan: G.ggml_cplan | None = None
        self.work_size = 0
        self.result: object = None   # what a cached graph's fixed outputs are, for its next callers
        self.key: tuple | None = None
        self._arena: np.ndarray | None = None

    def leaf(self, gid: int, cols: int, rows: int) -> ctypes.Structure:
        """A (rows, cols) input: its data is given at every call."""
        return self.tensor(gid, (cols, rows))

    def tensor(self, gid: int, ne: tuple[int, ...], data: np.ndarray | int | None = None):
        """A leaf of ggml shape ``ne`` (innermost first): fixed at ``data`` (an array, kept alive, or an
        address), or an input when ``data`` is None."""
        t = getattr(G, f"ggml_new_tensor_{len(ne)}d")(self.ctx, gid, *ne)
        if data is None:
            self.inputs.append(t.contents)
        else:
            if isinstance(data, np.ndarray):
                self.keep.append(data)
                data = data.ctypes.data
            t.contents.data = data
        return t

    def finish(self, outputs: Sequence, n_threads: int, effects: Sequence = (), first: Sequence = ()) -> None:
        """Expand the graph -- ``first`` (outputs computed before anything else), then ``effects`` (nodes
        that only write into memory something later reads, such as KV stores), then ``outputs`` --
        give every intermediate a place, and plan it. Nodes run in that order."""
        for t in first:
            G.ggml_build_forward_expand(self.gf, t)
            self.outputs.append(t.contents)
        for t in effects:
            G.ggml_build_forward_expand(self.gf, t)
        for t in outputs:
            G.ggml_build_forward_expand(self.gf, t)
            self.outputs.append(t.contents)
        out_ids = {ctypes.addressof(o) for o in self.outputs}
        views, offset = [], 0
        sizes: list[tuple[ctypes.Structure, int]] = []
        for i in range(G.ggml_graph_n_nodes(self.gf)):
            node = G.ggml_graph_node(self.gf, i).contents
            if node.view_src:
                views.append(node)
            elif not node.data and ctypes.addressof(node) not in out_ids:
                sizes.append((node, offset))
                offset += -(-G.ggml_nbytes(ctypes.pointer(node)) // _ALIGN) * _ALIGN
        self._arena, base = _aligned(offset)
        for node, off in sizes:
            node.data = base + off
        moving = {ctypes.addressof(t) for t in self.inputs} | out_ids
        for node in views:  # in graph order, so a view of a view finds its source placed
            src = node.view_src.contents
            if ctypes.addressof(src) in moving:
                raise ValueError("a view of a re-pointed tensor would keep a stale address")
            node.data = src.data + node.view_offs
        self.plan = G.ggml_graph_plan(self.gf, n_threads, None)
        self._plan_ref = ctypes.byref(self.plan)
        self.work_size = self.plan.work_size

    def run(self, work: "ctypes._Pointer[ctypes.c_uint8]") -> None:
        self.plan.work_data = work
        status = G.ggml_graph_compute(self.gf, self._plan_ref)
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute failed: {G.ggml_status_to_string(status).decode()}")

    def free(self) -> None:
        if self.ctx:
            G.ggml_free(self.ctx)
            self.ctx = None


# The signature of one weight in a graph: (ggml type, rows, cols). A plain tuple: graph keys are
# built and hashed at every call, and tuples of ints hash fastest.
Mat = tuple[int, int, int]


def _mat_nbytes(m: Mat) -> int:
    return G.ggml_row_size(m[0], m[2]) * m[1]


class _Weight:
    """What a graph needs of one weight tensor, found once per QTensor object.

    Weights are the same objects call after call (trunk tensors, a cached
    expert's views, which live as long as their cache slot's fill), so their
    type, shape and address are looked up, not recomputed (``ndarray.ctypes``
    alone costs ~1 us). Holding ``w`` keeps its id from being reused while it
    is remembered.
    """

    __slots__ = ("w", "mat", "addr")

    def __init__(self, w: QTensor, gid: int) -> None:
        if len(w.shape) != 2:
            raise ValueError(f"expected a matrix, got shape {w.shape}")
        self.w, self.mat, self.addr = w, (gid, w.shape[0], w.shape[1]), w.data.ctypes.data


_ACTIVATIONS: dict[str, Callable] = {"swiglu": lambda ctx, g, u: G.ggml_swiglu_split(ctx, g, u)}


class GgmlKernels:
    """The ggml backend of one engine: its graphs, work buffer and threads.

    A graph whose weights are smaller than ``parallel_bytes`` runs on one
    thread: waking the others costs more than they save (and on a loaded
    machine a thread that is descheduled stalls the rest at every node).
    Thread count never changes a bit, so this is a speed choice only.

    One call at a time (a lock makes concurrent calls wait); two engines
    each have their own.
    """

    name = "ggml"

    def __init__(self, n_threads: int = 2, *, parallel_bytes: int = PARALLEL_BYTES) -> None:
        self.description = probe()
        self.reason = self.description
        self.n_threads = n_threads
        self.parallel_bytes = parallel_bytes
        self._types: dict[GGMLQuantizationType, int] = {t: gid for t in GGMLQuantizationType
                                                         if (gid := _ggml_type(t)) is not None}
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._weights: dict[int, _Weight] = {}
        self._owned: dict[int, tuple[np.ndarray, int]] = {}   # arrays this backend made: id -> (array, address)
        self._experts: dict[int, tuple] = {}                  # expert object id -> (expert, signature, addresses)
        self._sigs: dict[tuple, tuple] = {}                   # one object per expert signature
        self._pos: dict[int, tuple] = {}                      # KV span -> (position, mask) of decode steps
        self._last: tuple = (None, None)                      # (positions, (pos, mask, span)) of this step
        self._work, self._work_ptr = self._work_buffer(1 << 20)
        self._lock = threading.Lock()

    # --- the interface the forward pass calls ---

    @property
    def types(self) -> frozenset[GGMLQuantizationType]:
        return frozenset(self._types)

    def linear(self, w: QTensor, x: np.ndarray) -> np.ndarray:
        """``x @ W.T``: x (T, cols) float32 -> (T, rows) float32."""
        return self._linears((w,), x)[0]

    def linears(self, ws: Sequence[QTensor], x: np.ndarray) -> list[np.ndarray]:
        """Several products on one input in one graph: [x @ W.T for W in ws]."""
        return self._linears(ws, x)

    def _linears(self, ws: Sequence[QTensor], x: np.ndarray) -> list[np.ndarray]:
        weights = [self._weight(w) for w in ws]
        mats = tuple(m.mat for m in weights)
        cols = mats[0][2]
        for m in mats:
            if m[2] != cols:
                raise ValueError(f"linears: weights of {m[2]} and {cols} columns share one input")
        x = self._input(x, cols)
        t = x.shape[0]
        addrs = [m.addr for m in weights]
        addrs.append(x.ctypes.data)
        sizes = [t * m[1] for m in mats]
        out = self._call(("linears", mats, t), 2 * len(mats) + 1, lambda g: self._build_linears(g, mats, t),
                         addrs, sizes, sum(_mat_nbytes(m) for m in mats))
        ends = itertools.accumulate(sizes)
        return [out[e - n: e].reshape(t, m[1]) for e, n, m in zip(ends, sizes, mats)]

    def expert_ffns(self, experts: Sequence[FFNWeights], x: np.ndarray, rows: Sequence[np.ndarray] | None = None,
                    activation: str = "swiglu", into: tuple[np.ndarray, list] | None = None) -> np.ndarray | None:
        """``down(act(gate x, up x))`` for a batch of experts in one graph.

        ``x``: (T, D) float32. With ``rows`` None every expert takes all T
        positions (decode); else expert i takes the positions ``rows[i]``.
        Returns the outputs stacked, (sum of positions, D): expert 0's rows,
        then expert 1's, ...; or, with ``into=(contrib, cells)``, writes them
        into ``contrib`` (T, k, D) instead: expert i's output for position
        ``p`` ranked ``r`` goes to ``contrib[p, r]``, with ``cells[i]`` the rank
        (one position) or the (positions, ranks) arrays.
        """
        if rows is None and into is not None and x.shape[0] == 1:
            return self._decode_experts(experts, x, into[0], into[1], activation)
        if activation not in _ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}")
        ws = [(self._weight(e.gate), self._weight(e.up), self._weight(e.down)) for e in experts]
        gate, down = ws[0][0].mat, ws[0][2].mat
        for g, u, d in ws:
            if g.mat != gate or u.mat != gate or d.mat != down:
                raise ValueError("expert_ffns: a batch needs experts of one type and shape")
        if down[2] != gate[1] or down[1] != gate[2]:
            raise ValueError(f"expert FFN shapes gate {gate[1:]} and down {down[1:]} do not chain")
        x = self._input(x, gate[2])
        addrs: list[int] = []
        if rows is None:
            counts: tuple[int, ...] | int = x.shape[0]
            for g, u, d in ws:
                addrs += (g.addr, u.addr, d.addr)
            addrs.append(self._address(x))
            n_out = len(ws) * x.shape[0]
        else:
            parts = [np.take(x, r, axis=0) for r in rows]
            counts = tuple(p.shape[0] for p in parts)
            for (g, u, d), p in zip(ws, parts, strict=True):
                addrs += (g.addr, u.addr, d.addr, p.ctypes.data)
            n_out = sum(counts)
        key = ("ffn", activation, gate, down, len(ws), counts)
        build = lambda g: self._build_ffns(g, gate, down, len(ws), counts, activation)  # noqa: E731
        n_tensors, weight_bytes = 8 * len(ws) + 1, len(ws) * (2 * _mat_nbytes(gate) + _mat_nbytes(down))
        if into is not None and counts == 1:  # decode: every output straight into its cell
            contrib, cells = into
            base, row = self._address(contrib), contrib.shape[2] * 4
            self._run(key, n_tensors, build, addrs, [base + r * row for r in cells], weight_bytes)
            return None
        sizes = [n * down[1] for n in (counts if isinstance(counts, tuple) else (counts,) * len(ws))]
        out = self._call(key, n_tensors, build, addrs, sizes, weight_bytes).reshape(n_out, down[1])
        if into is None:
            return out
        scatter(into[0], into[1], out, x.shape[0])
        return None

    def _decode_experts(self, experts: Sequence[FFNWeights], x: np.ndarray, contrib: np.ndarray, ranks: list[int],
                        activation: str) -> None:
        """One position, outputs into their contrib cells: the decode step's path, kept lean (a
        layer's experts are one dict lookup each; their graph is kept by batch size)."""
        known, addrs = self._experts, []
        sig = None
        for e in experts:
            hit = known.get(id(e))
            if hit is None:
                hit = self._expert(e)
            if sig is None:
                sig = hit[1]
            elif hit[1] is not sig:
                raise ValueError("expert_ffns: a batch needs experts of one type and shape")
            addrs += hit[2]
        addrs.append(self._address(x))
        key = ("ffn1", activation, sig, len(experts))
        graph = self._graphs.get(key)
        if graph is None:
            gate, down = sig
            graph = self._new_graph(key, 8 * len(experts) + 1,
                                    lambda g: self._build_ffns(g, gate, down, len(experts), 1, activation),
                                    len(experts) * (2 * _mat_nbytes(gate) + _mat_nbytes(down)))
        else:
            self._graphs.move_to_end(key)
        base, row = self._address(contrib), 4 * contrib.shape[2]
        self._run_graph(graph, addrs, [base + row * r for r in ranks])

    def _expert(self, e: FFNWeights) -> tuple:
        """(e, (gate, down) signature, addresses): found once per expert object (a cached expert's
        weights are the same object for as long as it stays in its slot)."""
        g, u, d = self._weight(e.gate), self._weight(e.up), self._weight(e.down)
        if u.mat != g.mat or d.mat[2] != g.mat[1] or d.mat[1] != g.mat[2]:
            raise ValueError(f"expert FFN shapes gate {g.mat[1:]}, up {u.mat[1:]}, down {d.mat[1:]} do not chain")
        sig = self._sigs.setdefault((g.mat, d.mat), (g.mat, d.mat))
        if len(self._experts) >= _WEIGHTS:
            self._experts.clear()
        hit = self._experts[id(e)] = (e, sig, (g.addr, u.addr, d.addr))
        return hit

    def attention_router(self, spec: AttentionSpec, w: DenseWeights, x: BlockInput, positions: np.ndarray,
                         cache, layer: int, pending: tuple | None = None) -> Routed:
        """A block's attention and routing as one graph (:mod:`.ggml_blocks`); see :mod:`.blocks`.

        ``pending=(experts, ranks)``: the previous block's experts, for one
        position, run in the same graph first (into ``x.contrib``): a decode
        step whose experts are all in memory costs one graph call per block.
        One position: the graph is kept, and the result is views of its own
        buffers, valid until this block runs again. Several: built, run once
        and freed; fresh arrays.
        """
        combine = isinstance(x, Routed)
        pre, ins, outs = self._pending(pending, x)
        if positions.shape[0] == 1:  # decode: this block's graph for this KV span, kept
            pos, mask, s_kv = self._step(positions, cache.k.shape[1])
            graph = self._graphs.get(("block", id(w), id(cache), layer, s_kv, combine, pre))
            if graph is not None:
                self._graphs.move_to_end(graph.key)
                r = graph.result
                if combine:
                    ins += (self._address(x.residual), self._address(x.contrib), self._address(x.weights))
                    self._run_graph(graph, ins, outs)
                    return r
                x = self._input(x, w.attn_norm.shape[0])
                self._run_graph(graph, (x.ctypes.data,), ())
                return Routed(x, r.residual, r.moe_input, r.ids, r.weights, r.contrib)
        else:
            if pending is not None:
                raise ValueError("pending experts are for one position")
            s_kv = ggml_blocks.kv_span(int(positions[-1]), cache.k.shape[1])
            pos, mask = self._mask(positions, s_kv)
        t, d_model, k = positions.shape[0], w.attn_norm.shape[0], spec.top_k
        if combine:
            ins += (self._address(x.residual), self._address(x.contrib), self._address(x.weights))
        else:
            x = self._input(x, d_model)
            ins.append(x.ctypes.data)
        out = Routed(np.empty((t, d_model), np.float32) if combine else x, np.empty((t, d_model), np.float32),
                     np.empty((t, d_model), np.float32), np.empty((t, k), np.int32),
                     np.empty((t, k), np.float32), np.empty((t, k, d_model), np.float32))
        stride = cache.k[0].nbytes
        caches = (cache.k.ctypes.data + layer * stride, cache.v.ctypes.data + layer * stride)
        key = ("block", id(w), id(cache), layer, s_kv, combine, pre) if t == 1 else None
        weight_bytes = sum(self._weight(m).w.nbytes for m in (w.attn_q, w.attn_k, w.attn_v, w.attn_output))
        self._run(key, 96 + (8 * pre[2] if pre else 0),
                  lambda g: self._build_block(g, spec, w, t, combine, pos, mask, caches, cache, s_kv, out, pre),
                  ins, outs, weight_bytes)
        return out

    def logits(self, norm: np.ndarray, output: QTensor, x: BlockInput, eps: float,
               rows: Literal["last", "all"], pending: tuple | None = None) -> np.ndarray:
        """Final norm and output head (one graph, the last block's experts combined in it, and run in it
        first when ``pending``, as in :meth:`attention_router`): (V,) for the last position or (T, V)
        for all; a fresh array."""
        head = self._weight(output)
        pre, ins, outs = self._pending(pending, x)
        if isinstance(x, Routed):
            t, k = x.weights.shape
            ins += (self._address(x.residual), self._address(x.contrib), self._address(x.weights))
        else:
            x = self._input(x if rows == "all" else x[-1:], norm.shape[0])
            t, k = x.shape[0], 0
            ins.append(x.ctypes.data)
        n = 1 if rows == "last" else t
        out = np.empty((n, head.mat[1]), np.float32)
        outs.append(out.ctypes.data)
        key = ("logits", id(norm), id(output), t, k, rows, pre) if t == 1 else None
        self._run(key, 16 + k + (8 * pre[2] if pre else 0),
                  lambda g: self._build_logits(g, norm, head, eps, t, k, rows == "last", pre), ins, outs,
                  _mat_nbytes(head.mat))
        return out if rows == "all" else out[0]

    def _pending(self, pending: tuple | None, x: BlockInput) -> tuple[tuple | None, list[int], list[int]]:
        """The previous block's experts to run first: (signature, batch size) for the graph's key, the
        addresses of their weights and input, and of the contrib cells their outputs go to."""
        if pending is None:
            return None, [], []
        if not isinstance(x, Routed) or x.contrib.shape[0] != 1:
            raise ValueError("pending experts need the previous block's Routed, for one position")
        experts, ranks = pending
        known, ins, sig = self._experts, [], None
        for e in experts:
            hit = known.get(id(e))
            if hit is None:
                hit = self._expert(e)
            if sig is None:
                sig = hit[1]
            elif hit[1] is not sig:
                raise ValueError("expert_ffns: a batch needs experts of one type and shape")
            ins += hit[2]
        ins.append(self._address(x.moe_input))
        base, row = self._address(x.contrib), 4 * x.contrib.shape[2]
        return (*sig, len(experts)), ins, [base + row * r for r in ranks]

    def dequantize(self, w: QTensor) -> np.ndarray:
        """All weights of ``w`` as a new float32 array of shape ``w.shape`` (ggml's to_float, one thread)."""
        gid = self._gid(w)
        if w.ggml_type == GGMLQuantizationType.F32:
            return w.data.view(np.float32).reshape(w.shape).copy()
        out = np.empty(w.shape, np.float32)
        data = np.ascontiguousarray(w.data)
        G.ggml_get_type_traits(gid).contents.to_float(
            ctypes.c_void_p(data.ctypes.data), out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.size)
        return out

    def close(self) -> None:
        """Free every graph's ggml context."""
        with self._lock:
            for g in self._graphs.values():
                g.free()
            self._graphs.clear()
            self._weights.clear()
            self._owned.clear()
            self._experts.clear()

    # --- helpers ---

    def _gid(self, w: QTensor) -> int:
        gid = self._types.get(w.ggml_type)
        if gid is None:
            name = getattr(w.ggml_type, "name", str(w.ggml_type))
            raise ValueError(f"ggml's CPU backend has no kernel for {name}")
        return gid

    def _weight(self, w: QTensor) -> _Weight:
        hit = self._weights.get(id(w))
        if hit is not None:
            return hit
        if len(self._weights) >= _WEIGHTS:
            self._weights.clear()
        hit = self._weights[id(w)] = _Weight(w, self._gid(w))
        return hit

    @staticmethod
    def _input(x: np.ndarray, cols: int) -> np.ndarray:
        if x.ndim != 2 or x.shape[1] != cols:
            raise ValueError(f"input of shape {x.shape} for weights of {cols} columns")
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=np.float32)
        return x

    @staticmethod
    def _work_buffer(nbytes: int) -> tuple[np.ndarray, "ctypes._Pointer[ctypes.c_uint8]"]:
        buf, addr = _aligned(nbytes)
        return buf, ctypes.cast(addr, ctypes.POINTER(ctypes.c_uint8))

    def _call(self, key: tuple, n_tensors: int, build: Callable[[_Graph], list], addrs: list[int],
              sizes: list[int], weight_bytes: int) -> np.ndarray:
        """Run the graph ``key`` on ``addrs``; its outputs, ``sizes`` floats each, land one after
        another in the returned array."""
        out = np.empty(sum(sizes), np.float32)
        outs, a = [], out.ctypes.data
        for n in sizes:
            outs.append(a)
            a += 4 * n
        self._run(key, n_tensors, build, addrs, outs, weight_bytes)
        return out

    def _run(self, key: tuple | None, n_tensors: int, build: Callable[[_Graph], list], addrs: list[int],
             outs: list[int], weight_bytes: int) -> None:
        """Run the graph ``key`` (built on first use; ``key`` None: built, run once and freed) with its
        inputs at ``addrs`` and its outputs at ``outs``."""
        graph = None if key is None else self._graphs.get(key)
        if graph is None:
            graph = self._new_graph(key, n_tensors, build, weight_bytes)
        else:
            self._graphs.move_to_end(key)
        try:
            self._run_graph(graph, addrs, outs)
        finally:
            if key is None:
                graph.free()

    def _run_graph(self, graph: _Graph, addrs: Sequence[int], outs: Sequence[int]) -> None:
        with self._lock:
            for leaf, a in zip(graph.inputs, addrs, strict=True):
                leaf.data = a
            for node, a in zip(graph.outputs, outs, strict=True):
                node.data = a
            graph.run(self._work_ptr)

    def _new_graph(self, key: tuple | None, n_tensors: int, build: Callable[[_Graph], list],
                   weight_bytes: int) -> _Graph:
        graph = _Graph(n_tensors)
        try:
            outputs, effects, first = build(graph), (), ()
            if isinstance(outputs, tuple):
                outputs, effects, first = outputs
            threads = self.n_threads if weight_bytes >= self.parallel_bytes else 1
            graph.finish(outputs, threads, effects, first)
        except BaseException:
            graph.free()
            raise
        if graph.work_size > self._work.size:
            self._work, self._work_ptr = self._work_buffer(graph.work_size)
        if key is not None:
            graph.key = key
            self._graphs[key] = graph
            if len(self._graphs) > _TEMPLATES:
                self._graphs.popitem(last=False)[1].free()
        return graph

    def _address(self, a: np.ndarray) -> int:
        """The address of an array this backend made (remembered) or of any other (looked up)."""
        hit = self._owned.get(id(a))
        return hit[1] if hit is not None and hit[0] is a else a.ctypes.data

    def _own(self, *arrays: np.ndarray) -> None:
        if len(self._owned) >= _WEIGHTS:
            self._owned.clear()
        for a in arrays:
            self._owned[id(a)] = (a, a.ctypes.data)

    def _step(self, positions: np.ndarray, n_ctx: int) -> tuple[np.ndarray, np.ndarray, int]:
        """RoPE position, mask and KV span of a decode step: buffers kept per span (graphs point at
        them), refilled once per step -- every block of the step passes the same ``positions``."""
        if positions is self._last[0]:
            return self._last[1]
        s_kv = ggml_blocks.kv_span(int(positions[0]), n_ctx)
        bufs = self._pos.get(s_kv)
        if bufs is None:
            bufs = self._pos[s_kv] = (np.empty(1, np.int32), np.empty((1, s_kv), np.float16))
        fill_mask(bufs[0], bufs[1], positions)
        self._last = (positions, (*bufs, s_kv))
        return bufs[0], bufs[1], s_kv

    @staticmethod
    def _mask(positions: np.ndarray, s_kv: int) -> tuple[np.ndarray, np.ndarray]:
        """Fresh RoPE positions and mask for several positions (a prefill graph, run once)."""
        pos, mask = np.empty(positions.shape[0], np.int32), np.empty((positions.shape[0], s_kv), np.float16)
        fill_mask(pos, mask, positions)
        return pos, mask

    def _build_block(self, g: _Graph, spec: AttentionSpec, w: DenseWeights, t: int, combine: bool, pos: np.ndarray,
                     mask: np.ndarray, caches: tuple[int, int], cache, s_kv: int, out: Routed, pre: tuple | None):
        """The graph of one block, its outputs fixed at ``out``'s arrays (which the graph keeps).
        Inputs in order: ``pre``'s experts (gate, up, down each, then their input), then the previous
        block's residual, contrib and weights (or x)."""
        d_model, f32 = w.attn_norm.shape[0], G.GGML_TYPE_F32
        first = self._build_ffns(g, pre[0], pre[1], pre[2], 1, "swiglu") if pre else []
        norms = ("attn_norm", "ffn_norm") + (("attn_q_norm", "attn_k_norm") if spec.qk_norm else ())
        fixed = {name: g.tensor(f32, (getattr(w, name).shape[0],), getattr(w, name)) for name in norms}
        fixed["ffn_gate_inp"] = g.tensor(f32, (d_model, spec.n_expert), w.ffn_gate_inp)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            m = self._weight(getattr(w, name))
            fixed[name] = g.tensor(m.mat[0], (m.mat[2], m.mat[1]), m.addr)
            g.keep.append(m.w)
        row, n_ctx = spec.n_head_kv * spec.head_dim, cache.k.shape[1]
        k_cache, v_cache = (g.tensor(f32, (row, n_ctx), a) for a in caches)
        g.keep += [cache, pos, mask]
        x = ggml_blocks.combine(g, d_model, spec.top_k, t) if combine else g.tensor(f32, (d_model, t))
        results, stores = ggml_blocks.block(g, spec, fixed, x, t, g.tensor(G.GGML_TYPE_I32, (t,), pos),
                                            g.tensor(G.GGML_TYPE_F16, (s_kv, t), mask), k_cache, v_cache, s_kv)
        nodes = [x, *results] if combine else list(results)
        arrays = [out.x, out.residual, out.moe_input, out.ids, out.weights][0 if combine else 1:]
        for node, a in zip(nodes, arrays):
            node.contents.data = a.ctypes.data
        g.keep += [*arrays, out.contrib]
        g.result = out
        self._own(out.x, out.residual, out.moe_input, out.weights, out.contrib)
        return [], [*stores, *nodes], first

    def _build_logits(self, g: _Graph, norm: np.ndarray, head: _Weight, eps: float, t: int, k: int, last: bool,
                      pre: tuple | None):
        d_model, f32 = norm.shape[0], G.GGML_TYPE_F32
        first = self._build_ffns(g, pre[0], pre[1], pre[2], 1, "swiglu") if pre else []
        x = ggml_blocks.combine(g, d_model, k, t) if k else g.tensor(f32, (d_model, t))
        w = g.tensor(head.mat[0], (head.mat[2], head.mat[1]), head.addr)
        g.keep.append(head.w)
        return [ggml_blocks.logits(g, x, t, last and k > 0, g.tensor(f32, (d_model,), norm), w, eps)], [], first

    @staticmethod
    def _build_linears(g: _Graph, mats: tuple[Mat, ...], t: int) -> list:
        ws = [g.leaf(gid, cols, rows) for gid, rows, cols in mats]
        x = g.leaf(G.GGML_TYPE_F32, mats[0][2], t)
        return [G.ggml_mul_mat(g.ctx, w, x) for w in ws]

    @staticmethod
    def _build_ffns(g: _Graph, gate: Mat, down: Mat, n_experts: int, counts: tuple[int, ...] | int,
                    activation: str) -> list:
        """Leaves in the order expert_ffns gives addresses: per expert gate, up, down (and its own
        input when ``counts`` is a tuple), then the shared input when it is an int."""
        act, shared = _ACTIVATIONS[activation], isinstance(counts, int)
        specs = []
        for i in range(n_experts):
            wg, wu = g.leaf(gate[0], gate[2], gate[1]), g.leaf(gate[0], gate[2], gate[1])
            wd = g.leaf(down[0], down[2], down[1])
            specs.append((wg, wu, wd, None if shared else g.leaf(G.GGML_TYPE_F32, gate[2], counts[i])))
        x_all = g.leaf(G.GGML_TYPE_F32, gate[2], counts) if shared else None
        outs = []
        for wg, wu, wd, x in specs:
            x = x_all if x is None else x
            h = act(g.ctx, G.ggml_mul_mat(g.ctx, wg, x), G.ggml_mul_mat(g.ctx, wu, x))
            outs.append(G.ggml_mul_mat(g.ctx, wd, h))
        return outs
