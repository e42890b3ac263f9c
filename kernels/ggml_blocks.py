"""The dense part of a block (:mod:`.blocks`) as one ggml graph, and the final norm + output head.

One graph per block computes, from the previous block's pieces: the
combination of its experts (``residual + sum_r weights_r * contrib_r``, in
rank order), RMSNorm, q/k/v, per-head q/k norm, NEOX RoPE, the KV-cache store
(``set_rows`` at the positions), causal grouped-query flash attention over
the cache, the output projection and residual, the FFN norm, and the router
(softmax, top-k by argsort, weights renormalised) -- the same operations, in
the same order, as llama.cpp's qwen3moe graph. Python then only reads the
routed ids, fetches the experts and runs them into ``contrib``.

The attention reads the KV cache through a view of ``S_kv`` positions, the
context rounded up to a multiple of :data:`KV_STEP` (positions not yet
written are masked with -inf), so one graph serves 256 decode steps.

Builders here only make tensors; :class:`~.ggml_cpu.GgmlKernels` decides
which graphs to keep, owns their memory and runs them.
"""
from __future__ import annotations

import math

import ggml.ggml as G

KV_STEP = 256             # the attention's view of the cache grows by this many positions
_F32, _F16, _I32 = G.GGML_TYPE_F32, G.GGML_TYPE_F16, G.GGML_TYPE_I32


def kv_span(last_position: int, n_ctx: int) -> int:
    """Cache positions the attention reads: the context rounded up to KV_STEP, at most n_ctx."""
    return min(n_ctx, -(-(last_position + 1) // KV_STEP) * KV_STEP)


def combine(g, d: int, k: int, t: int):
    """Inputs residual (D, T), contrib (D, k, T), weights (1, k, T) -> residual + sum_r w_r * contrib_r.

    The sum runs in rank order, so it does not depend on which expert arrived first.
    """
    residual = g.tensor(_F32, (d, t))
    contrib = g.tensor(_F32, (d, k, t))
    weights = g.tensor(_F32, (1, k, t))
    weighted = G.ggml_mul(g.ctx, contrib, weights)
    x = residual
    for r in range(k):
        part = G.ggml_view_2d(g.ctx, weighted, d, t, weighted.contents.nb[2], r * weighted.contents.nb[1])
        x = G.ggml_add(g.ctx, x, part)
    return x


def rms_norm(g, x, weight, eps: float):
    return G.ggml_mul(g.ctx, G.ggml_rms_norm(g.ctx, x, eps), weight)


def block(g, spec, w, x, t: int, pos, mask, k_cache, v_cache, s_kv: int):
    """Attention and routing of one block on ``x`` (D, T); returns (residual, moe_input, ids, weights)
    and the two KV stores (nodes that only write into the cache).

    ``w`` holds the block's weights as fixed leaves (``attn_norm`` ... ``ffn_gate_inp``),
    ``pos`` I32 (T), ``mask`` F16 (S_kv, T), ``k_cache``/``v_cache`` fixed (Hkv*d, n_ctx) leaves.
    """
    ctx, d, hq, hkv = g.ctx, spec.head_dim, spec.n_head, spec.n_head_kv
    h = rms_norm(g, x, w["attn_norm"], spec.rms_eps)
    q = G.ggml_reshape_3d(ctx, G.ggml_mul_mat(ctx, w["attn_q"], h), d, hq, t)
    k = G.ggml_reshape_3d(ctx, G.ggml_mul_mat(ctx, w["attn_k"], h), d, hkv, t)
    v = G.ggml_mul_mat(ctx, w["attn_v"], h)
    if spec.qk_norm:
        q, k = rms_norm(g, q, w["attn_q_norm"], spec.rms_eps), rms_norm(g, k, w["attn_k_norm"], spec.rms_eps)
    q, k = (G.ggml_rope_ext(ctx, a, pos, None, d, G.GGML_ROPE_TYPE_NEOX, 0, spec.rope_base, 1.0, 0.0, 1.0, 32.0, 1.0)
            for a in (q, k))
    stores = [G.ggml_set_rows(ctx, k_cache, G.ggml_reshape_2d(ctx, k, hkv * d, t), pos),
              G.ggml_set_rows(ctx, v_cache, v, pos)]
    row = hkv * d * 4
    keys = G.ggml_permute(ctx, G.ggml_view_3d(ctx, k_cache, d, hkv, s_kv, d * 4, row, 0), 0, 2, 1, 3)
    values = G.ggml_permute(ctx, G.ggml_view_3d(ctx, v_cache, d, hkv, s_kv, d * 4, row, 0), 0, 2, 1, 3)
    o = G.ggml_flash_attn_ext(ctx, G.ggml_permute(ctx, q, 0, 2, 1, 3), keys, values, mask,
                              1.0 / math.sqrt(d), 0.0, 0.0)                               # (d, H, T)
    residual = G.ggml_add(ctx, x, G.ggml_mul_mat(ctx, w["attn_output"], G.ggml_reshape_2d(ctx, o, hq * d, t)))
    moe_input = rms_norm(g, residual, w["ffn_norm"], spec.rms_eps)
    probs = G.ggml_soft_max(ctx, G.ggml_mul_mat(ctx, w["ffn_gate_inp"], moe_input))        # (E, T)
    order = G.ggml_argsort(ctx, probs, G.GGML_SORT_ORDER_DESC)
    ids = G.ggml_cont(ctx, G.ggml_view_2d(ctx, order, spec.top_k, t, order.contents.nb[1], 0))
    chosen = G.ggml_reshape_2d(ctx, G.ggml_get_rows(ctx, G.ggml_reshape_3d(ctx, probs, 1, spec.n_expert, t), ids),
                               spec.top_k, t)
    weights = G.ggml_div(ctx, chosen, G.ggml_sum_rows(ctx, chosen))
    return (residual, moe_input, ids, weights), stores


def logits(g, x, t: int, last: bool, norm, output, eps: float):
    """Final RMSNorm and output head on ``x`` (D, T), a computed tensor: (V, 1) for the last position
    or (V, T)."""
    if last and t > 1:
        x = G.ggml_view_2d(g.ctx, x, x.contents.ne[0], 1, x.contents.nb[1], (t - 1) * x.contents.nb[1])
    return G.ggml_mul_mat(g.ctx, output, rms_norm(g, x, norm, eps))
