"""One decode step as a few whole ggml graphs: per block one for attention and the router, one for the
experts; one for the output head.

The per-operation backend (:mod:`colibri_aio.kernels.ggml_cpu`) runs one small
graph per product and leaves norms, RoPE, attention and routing to NumPy: about
thirty graph launches and as many trips through Python per decoded token.
Here a block's attention graph runs attn_norm, the q/k/v products (and biases), the
family's q/k RMSNorm and RoPE, writes k and v into the KV cache in place
(``ggml_set_rows``), attends over the cache (``ggml_flash_attn_ext``; keys past
the position masked), projects with attn_output, adds the residual, applies
ffn_norm and the router, and ranks the experts (softmax, argsort, the chosen
weights renormalised where the family does: llama.cpp's ``build_moe_ffn``). Python then only reads
the k chosen experts, which the expert source must see (to read them or check
they are resident), and runs the experts' graph: ``ggml_mul_mat_id`` per matrix
over the experts seen as one 3-D tensor (pool slots one stride apart), the
weighted sum in rank order, the residual.

When every expert a step routes to is resident in the expert source's buffer
pool (:class:`~colibri_aio.experts.ResidentExperts`), the whole step is one
graph (:meth:`DecodeGraphs.step`): each block's attention and router nodes,
then ``ggml_get_rows`` of the block's slot table (expert -> pool slot, kept by
the cache) by the chosen experts gives ``ggml_mul_mat_id`` its indices into
the whole pool seen as one stack per matrix, then the next block, then the
head: one launch, one fork and join of the threads, and no Python between the
blocks per token instead of 2 per block plus 1. Same nodes, same products,
same rank-ordered sum: the same bits as the per-block graphs.

Graphs are built once per shape (every block of a model shares its graphs;
attention once per context bucket of :data:`CONTEXT_BUCKET` keys) and
re-pointed at every call: leaves at the trunk's arrays, the expert slots and
the KV cache, outputs at this object's buffers. No weight and no cache row is
copied.

Numerics are llama.cpp's products: activations rounded to the weight type's
partner before each product; ggml's norms, RoPE and softmax. Attention runs in
float32 over the cache's keys and values (an f16 cache is widened in the graph,
as the per-operation path and prefill widen it), so a position gives nearly the
same logits decoded alone or within a prefill and greedy replies do not change
with KV reuse. ``COLIBRI_GGML_ATTENTION=f16`` attends as llama.cpp's flash
attention does over an f16 cache (queries rounded to f16, values summed in
f16): its logits bit for bit on the Q8_0 and F32 fixtures, and no widening
pass over the cache (which costs ~3x the cache's bytes per step at long
contexts), but a last prompt token decoded alone then moves by ~1e-2. Within this backend the result depends only on the
token ids: the same graphs run whatever the placement, the context size (masked
keys are skipped, never summed) or the order the experts arrive in (the MoE
falls back to :meth:`GgmlKernels.expert_ffns` plus the same rank-ordered sum
when the experts come in several batches or from memory that is not one stack).

The families this serves are those whose block is "attention, softmax top-k, SwiGLU experts", with
the variants :class:`AttentionShape` names: qwen3moe (per-head q/k RMSNorm, NEOX RoPE, weights
renormalised), olmoe (q/k RMSNorm over the whole projection, weights not renormalised), qwen2moe
(q/k/v biases, no q/k norm, weights not renormalised, and a shared expert behind a sigmoid gate: a
small graph of its own, run once the layer's reads are out, whose output the experts graph adds to the
routed sum before the residual, as the per-operation path does) and mixtral (no q/k norm, NORMAL RoPE).
The others stay on the per-operation path; what each lacks here: gpt-oss: attention sinks, the
sliding-window ring on alternate layers, YaRN RoPE, the attn_output and router biases, routing by
logits with a softmax over the k chosen, the clamped SwiGLU with biases on every expert product.
deepseek2: multi-head latent attention (q LoRA, a latent cache whose values live in the keys, the
absorbed attn_k_b/attn_v_b products, YaRN), sigmoid routing with a selection bias and expert groups,
scaled weights, leading dense blocks and an ungated shared expert. glm4moe: partial NEOX RoPE
(n_rot < key_length) with its scaling, sigmoid routing with a selection bias and scaled weights,
leading dense blocks and an ungated shared expert.
"""
from __future__ import annotations

import ctypes
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

import ggml.ggml as G

from colibri_aio.kernels.backend import FFNWeights
from colibri_aio.kernels.ggml_cpu import GgmlKernels, _Graph, _Mat, _aligned, _stacks, knob
from colibri_aio.kernels.qtensor import QTensor

__all__ = ["AttentionShape", "DecodeGraphs", "StepShape", "CONTEXT_BUCKET", "STEP_SCRATCH"]

CONTEXT_BUCKET = 256        # the attention graph is built for the context rounded up to this many keys
# The most bytes a one-graph step's float32 copies of the KV cache may take (every block keeps its own in one
# graph, where the per-block graphs share one): beyond it, at long contexts, steps run block by block.
STEP_SCRATCH = 256 << 20
_MASK_ROWS = max(1, int(getattr(G, "GGML_KQ_MASK_PAD", 1)))  # flash attention wants the mask this tall
_F32, _F16, _I32, _I64 = G.GGML_TYPE_F32, G.GGML_TYPE_F16, G.GGML_TYPE_I32, G.GGML_TYPE_I64
_KV_GID = {np.dtype(np.float16): _F16, np.dtype(np.float32): _F32}
_TOKENS = itertools.count()


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """What one block's attention-and-router graph depends on; every block of a model shares it."""

    q: _Mat
    k: _Mat
    v: _Mat
    o: _Mat
    heads: int
    heads_kv: int
    key_width: int
    value_width: int
    n_rot: int
    rope_base: float
    n_ctx_orig: int
    eps: float
    experts: int
    used: int
    kv_dtype: str
    qkv_fused: bool = False   # q, k and v follow each other in memory with one type: one product
    f16_attention: bool = False   # attend over an f16 cache as llama.cpp does, not in float32
    # What families vary (the defaults are qwen3moe's block):
    qk_norm: str = "head"     # RMSNorm of q and k: per head ("head"), over the whole projection ("whole"), "none"
    neox_rope: bool = True    # NEOX RoPE (dimension i pairs with i + n_rot/2); False: NORMAL (2i with 2i+1)
    qkv_bias: bool = False    # attn_q/k/v biases added to the products (three leaves after the router's)
    normalize: bool = True    # the chosen experts' weights divided by their sum

    @property
    def qkv(self) -> _Mat:
        """q, k and v as one matrix (their rows one after another)."""
        return _Mat(self.q.gid, self.q.rows + self.k.rows + self.v.rows, self.q.cols, self.q.packed)


def _mask_leaf(s: AttentionShape) -> int:
    """The mask's place among the leaves :func:`_build_attention` makes."""
    return 11 if s.qkv_fused else 13


def _strided(g: _Graph, gid: int, width: int, n_kv: int, heads: int, row_bytes: int) -> ctypes.Structure:
    """A leaf over a (positions, heads, width) cache seen as (width, positions, heads), as attention reads it."""
    t = g.leaf(gid, width, n_kv, heads)
    c = t.contents
    item = G.ggml_type_size(gid)
    c.nb[1], c.nb[2] = row_bytes, width * item
    c.nb[3] = row_bytes * n_kv
    return t


def _widened(ctx, caches: Sequence, n_kv: int, heads: int) -> list:
    """Each f16 cache leaf seen as (width, positions, heads) (:func:`_strided`), as a float32 copy laid out
    (width, positions, heads) contiguous: what ``ggml_cast`` gives, the same values (f16 -> f32 is exact).

    ``ggml_get_rows`` widens a whole row of ``width`` at a time (F16C) where ``ggml_cast`` converts
    element by element (~6x slower per row measured on 2304 positions x 4 heads x 128)."""
    positions = G.ggml_arange(ctx, 0.0, float(n_kv), 1.0)
    index = G.ggml_cast(ctx, G.ggml_repeat_4d(ctx, G.ggml_reshape_2d(ctx, positions, n_kv, 1), n_kv, heads, 1, 1),
                        _I32)                                   # (positions, heads): row p of every head
    return [G.ggml_get_rows(ctx, cache, index) for cache in caches]


def _build_attention(g: _Graph, s: AttentionShape, n_kv: int) -> tuple[list, list]:
    ctx, d, dv = g.ctx, s.key_width, s.value_width
    kv_gid = _KV_GID[np.dtype(s.kv_dtype)]
    x = g.leaf(_F32, s.q.cols, 1)                                   # the residual stream entering the block
    attn_norm = g.leaf(_F32, s.q.cols, 1)
    if s.qkv_fused:
        wqkv = g.weight(s.qkv)
    else:
        wq, wk, wv = (g.weight(m) for m in (s.q, s.k, s.v))
    # q/k norm leaves in every variant, so each leaf keeps its place (unused, pointed nowhere, without q/k norm)
    whole = s.qk_norm == "whole"
    q_norm, k_norm = g.leaf(_F32, s.q.rows if whole else d, 1), g.leaf(_F32, s.k.rows if whole else d, 1)
    pos32, pos64 = g.leaf(_I32, 1, 1), g.leaf(_I64, 1, 1)
    k_rows = g.leaf(kv_gid, s.heads_kv * d, n_kv)                  # the cache as rows, for the writes
    v_rows = g.leaf(kv_gid, s.heads_kv * dv, n_kv)
    item = G.ggml_type_size(kv_gid)
    k_all = _strided(g, kv_gid, d, n_kv, s.heads_kv, s.heads_kv * d * item)    # the same memory, as read
    v_all = _strided(g, kv_gid, dv, n_kv, s.heads_kv, s.heads_kv * dv * item)
    mask = g.leaf(_F16, n_kv, _MASK_ROWS)
    wo = g.weight(s.o)
    ffn_norm = g.leaf(_F32, s.q.cols, 1)
    router = g.leaf(_F32, s.q.cols, s.experts)
    if s.qkv_bias:
        q_bias, k_bias, v_bias = g.leaf(_F32, d, s.heads), g.leaf(_F32, d, s.heads_kv), g.leaf(_F32, s.v.rows, 1)
    rope_type = G.GGML_ROPE_TYPE_NEOX if s.neox_rope else G.GGML_ROPE_TYPE_NORMAL

    def rms(t, w):
        return G.ggml_mul(ctx, G.ggml_rms_norm(ctx, t, s.eps), w)

    def rope(t):
        return G.ggml_rope_ext(ctx, t, pos32, None, s.n_rot, rope_type, s.n_ctx_orig, s.rope_base,
                               1.0, 0.0, 1.0, 32.0, 1.0)

    def rms_whole(t, w, heads):      # over the projection before its split into heads (olmoe)
        return G.ggml_reshape_3d(ctx, rms(G.ggml_reshape_2d(ctx, t, d * heads, 1), w), d, heads, 1)

    h = rms(x, attn_norm)
    if s.qkv_fused:      # one product, its rows seen as q, k and v
        qkv = G.ggml_mul_mat(ctx, wqkv, h)
        q = G.ggml_view_3d(ctx, qkv, d, s.heads, 1, 4 * d, 4 * d * s.heads, 0)
        k = G.ggml_view_3d(ctx, qkv, d, s.heads_kv, 1, 4 * d, 4 * d * s.heads_kv, 4 * s.q.rows)
        v = G.ggml_view_2d(ctx, qkv, s.v.rows, 1, 4 * s.v.rows, 4 * (s.q.rows + s.k.rows))
    else:
        q = G.ggml_reshape_3d(ctx, G.ggml_mul_mat(ctx, wq, h), d, s.heads, 1)
        k = G.ggml_reshape_3d(ctx, G.ggml_mul_mat(ctx, wk, h), d, s.heads_kv, 1)
        v = G.ggml_mul_mat(ctx, wv, h)
    if s.qkv_bias:
        q, k, v = G.ggml_add(ctx, q, q_bias), G.ggml_add(ctx, k, k_bias), G.ggml_add(ctx, v, v_bias)
    if s.qk_norm == "head":
        q, k = rms(q, q_norm), rms(k, k_norm)
    elif whole:
        q, k = rms_whole(q, q_norm, s.heads), rms_whole(k, k_norm, s.heads_kv)
    q, k = rope(q), rope(k)
    # Non-finite if q, k, v or an activation rounded before a product (the normed input, the heads'
    # output) holds a NaN or an infinity (or overflows): rounding to 8 bits and flash attention's online
    # softmax (it steps over a NaN score) can both give finite numbers from broken weights.
    sums = [G.ggml_sum(ctx, t) for t in (q, k, v, h)]
    effects = [G.ggml_set_rows(ctx, k_rows, G.ggml_reshape_2d(ctx, k, s.heads_kv * d, 1), pos64),
               G.ggml_set_rows(ctx, v_rows, v, pos64)]
    if kv_gid != _F32 and not s.f16_attention:   # the keys and values the context holds, as float32
        k_all, v_all = _widened(ctx, (k_all, v_all), n_kv, s.heads_kv)
    att = G.ggml_flash_attn_ext(ctx, G.ggml_permute(ctx, q, 0, 2, 1, 3), k_all, v_all, mask,
                                1.0 / math.sqrt(d), 0.0, 0.0)
    G.ggml_flash_attn_ext_set_prec(att, G.GGML_PREC_F32)
    heads = G.ggml_reshape_2d(ctx, att, dv * s.heads, 1)
    x2 = G.ggml_add(ctx, x, G.ggml_mul_mat(ctx, wo, heads))
    check = G.ggml_sum(ctx, heads)
    for t in sums:
        check = G.ggml_add(ctx, check, t)
    h2 = rms(x2, ffn_norm)
    probs = G.ggml_soft_max(ctx, G.ggml_mul_mat(ctx, router, h2))                # (E, 1)
    order = G.ggml_argsort(ctx, probs, G.GGML_SORT_ORDER_DESC)
    top = G.ggml_view_2d(ctx, order, s.used, 1, order.contents.nb[1], 0)
    w = G.ggml_get_rows(ctx, G.ggml_reshape_3d(ctx, probs, 1, s.experts, 1), top)     # (1, used, 1)
    if s.normalize:
        w = G.ggml_reshape_2d(ctx, w, s.used, 1)
        w = G.ggml_div(ctx, w, G.ggml_sum_rows(ctx, w))
    # else the rows themselves are the output (a view as output would leave the buffer unwritten)
    return [x2, h2, order, w, check], effects


def _rank_sum(ctx, ys: list, x2, shared=None):
    """x2 + ((y0 + y1) + y2) + ...: the weighted expert outputs summed in rank order, then the shared
    expert's output when there is one, then the residual (the per-operation path's order)."""
    acc = ys[0]
    for y in ys[1:]:
        acc = G.ggml_add(ctx, acc, y)
    if shared is not None:
        acc = G.ggml_add(ctx, acc, shared)
    return G.ggml_add(ctx, x2, acc)


def _build_experts_stacked(g: _Graph, gate: _Mat, down: _Mat, used: int, depth: int, gate_up: bool,
                           shared: bool = False) -> list:
    """``gate_up``: each expert's up matrix follows its gate matrix, so both are one product of 2F rows.
    ``shared``: one more leaf, last, the shared expert's output (D, 1) added to the routed sum."""
    ctx = g.ctx
    h = g.leaf(_F32, gate.cols, 1, 1)
    x2 = g.leaf(_F32, down.rows, 1)
    if gate_up:
        wgu = g.stack(gate.gid, gate.cols, 2 * gate.rows, depth)
    else:
        wg, wu = g.stack(gate.gid, gate.cols, gate.rows, depth), g.stack(gate.gid, gate.cols, gate.rows, depth)
    wd = g.stack(down.gid, down.cols, down.rows, depth)
    ids = g.leaf(_I32, used, 1)                                       # rank r's matrix in the stack
    w = g.leaf(_F32, 1, used, 1)
    if gate_up:
        a = G.ggml_swiglu(ctx, G.ggml_mul_mat_id(ctx, wgu, h, ids))
    else:
        a = G.ggml_swiglu_split(ctx, G.ggml_mul_mat_id(ctx, wg, h, ids), G.ggml_mul_mat_id(ctx, wu, h, ids))
    y = G.ggml_mul(ctx, G.ggml_mul_mat_id(ctx, wd, a, ids), w)       # (D, used, 1)
    nb1 = y.contents.nb[1]
    ys = [G.ggml_view_2d(ctx, y, down.rows, 1, nb1, r * nb1) for r in range(used)]
    return [_rank_sum(ctx, ys, x2, g.leaf(_F32, down.rows, 1) if shared else None)]


def _build_experts_each(g: _Graph, gate: _Mat, down: _Mat, used: int, shared: bool = False) -> list:
    ctx = g.ctx
    h = g.leaf(_F32, gate.cols, 1)
    x2 = g.leaf(_F32, down.rows, 1)
    ys = []
    for _ in range(used):                         # leaves: gate, up, down, weight of rank r
        wg, wu = g.leaf(gate.gid, gate.cols, gate.rows), g.leaf(gate.gid, gate.cols, gate.rows)
        wd, w = g.leaf(down.gid, down.cols, down.rows), g.leaf(_F32, 1, 1)
        a = G.ggml_swiglu_split(ctx, G.ggml_mul_mat(ctx, wg, h), G.ggml_mul_mat(ctx, wu, h))
        ys.append(G.ggml_mul(ctx, G.ggml_mul_mat(ctx, wd, a), w))
    return [_rank_sum(ctx, ys, x2, g.leaf(_F32, down.rows, 1) if shared else None)]


def _build_shared_expert(g: _Graph, gate: _Mat, down: _Mat) -> list:
    """sigmoid(gate_inp · h) * down(swiglu(gate h, up h)): a shared expert behind a scalar gate (qwen2moe)."""
    ctx = g.ctx
    h = g.leaf(_F32, gate.cols, 1)
    wg, wu, wd = g.weight(gate), g.weight(gate), g.weight(down)      # resident: repacked when their type is
    gate_inp = g.leaf(_F32, gate.cols, 1)
    a = G.ggml_swiglu_split(ctx, G.ggml_mul_mat(ctx, wg, h), G.ggml_mul_mat(ctx, wu, h))
    return [G.ggml_mul(ctx, G.ggml_mul_mat(ctx, wd, a), G.ggml_sigmoid(ctx, G.ggml_mul_mat(ctx, gate_inp, h)))]


@dataclass(frozen=True, slots=True)
class StepShape:
    """What the one-graph decode step depends on, beside the blocks' :class:`AttentionShape`: each block's
    expert matrices (gate, down; gate and up adjacent), the pool's stack (``depth`` slots ``stride`` bytes
    apart), the output head, the context bucket."""

    experts: tuple[tuple[_Mat, _Mat, bool], ...]
    depth: int
    stride: int
    head: _Mat
    n_kv: int


@dataclass(slots=True)
class _StepLeaves:
    """Where each block's leaves sit among a step graph's inputs (the graph's build order)."""

    attention: list[int]   # first attention leaf of each block
    experts: list[int]     # each block's slot table leaf; its stacks follow
    head: int              # the head's x leaf; its norm and matrix follow


def _build_step(g: _Graph, shapes: Sequence[AttentionShape], step: StepShape, leaves: _StepLeaves) -> list:
    """A whole decode step: every block's attention and router (:func:`_build_attention`), its experts
    picked through the slot table by ``ggml_get_rows`` and run over the pool's stack, the head.

    The blocks follow each other through memory, not through the graph: block l + 1's input leaf is
    pointed at block l's output buffer. ggml runs nodes in graph order, so each block's nodes are
    expanded here in order, the cache writes of a block (its effects) before its attention reads the
    cache. Outputs: per block the experts' order, their weights and the residual stream after it; the
    logits; one sum that is finite when every check of the per-block graphs is.
    """
    ctx, outputs, check = g.ctx, [], None
    for s, (gate, down, gate_up) in zip(shapes, step.experts):
        leaves.attention.append(len(g.inputs))
        (x2, h2, order, w, att_check), effects = _build_attention(g, s, step.n_kv)
        for t in effects:
            G.ggml_build_forward_expand(g.gf, t)
        leaves.experts.append(len(g.inputs))
        table = g.leaf(_I32, 1, s.experts)                    # stack index of each expert (slots)
        top = G.ggml_view_2d(ctx, order, s.used, 1, order.contents.nb[1], 0)
        ids = G.ggml_reshape_2d(ctx, G.ggml_get_rows(ctx, table, top), s.used, 1)
        if gate_up:
            wgu = g.stack(gate.gid, gate.cols, 2 * gate.rows, step.depth)
            a = G.ggml_swiglu(ctx, G.ggml_mul_mat_id(ctx, wgu, h2, ids))
        else:
            wg = g.stack(gate.gid, gate.cols, gate.rows, step.depth)
            wu = g.stack(gate.gid, gate.cols, gate.rows, step.depth)
            a = G.ggml_swiglu_split(ctx, G.ggml_mul_mat_id(ctx, wg, h2, ids), G.ggml_mul_mat_id(ctx, wu, h2, ids))
        wd = g.stack(down.gid, down.cols, down.rows, step.depth)
        y = G.ggml_mul(ctx, G.ggml_mul_mat_id(ctx, wd, a, ids), G.ggml_reshape_3d(ctx, w, 1, s.used, 1))
        nb1 = y.contents.nb[1]
        x_out = _rank_sum(ctx, [G.ggml_view_2d(ctx, y, down.rows, 1, nb1, r * nb1) for r in range(s.used)], x2)
        G.ggml_build_forward_expand(g.gf, x_out)
        block_check = G.ggml_add(ctx, att_check, G.ggml_sum(ctx, w))
        check = block_check if check is None else G.ggml_add(ctx, check, block_check)
        outputs += [order, w, x_out]
    leaves.head = len(g.inputs)
    logits, head_check = _build_head(g, step.head, shapes[0].eps)
    check = G.ggml_add(ctx, G.ggml_add(ctx, check, G.ggml_sum(ctx, outputs[-1])), head_check)
    return outputs + [logits, check]


def _build_head(g: _Graph, out: _Mat, eps: float) -> list:
    ctx = g.ctx
    x = g.leaf(_F32, out.cols, 1)
    norm = g.leaf(_F32, out.cols, 1)
    w = g.weight(out)
    h = G.ggml_mul(ctx, G.ggml_rms_norm(ctx, x, eps), norm)
    return [G.ggml_mul_mat(ctx, w, h), G.ggml_sum(ctx, h)]   # the sum: finite when the rounded input is


class DecodeGraphs:
    """The graphs of one net's decode steps on one :class:`GgmlKernels`, and the buffers they write.

    Outputs live in buffers owned here and are overwritten by the next call of
    the same kind: :meth:`attention` fills :attr:`residual`, :attr:`moe_input`,
    :attr:`order` and :attr:`weights`, valid until the next :meth:`attention`;
    :meth:`experts` writes the residual stream into one of two buffers, taking
    turns, so a block's input survives its own experts.
    """

    def __init__(self, kernels: GgmlKernels, shapes: Sequence[AttentionShape], shared_expert: bool = False) -> None:
        """``shapes``: each block's (blocks of one file may differ in their weights' types); ``shared_expert``:
        every block has a gated shared expert (:meth:`shared_expert` fills :attr:`shared` before
        :meth:`experts` adds it)."""
        self.kernels, self.shapes = kernels, list(shapes)
        self.shared_expert_on = shared_expert
        self.shape = shape = shapes[0]
        self._stacked = knob("experts") != "each"
        self.step_knob = knob("step")     # "graph": a step whose experts are all resident is one graph
        dim = shape.q.cols
        self.residual = np.zeros((1, dim), np.float32)        # x2: after attention
        self.moe_input = np.zeros((1, dim), np.float32)       # h: ffn_norm(x2)
        self.order = np.zeros((1, shape.experts), np.int32)   # experts by descending probability
        self.weights = np.zeros((1, shape.used), np.float32)  # of the first `used`, renormalised
        self.check = np.zeros(1, np.float32)                  # finite when q, k, v and rounded inputs are
        self.shared = np.zeros((1, dim), np.float32)          # the gated shared expert's output
        self._streams = [np.zeros((1, dim), np.float32) for _ in range(2)]
        self.steps = 0                                         # decode steps run on these graphs
        self._turn = 0
        self._pos32, self._pos64 = np.zeros(1, np.int32), np.zeros(1, np.int64)
        self._masks: dict[int, np.ndarray] = {}
        self._ids = np.zeros(shape.used, np.int32)
        self._n_kv = 0
        self._addr = kernels._address
        self._blocks: dict[int, tuple[int, ...]] = {}      # id(keys) -> a block's leaf addresses but x, mask
        self._expert_mats: dict[tuple, tuple[_Mat, _Mat, int]] = {}
        # Our buffers' addresses, taken once (``ndarray.ctypes`` costs a few microseconds a call).
        self._outs = tuple(b.ctypes.data for b in (self.residual, self.moe_input, self.order, self.weights,
                                                     self.check))
        self._stream_addrs = [b.ctypes.data for b in self._streams]
        self._ids_addr, self._weights_addr = self._ids.ctypes.data, self.weights.ctypes.data
        self._mask_addrs: dict[int, int] = {}
        self._head_check = np.zeros(1, np.float32)
        self._head_check_addr = self._head_check.ctypes.data
        # The one-graph step (step()): its outputs, input, intermediates, and what its graph was pointed at.
        self._token = next(_TOKENS)          # its graphs' key: another net's graphs are pointed elsewhere
        self._step_buffers: tuple[np.ndarray, ...] | None = None
        self._step_in = np.zeros((1, shape.q.cols), np.float32)
        self._step_scratch, _ = _aligned(0)
        self._step_graph: _Graph | None = None
        self._step_keys: tuple = ()
        self._step_leaves: dict[tuple, _StepLeaves] = {}
        self._step_shapes: dict[int, StepShape | None] = {}
        self._shared_addr = self.shared.ctypes.data

    def begin(self, position: int, n_ctx: int) -> None:
        """The next step decodes ``position`` in a cache of ``n_ctx`` positions: mask the keys after it."""
        n_kv = min(n_ctx, -(-(position + 1) // CONTEXT_BUCKET) * CONTEXT_BUCKET)
        mask = self._masks.get(n_kv)
        if mask is None:
            mask = self._masks[n_kv] = np.full((_MASK_ROWS, n_kv), -np.inf, np.float16)
            self._mask_addrs[n_kv] = mask.ctypes.data
        mask[0, :position + 1] = 0
        mask[0, position + 1:] = -np.inf
        self._pos32[0] = self._pos64[0] = position
        self._n_kv = n_kv

    def attention(self, layer: int, x: np.ndarray, norms: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
                  mats: tuple[QTensor, QTensor, QTensor, QTensor], router: np.ndarray,
                  keys: np.ndarray, values: np.ndarray,
                  biases: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
        """Block ``layer``'s attention and router for x (1, D) float32, C-contiguous.

        Fills :attr:`residual`, :attr:`moe_input`, :attr:`order`, :attr:`weights` and :attr:`check`, and
        writes the position's key and value into ``keys``/``values`` (the block's cache arrays (S, Hkv, d)
        and (S, Hkv, dv)). ``norms``: attn_norm, attn_q_norm, attn_k_norm (None without q/k norm),
        ffn_norm; ``mats``: attn_q, attn_k, attn_v, attn_output; ``router``: ffn_gate_inp (E, D) float32;
        ``biases``: attn_q/k/v's, when the shape has them.
        """
        s, k, n_kv = self.shapes[layer], self.kernels, self._n_kv
        block = self._block(layer, norms, mats, router, keys, values, biases)
        mask_leaf = _mask_leaf(s)
        with k.lock:
            graph = k.graph(("decode-attention", s, n_kv), 64, lambda g: _build_attention(g, s, n_kv),
                            block[1])
            leaves = graph.inputs
            for leaf, addr in zip(leaves, block[0]):
                leaf.data = addr
            leaves[0].data = x.ctypes.data
            leaves[mask_leaf].data = self._mask_addrs[n_kv]
            for node, addr in zip(graph.outputs, self._outs):
                node.data = addr
            k.run(graph)

    def _block(self, layer: int, norms: tuple[np.ndarray, ...], mats: tuple[QTensor, ...], router: np.ndarray,
               keys: np.ndarray, values: np.ndarray,
               biases: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> tuple[tuple[int, ...], int, np.ndarray]:
        """Block ``layer``'s attention leaf addresses (x and the mask as 0: given per call), its weights'
        bytes, and its keys array (kept, so that its id, the memo's key, is not reused)."""
        block = self._blocks.get(id(keys))
        if block is None:
            s, a = self.shapes[layer], self._addr
            w = (a(mats[0].data),) if s.qkv_fused else (a(mats[0].data), a(mats[1].data), a(mats[2].data))
            qk_norms = (0, 0) if s.qk_norm == "none" else (a(norms[1]), a(norms[2]))
            addrs = (0, a(norms[0]), *w, *qk_norms, self._pos32.ctypes.data,
                     self._pos64.ctypes.data, a(keys), a(values), a(keys), a(values), 0, a(mats[3].data),
                     a(norms[3]), a(router), *(map(a, biases) if s.qkv_bias else ()))
            nbytes = sum(m.nbytes for m in (s.q, s.k, s.v, s.o))
            block = self._blocks[id(keys)] = (addrs, nbytes, keys)      # the array keeps its id taken
        return block

    def step_shape(self, experts: Sequence[Sequence], depth: int, stride: int, bases: Sequence[tuple[int, int, int]],
                   output: QTensor) -> StepShape | None:
        """The :class:`StepShape` of this net's one-graph steps over a pool of ``depth`` slots ``stride`` bytes
        apart (``experts``: each block's experts, the first one's matrices give their types and shapes: an
        ExpertLocation's ranges or an expert's weights; ``bases``: each
        block's gate, up and down address of slot 0), for the current context bucket; None when its
        intermediates (every block's, a step graph does not share them) would exceed :data:`STEP_SCRATCH`.
        Remembered per bucket: one net's decode graphs serve one pool."""
        n_kv = self._n_kv
        if n_kv in self._step_shapes:
            return self._step_shapes[n_kv]
        k = self.kernels
        mats = []
        for block, base in zip(experts, bases):
            gate, down = k._mat(block[0].gate), k._mat(block[0].down)
            mats.append((gate, down, base[1] - base[0] == gate.nbytes))
        widened = sum(2 * n_kv * s.heads_kv * max(s.key_width, s.value_width) * 4 for s in self.shapes
                      if s.kv_dtype != "float32" and not s.f16_attention)
        shape = None if widened > STEP_SCRATCH else StepShape(tuple(mats), depth, stride, k._mat(output), n_kv)
        self._step_shapes[n_kv] = shape
        return shape

    def step(self, shape: StepShape, x: np.ndarray, blocks: Sequence[tuple], tables: np.ndarray,
             bases: Sequence[tuple[int, int, int]], head: tuple[np.ndarray, QTensor]) -> None:
        """One decode step, every block and the head, as one graph (:func:`_build_step`), after :meth:`begin`.

        ``x``: the token's embedding (1, D); ``blocks``: per block the arguments of :meth:`attention` after
        x (norms, mats, router, keys, values, biases); ``tables``: (blocks, experts) int32, each expert's slot in
        the stack (read as the graph runs); ``bases``: each block's stack addresses; ``head``: output_norm,
        output. Fills :attr:`step_order`, :attr:`step_weights`, :attr:`step_x`, :attr:`step_logits` and
        :attr:`step_check`, and writes the position's keys and values into every block's cache.
        """
        k, n = self.kernels, len(blocks)
        if self._step_buffers is None or len(self._step_buffers[0]) != n:
            self._make_step_buffers(n, shape.head.rows)
        order, weights, xs, logits, check = self._step_buffers
        np.copyto(self._step_in, x)
        keys = tuple(b[3] for b in blocks)
        key = ("decode-step", self._token, shape.n_kv)   # one shape per context bucket (step_shape)
        size = n * (96 + 3 * self.shape.used) + 64
        with k.lock:
            leaves = _StepLeaves([], [], 0)
            graph = k.graph(key, size, lambda g: _build_step(g, self.shapes, shape, leaves), 1 << 40,
                            own_arena=False, n_nodes=max(4096, size))
            if leaves.attention:
                self._step_leaves[key] = leaves
            if (graph is not self._step_graph or len(keys) != len(self._step_keys)
                    or any(a is not b for a, b in zip(keys, self._step_keys))):
                self._point_step(graph, self._step_leaves[key], shape, blocks, tables, bases, head)
                self._step_graph, self._step_keys = graph, keys
            k.run(graph)

    def _make_step_buffers(self, n_blocks: int, vocab: int) -> None:
        s = self.shape
        self._step_buffers = (np.zeros((n_blocks, s.experts), np.int32), np.zeros((n_blocks, s.used), np.float32),
                              np.zeros((n_blocks, s.q.cols), np.float32), np.zeros((1, vocab), np.float32),
                              np.zeros(1, np.float32))
        self.step_order, self.step_weights, self.step_x, self.step_logits, self.step_check = self._step_buffers
        self._step_graph = None

    def _point_step(self, graph: _Graph, leaves: _StepLeaves, shape: StepShape, blocks: Sequence[tuple],
                    tables: np.ndarray, bases: Sequence[tuple[int, int, int]], head: tuple[np.ndarray, QTensor]) -> None:
        """Point a step graph's leaves and outputs at their memory: all of it stays the same from step to
        step (the token's embedding is copied into :attr:`_step_in`, the mask and position are updated in
        place), so this runs only for a new graph (a new context bucket) or new cache arrays."""
        a, inputs = self._addr, graph.inputs
        if graph.arena_size > self._step_scratch.size:
            self._step_scratch, _ = _aligned(graph.arena_size)
        graph.place(self._step_scratch.ctypes.data)
        order, weights, xs, logits, check = self._step_buffers
        for layer, block in enumerate(blocks):
            s = self.shapes[layer]
            addrs = list(self._block(layer, *block)[0])
            addrs[0] = self._step_in.ctypes.data if layer == 0 else xs[layer - 1].ctypes.data
            addrs[_mask_leaf(s)] = self._mask_addrs[shape.n_kv]
            first = leaves.attention[layer]
            for leaf, addr in zip(inputs[first:first + len(addrs)], addrs):
                leaf.data = addr
            gate_up = shape.experts[layer][2]
            base = bases[layer]
            mats = (base[0], base[2]) if gate_up else base
            first = leaves.experts[layer]
            inputs[first].data = tables[layer].ctypes.data
            for leaf, addr in zip(inputs[first + 1:first + 1 + len(mats)], mats):
                leaf.data = addr
        for st in graph.stacks:
            graph.set_stride(st, shape.stride)
        for leaf, addr in zip(inputs[leaves.head:], (xs[-1].ctypes.data, a(head[0]), a(head[1].data))):
            leaf.data = addr
        outs = [b for layer in range(len(blocks)) for b in (order[layer], weights[layer], xs[layer])]
        for node, buf in zip(graph.outputs, outs + [logits, check]):
            node.data = buf.ctypes.data

    def stackable(self, experts: Sequence[FFNWeights]) -> tuple | None:
        """How ``experts`` (in rank order) run as one stack: (base addresses, stride, index of each, depth),
        or None when their matrices are not one stride apart (several stacks: the caller falls back)."""
        a = self._addr
        stacks = _stacks([(a(e.gate.data), a(e.up.data), a(e.down.data)) for e in experts], [1] * len(experts))
        if len(stacks) != 1:
            return None
        stack, index = stacks[0], [0] * len(experts)
        for member, i in zip(stack.members, stack.index):
            index[member] = i  # back to rank order
        return stack.base, stack.stride, index, stack.depth

    def experts(self, experts: Sequence[FFNWeights], stack: tuple | None) -> np.ndarray:
        """x2 + sum over ranks r of weights[r] * down_r(swiglu(gate_r h, up_r h)), for :attr:`moe_input` h,
        :attr:`residual` x2, ``experts`` in rank order: the next residual stream (1, D)."""
        k, first = self.kernels, experts[0]
        kind = (first.gate.ggml_type, first.gate.shape, first.down.ggml_type, first.down.shape, len(experts))
        mats = self._expert_mats.get(kind)
        if mats is None:
            gate, down = k._mat(first.gate), k._mat(first.down)
            mats = self._expert_mats[kind] = (gate, down, len(experts) * (2 * gate.nbytes + down.nbytes))
        gate, down, weight_bytes = mats
        used = len(experts)
        turn = self._turn
        self._turn ^= 1
        h, x2 = self._outs[1], self._outs[0]
        shared = self.shared_expert_on
        last = (self._shared_addr,) if shared else ()
        if self._stacked and stack is not None:
            base, stride, index, depth = stack
            self._ids[:] = index
            gate_up = base[1] - base[0] == gate.nbytes
            key = ("decode-experts", gate, down, used, depth, gate_up, shared)
            build = lambda g: _build_experts_stacked(g, gate, down, used, depth, gate_up, shared)  # noqa: E731
            addrs = (h, x2, base[0], *(() if gate_up else (base[1],)), base[2], self._ids_addr, self._weights_addr,
                     *last)
            strides = (stride,) * (2 if gate_up else 3)
        else:
            a, w = self._addr, self._weights_addr
            key = ("decode-experts-each", gate, down, used, shared)
            build = lambda g: _build_experts_each(g, gate, down, used, shared)  # noqa: E731
            addrs = (h, x2, *(p for r, e in enumerate(experts)
                              for p in (a(e.gate.data), a(e.up.data), a(e.down.data), w + 4 * r)), *last)
            strides = ()
        with k.lock:
            graph = k.graph(key, 12 * used + 8, build, weight_bytes)
            for leaf, addr in zip(graph.inputs, addrs):
                leaf.data = addr
            for st, stride in zip(graph.stacks, strides):
                graph.set_stride(st, stride)
            graph.outputs[0].data = self._stream_addrs[turn]
            k.run(graph)
        return self._streams[turn]

    def shared_expert(self, mats: tuple[QTensor, QTensor, QTensor], gate_inp: np.ndarray) -> None:
        """Fills :attr:`shared`: sigmoid(gate_inp · h) * down(swiglu(gate h, up h)) for h = :attr:`moe_input`
        (``mats``: ffn_{gate,up,down}_shexp; ``gate_inp``: ffn_gate_inp_shexp (D,) float32)."""
        k, a = self.kernels, self._addr
        gate, down = k._mat(mats[0]), k._mat(mats[2])
        with k.lock:
            graph = k.graph(("decode-shared-expert", gate, down), 12, lambda g: _build_shared_expert(g, gate, down),
                            2 * gate.nbytes + down.nbytes)
            addrs = (self._outs[1], *(a(m.data) for m in mats), a(gate_inp))
            for leaf, addr in zip(graph.inputs, addrs):
                leaf.data = addr
            graph.outputs[0].data = self._shared_addr
            k.run(graph)

    def head(self, x: np.ndarray, norm: np.ndarray, output: QTensor) -> np.ndarray:
        """Logits (1, V): output · rms_norm(x) * output_norm; NaN when that input is not finite (as the
        per-operation backend gives, :func:`ggml_cpu._keep_non_finite`)."""
        k, eps = self.kernels, self.shape.eps
        mat = k._mat(output)
        logits = np.empty((1, mat.rows), np.float32)
        with k.lock:
            graph = k.graph(("decode-head", mat, eps), 8, lambda g: _build_head(g, mat, eps), mat.nbytes)
            for leaf, addr in zip(graph.inputs, (x.ctypes.data, self._addr(norm), self._addr(output.data))):
                leaf.data = addr
            graph.outputs[0].data = logits.ctypes.data
            graph.outputs[1].data = self._head_check_addr
            k.run(graph)
        if not np.isfinite(self._head_check[0]):
            logits[:] = np.nan
        return logits
