"""Pure NumPy kernels of the trunk: RMSNorm, NEOX RoPE, grouped-query attention,
SwiGLU and the router's softmax top-k. All float32 in, float32 out.

Shape legend: T positions, D embedding_length, H query heads, Hkv KV heads,
d head dim (key_length), S positions held in the KV cache, E expert_count,
k expert_used_count.
"""
from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: x / sqrt(mean(x²) + eps) * weight."""
    ms = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True, dtype=np.float32)
    return (x * (1.0 / np.sqrt(ms + np.float32(eps)))) * weight


def rope_cos_sin(positions: np.ndarray, head_dim: int, freq_base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables (T, d/2) for NEOX RoPE; angles computed in float64, then rounded."""
    inv_freq = freq_base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rope_neox(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate (T, heads, d) by NEOX RoPE: dimension i pairs with i + d/2 (not 2i with 2i+1)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax in float32."""
    z = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return z / np.sum(z, axis=axis, keepdims=True)


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Causal grouped-query attention.

    q: (T, H, d) for query positions ``positions`` (ascending); k_cache/v_cache:
    (S, Hkv, d) holding every key/value up to ``positions[-1]`` inclusive.
    Returns (T, H * d). Query head h reads KV head h // (H / Hkv), as ggml does.
    """
    t, n_head, d = q.shape
    s, n_kv, _ = k_cache.shape
    group = n_head // n_kv
    qg = q.reshape(t, n_kv, group, d).transpose(1, 2, 0, 3)          # (Hkv, group, T, d)
    k = k_cache.transpose(1, 2, 0)                                    # (Hkv, d, S)
    v = v_cache.transpose(1, 0, 2)                                    # (Hkv, S, d)
    scores = np.matmul(qg, k[:, None]) * np.float32(1.0 / np.sqrt(d))  # (Hkv, group, T, S)
    future = np.arange(s)[None, :] > positions[:, None]               # (T, S)
    scores = np.where(future, np.float32(-np.inf), scores)
    out = np.matmul(softmax(scores), v[:, None])                      # (Hkv, group, T, d)
    return out.transpose(2, 0, 1, 3).reshape(t, n_head * d)


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up, with silu(x) = x * sigmoid(x)."""
    with np.errstate(over="ignore"):  # exp(-x) overflows to inf for x << 0; x / inf is the right 0
        return gate / (np.float32(1.0) + np.exp(-gate)) * up


def router_top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k experts per position and their weights, renormalised to sum to 1.

    logits: (T, E) router outputs. Returns ids (T, k) int64 in descending
    probability (ties to the lower id) and weights (T, k) float32. qwen3moe in
    llama.cpp always renormalises (transformers: norm_topk_prob=True).
    """
    probs = softmax(logits.astype(np.float32), axis=-1)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, ids, axis=-1)
    return ids, (weights / np.sum(weights, axis=-1, keepdims=True)).astype(np.float32)
