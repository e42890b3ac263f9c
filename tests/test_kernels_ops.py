"""Trunk kernels against straightforward float64 references written independently."""
from __future__ import annotations

import numpy as np
import pytest

from colibri_aio.kernels.ops import (Routing, attention, near_misses, rms_norm, rope_cos_sin, rope_neox, rope_norm,
                                     route, router_top_k, selection_scores, softmax, swiglu)

rng = np.random.default_rng(7)


def test_rms_norm_matches_definition() -> None:
    x = rng.standard_normal((5, 48)).astype(np.float32)
    w = rng.standard_normal(48).astype(np.float32)
    ref = x.astype(np.float64) / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(rms_norm(x, w, 1e-6), ref, rtol=2e-6, atol=1e-6)


def test_rope_neox_rotates_half_split_pairs() -> None:
    t, heads, d, base = 4, 3, 16, 1e6
    x = rng.standard_normal((t, heads, d)).astype(np.float32)
    pos = np.array([0, 1, 7, 100])
    cos, sin = rope_cos_sin(pos, d, base)
    out = rope_neox(x, cos, sin)
    # Reference: pair (i, i + d/2) as a complex number rotated by pos * base^(-2i/d).
    z = x[..., : d // 2].astype(np.float64) + 1j * x[..., d // 2:]
    theta = pos[:, None] * base ** (-np.arange(0, d, 2) / d)
    r = z * np.exp(1j * theta)[:, None, :]
    np.testing.assert_allclose(out, np.concatenate([r.real, r.imag], -1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[0], x[0])  # position 0 is the identity


def test_rope_norm_rotates_adjacent_pairs_and_passes_the_rest() -> None:
    t, heads, d, n_rot, base = 4, 3, 16, 12, 1e4
    x = rng.standard_normal((t, heads, d)).astype(np.float32)
    pos = np.array([0, 1, 7, 100])
    cos, sin = rope_cos_sin(pos, n_rot, base)
    out = rope_norm(x, cos, sin)
    # Reference: pair (2i, 2i + 1) as a complex number rotated by pos * base^(-2i/n_rot).
    z = x[..., 0:n_rot:2].astype(np.float64) + 1j * x[..., 1:n_rot:2]
    r = z * np.exp(1j * pos[:, None] * base ** (-np.arange(0, n_rot, 2) / n_rot))[:, None, :]
    np.testing.assert_allclose(out[..., 0:n_rot:2], r.real, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[..., 1:n_rot:2], r.imag, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[..., n_rot:], x[..., n_rot:])


def test_rope_neox_rotates_only_the_first_n_rot_dims() -> None:
    x = rng.standard_normal((3, 2, 16)).astype(np.float32)
    cos, sin = rope_cos_sin(np.array([1, 5, 9]), 8, 1e6)
    out = rope_neox(x, cos, sin)
    np.testing.assert_array_equal(out[..., :8], rope_neox(x[..., :8], cos, sin))
    np.testing.assert_array_equal(out[..., 8:], x[..., 8:])


def _attention_ref(q, k, v, positions, scale=None, window=None, sinks=None):
    t, h, d = q.shape
    dv = v.shape[-1]
    group = h // k.shape[1]
    out = np.zeros((t, h, dv))
    for i in range(t):
        for head in range(h):
            kv = head // group
            first = 0 if window is None else max(0, positions[i] - window + 1)
            keys = k[first: positions[i] + 1, kv].astype(np.float64)
            s = keys @ q[i, head] * (1 / np.sqrt(d) if scale is None else scale)
            top = s.max() if sinks is None else max(s.max(), sinks[head])
            p = np.exp(s - top)
            total = p.sum() + (0.0 if sinks is None else np.exp(sinks[head] - top))
            out[i, head] = (p / total) @ v[first: positions[i] + 1, kv]
    return out.reshape(t, h * dv)


@pytest.mark.parametrize("n_head,n_kv", [(4, 2), (4, 4), (8, 1)])
def test_attention_is_causal_gqa(n_head: int, n_kv: int) -> None:
    s, d = 9, 8
    k = rng.standard_normal((s, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((s, n_kv, d)).astype(np.float32)
    positions = np.arange(5, 9)
    q = rng.standard_normal((4, n_head, d)).astype(np.float32)
    np.testing.assert_allclose(attention(q, k, v, positions), _attention_ref(q, k, v, positions), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 1, 3])
def test_attention_scale_window_sinks_and_value_width(window: int | None) -> None:
    """The options later families need: a kq scale, a sliding window, per-head sinks, dv != d."""
    s, n_head, n_kv, d, dv = 9, 4, 2, 8, 6
    k = rng.standard_normal((s, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((s, n_kv, dv)).astype(np.float32)
    q = rng.standard_normal((3, n_head, d)).astype(np.float32)
    positions, sinks = np.array([2, 6, 8]), rng.standard_normal(n_head).astype(np.float32)
    got = attention(q, k, v, positions, scale=0.3, window=window, sinks=sinks)
    np.testing.assert_allclose(got, _attention_ref(q, k, v, positions, 0.3, window, sinks), rtol=1e-5, atol=1e-5)


def test_attention_ignores_cache_rows_beyond_the_query() -> None:
    k = rng.standard_normal((6, 1, 4)).astype(np.float32)
    v = rng.standard_normal((6, 1, 4)).astype(np.float32)
    q = rng.standard_normal((1, 2, 4)).astype(np.float32)
    a = attention(q, k, v, np.array([2]))
    k[3:], v[3:] = 1e6, -1e6
    np.testing.assert_array_equal(a, attention(q, k, v, np.array([2])))


def test_swiglu_is_finite_for_large_negative_gates() -> None:
    g = np.array([-1000.0, -5.0, 0.0, 3.0], np.float32)
    u = np.array([2.0, 2.0, 2.0, 2.0], np.float32)
    with np.errstate(over="ignore"):
        ref = g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64))) * u
    np.testing.assert_allclose(swiglu(g, u), ref, rtol=1e-6, atol=1e-30)


def test_router_top_k_renormalises_and_orders() -> None:
    logits = np.array([[0.1, 2.0, -1.0, 1.5, 0.0], [3.0, 3.0, 0.0, 0.0, 5.0]], np.float32)
    ids, w = router_top_k(logits, 2)
    assert ids.tolist() == [[1, 3], [4, 0]]  # ties go to the lower id
    p = softmax(logits.astype(np.float64))
    np.testing.assert_allclose(w[0], p[0, [1, 3]] / p[0, [1, 3]].sum(), rtol=1e-6)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)


def _route_ref(logits, k, routing, bias=None):
    """llama.cpp's build_moe_ffn selection, one position at a time in float64 (fixtures/families.md)."""
    ids, weights = [], []
    for row in logits.astype(np.float64):
        probs = {"softmax": np.exp(row - row.max()) / np.exp(row - row.max()).sum(),
                 "sigmoid": 1 / (1 + np.exp(-row)), "softmax_weight": row}[routing.gating]
        sel = probs + (0 if bias is None else bias)
        if routing.group_count > 1:
            groups = sel.reshape(routing.group_count, -1)
            score = np.sort(groups, axis=1)[:, -2:].sum(1)
            keep = sorted(range(routing.group_count), key=lambda g: -score[g])[:routing.group_used]
            sel = np.where(np.repeat(np.isin(np.arange(routing.group_count), keep), groups.shape[1]), sel, -np.inf)
        chosen = sorted(range(len(row)), key=lambda e: -sel[e])[:k]
        w = probs[chosen]
        if routing.gating == "softmax_weight":
            w = np.exp(w - w.max()) / np.exp(w - w.max()).sum()
        if routing.normalize:
            w = w / max(w.sum(), 6.103515625e-5)
        if routing.scale not in (0, 1):
            w = w * routing.scale
        ids.append(chosen)
        weights.append(w)
    return np.array(ids), np.array(weights)


@pytest.mark.parametrize("routing,with_bias", [
    (Routing(normalize=False), False),                                        # qwen2moe, olmoe
    (Routing(), False),                                                       # qwen3moe, Mixtral
    (Routing("sigmoid", normalize=True, scale=2.5, group_count=4, group_used=2), True),  # deepseek-v3
    (Routing("sigmoid", normalize=True, scale=2.5), True),                    # glm4moe
    (Routing("softmax_weight", normalize=False), False),                      # gpt-oss
])
def test_route_follows_llamacpp_selection(routing: Routing, with_bias: bool) -> None:
    logits = rng.standard_normal((6, 12)).astype(np.float32) * 2
    bias = rng.standard_normal(12).astype(np.float32) if with_bias else None
    ids, w = route(logits, 3, routing, bias)
    ref_ids, ref_w = _route_ref(logits, 3, routing, bias)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(w, ref_w, rtol=1e-5)
    assert w.dtype == np.float32
    # The lookahead ranks experts in the order routing picks them (before group limits).
    if routing.group_count == 1:
        np.testing.assert_array_equal(np.argsort(-selection_scores(logits, routing, bias), axis=-1,
                                                 kind="stable")[:, :3], ids)


def test_groups_exclude_the_best_expert_of_a_weak_group() -> None:
    # Group 1 holds the single best expert (3), but its two best sum lower than groups 0 and 3 do.
    logits = np.array([[2.0, 2.0, 0.0, 5.0, -9.0, -9.0, 2.5, 2.5]], np.float32)
    ids, _ = route(logits, 2, Routing("sigmoid", group_count=4, group_used=2))
    assert 3 not in ids[0] and set(ids[0]) <= {0, 1, 6, 7}


@pytest.mark.parametrize("routing,with_bias", [
    (Routing(), False),                                                       # qwen3moe
    (Routing("sigmoid", normalize=True, scale=2.5), True),                    # glm4moe
])
def test_near_misses_are_the_next_k_by_selection_score(routing: Routing, with_bias: bool) -> None:
    logits = rng.standard_normal((7, 16)).astype(np.float32) * 2
    bias = rng.standard_normal(16).astype(np.float32) if with_bias else None
    ids, _ = route(logits, 3, routing, bias)
    order = np.argsort(-selection_scores(logits, routing, bias), axis=-1, kind="stable")
    got = near_misses(logits, ids, routing, bias)
    assert len(got) == 7 * 3
    assert sorted(got.tolist()) == sorted(order[:, 3:6].ravel().tolist())
    assert sorted(near_misses(logits[:2, :5], route(logits[:2, :5], 3)[0]).tolist()) == sorted(
        np.argsort(-logits[:2, :5], axis=-1, kind="stable")[:, 3:].ravel().tolist())   # fewer than 2k experts


def test_near_misses_under_a_group_limit_name_the_best_it_passed_over() -> None:
    # Expert 3 is the best by score, but its group loses: the group limit routes past it, so it is named.
    logits = np.array([[2.0, 2.0, 0.0, 5.0, -9.0, -9.0, 2.5, 2.5]], np.float32)
    routing = Routing("sigmoid", group_count=4, group_used=2)
    ids, _ = route(logits, 2, routing)
    assert 3 in near_misses(logits, ids, routing).tolist()
