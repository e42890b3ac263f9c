"""Trunk kernels against straightforward float64 references written independently."""
from __future__ import annotations

import numpy as np
import pytest

from colibri_aio.kernels.ops import attention, rms_norm, rope_cos_sin, rope_neox, router_top_k, softmax, swiglu

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


def _attention_ref(q, k, v, positions):
    t, h, d = q.shape
    group = h // k.shape[1]
    out = np.zeros((t, h, d))
    for i in range(t):
        for head in range(h):
            kv = head // group
            keys = k[: positions[i] + 1, kv].astype(np.float64)
            s = keys @ q[i, head] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[i, head] = (p / p.sum()) @ v[: positions[i] + 1, kv]
    return out.reshape(t, h * d)


@pytest.mark.parametrize("n_head,n_kv", [(4, 2), (4, 4), (8, 1)])
def test_attention_is_causal_gqa(n_head: int, n_kv: int) -> None:
    s, d = 9, 8
    k = rng.standard_normal((s, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((s, n_kv, d)).astype(np.float32)
    positions = np.arange(5, 9)
    q = rng.standard_normal((4, n_head, d)).astype(np.float32)
    np.testing.assert_allclose(attention(q, k, v, positions), _attention_ref(q, k, v, positions), rtol=1e-5, atol=1e-5)


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
