"""Pure NumPy kernels of the trunk: RMSNorm, RoPE (NEOX and NORM, YaRN tables), grouped-query
attention, SwiGLU and the router (llama.cpp's ``build_moe_ffn`` selection). All
float32 in, float32 out.

Shape legend: T positions, D embedding_length, H query heads, Hkv KV heads,
d head dim (key_length), dv value head dim, S positions held in the KV cache,
E expert_count, k expert_used_count, n_rot rotated dims of a head.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: x / sqrt(mean(x²) + eps) * weight."""
    ms = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True, dtype=np.float32)
    return (x * (1.0 / np.sqrt(ms + np.float32(eps)))) * weight


def rope_cos_sin(positions: np.ndarray, n_rot: int, freq_base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables (T, n_rot/2) of angle pos * base^(-2i/n_rot); float64 angles, then rounded.

    Scaled variants (YaRN, frequency factors) build their own tables of the same shape.
    """
    inv_freq = freq_base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rope_yarn_cos_sin(positions: np.ndarray, n_rot: int, freq_base: float, *, factor: float,
                      original_context: int, beta_fast: float = 32.0, beta_slow: float = 1.0,
                      magnitude: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables (T, n_rot/2) of YaRN-scaled RoPE as ggml computes them (``rope_yarn``).

    Each frequency blends its interpolated angle (θ / factor) with the original one by a
    ramp over the rotary dims: ``ramp(i) = 1 - clamp((i - low) / max(0.001, high - low), 0, 1)``
    where ``low``/``high`` are ggml's correction dims, floored/ceiled and clamped to
    [0, n_rot - 1]. ``magnitude`` multiplies cos and sin (ggml's mscale after its own YaRN factor:
    families pass what their graph leaves, e.g. 1 for deepseek2, 1 + 0.1 ln(factor) for gpt-oss).
    """
    def corr_dim(beta: float) -> float:
        return n_rot * math.log(original_context / (beta * 2 * math.pi)) / (2 * math.log(freq_base))

    low = max(0.0, math.floor(corr_dim(beta_fast)))
    high = min(n_rot - 1.0, math.ceil(corr_dim(beta_slow)))
    i = np.arange(n_rot // 2, dtype=np.float64)
    ramp = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)     # 1: keep θ, 0: θ / factor
    inv_freq = freq_base ** (-2.0 * i / n_rot)
    inv_freq = inv_freq / factor * (1.0 - ramp) + inv_freq * ramp
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    return ((np.cos(angles) * magnitude).astype(np.float32), (np.sin(angles) * magnitude).astype(np.float32))


def rope_neox(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate (T, heads, d) by NEOX RoPE: dimension i pairs with i + n_rot/2 (not 2i with 2i+1).

    n_rot = 2 * cos.shape[-1]; dimensions from n_rot on pass through (partial rotary).
    """
    half = cos.shape[-1]
    if 2 * half < x.shape[-1]:
        return np.concatenate([rope_neox(x[..., :2 * half], cos, sin), x[..., 2 * half:]], axis=-1)
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def rope_norm(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate (T, heads, d) by NORM RoPE (ggml's default, llama's): dimension 2i pairs with 2i+1.

    n_rot = 2 * cos.shape[-1]; dimensions from n_rot on pass through.
    """
    n_rot = 2 * cos.shape[-1]
    x1, x2 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(x)
    out[..., 0:n_rot:2] = x1 * c - x2 * s
    out[..., 1:n_rot:2] = x2 * c + x1 * s
    out[..., n_rot:] = x[..., n_rot:]
    return out


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax in float32."""
    z = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return z / np.sum(z, axis=axis, keepdims=True)


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, positions: np.ndarray, *,
              scale: float | None = None, window: int | None = None, sinks: np.ndarray | None = None,
              key_positions: np.ndarray | None = None, chunked: bool = False) -> np.ndarray:
    """Causal grouped-query attention.

    q: (T, H, d) for query positions ``positions`` (ascending); k_cache: (S, Hkv, d),
    v_cache: (S, Hkv, dv), the keys/values at ``key_positions`` (S,) (default 0..S-1:
    every position up to ``positions[-1]`` inclusive). Returns (T, H * dv).
    Query head h reads KV head h // (H / Hkv), as ggml does.
    ``scale``: the factor on q·k (default 1/sqrt(d)). ``window``: a sliding window,
    a query at p sees keys at p' with p - p' < window. ``sinks``: (H,) one extra
    logit per head in the softmax's denominator (it takes mass, adds no value).
    ``chunked``: the window is a chunk instead (llama.cpp's chunked SWA), a query at p sees keys at
    p' >= (p // window) * window.
    """
    t, n_head, d = q.shape
    s, n_kv, dv = v_cache.shape
    group = n_head // n_kv
    qg = q.reshape(t, n_kv, group, d).transpose(1, 2, 0, 3)          # (Hkv, group, T, d)
    k = k_cache.transpose(1, 2, 0)                                    # (Hkv, d, S)
    v = v_cache.transpose(1, 0, 2)                                    # (Hkv, S, dv)
    factor = np.float32(1.0 / np.sqrt(d) if scale is None else scale)
    scores = np.matmul(qg, k[:, None]) * factor                       # (Hkv, group, T, S)
    kpos = np.arange(s) if key_positions is None else key_positions
    hidden = kpos[None, :] > positions[:, None]                       # (T, S): the future
    if window is not None and chunked:
        hidden |= kpos[None, :] < (positions // window * window)[:, None]
    elif window is not None:
        hidden |= positions[:, None] - kpos[None, :] >= window
    scores = np.where(hidden, np.float32(-np.inf), scores)
    if sinks is None:
        probs = softmax(scores)
    else:
        sink = sinks.astype(np.float32).reshape(n_kv, group, 1, 1)
        top = np.maximum(np.max(scores, axis=-1, keepdims=True), sink)
        z = np.exp(scores - top)
        probs = z / (np.sum(z, axis=-1, keepdims=True) + np.exp(sink - top))
    out = np.matmul(probs, v[:, None])                                # (Hkv, group, T, dv)
    return out.transpose(2, 0, 1, 3).reshape(t, n_head * dv)


def attention_temperature(positions: np.ndarray, floor_scale: int, scale: float,
                          offset: float = 1.0) -> np.ndarray:
    """(T,) 1 + scale * ln(floor((p + offset) / floor_scale) + 1) of each position p: llama4's
    temperature on the queries of its NoPE layers (llama.cpp's attn_scale input), float64 then rounded."""
    p = positions.astype(np.float64)
    return (np.log(np.floor((p + offset) / floor_scale) + 1.0) * scale + 1.0).astype(np.float32)


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up, with silu(x) = x * sigmoid(x)."""
    with np.errstate(over="ignore"):  # exp(-x) overflows to inf for x << 0; x / inf is the right 0
        return gate / (np.float32(1.0) + np.exp(-gate)) * up


# gpt-oss's clamped SwiGLU: the slope of its sigmoid and the clamp of its inputs (ggml's swiglu_oai takes them too).
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


def swiglu_oai(gate: np.ndarray, up: np.ndarray, alpha: float = SWIGLU_OAI_ALPHA,
               limit: float = SWIGLU_OAI_LIMIT) -> np.ndarray:
    """gpt-oss's clamped SwiGLU (ggml's ``swiglu_oai``): g = min(gate, limit), u = clamp(up, ±limit),
    g * sigmoid(alpha * g) * (u + 1)."""
    g = np.minimum(gate, np.float32(limit))
    u = np.clip(up, np.float32(-limit), np.float32(limit))
    with np.errstate(over="ignore"):
        return g / (np.float32(1.0) + np.exp(np.float32(-alpha) * g)) * (u + np.float32(1.0))


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)) in float32 (exp overflow for x << 0 gives the right 0)."""
    with np.errstate(over="ignore"):
        return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


@dataclass(frozen=True, slots=True)
class Routing:
    """How router logits become k experts and their weights: llama.cpp's ``build_moe_ffn``.

    ``gating``: ``softmax`` or ``sigmoid`` turn logits into probabilities, which
    select (plus a selection bias, when the layer has one) and weigh the experts;
    ``softmax_weight`` selects on the raw logits and weighs by a softmax over the
    k chosen logits. ``normalize``: weights divided by their sum. ``scale``:
    weights multiplied by it (0 and 1: unscaled). ``group_count`` > 1: only the
    experts of the ``group_used`` best groups (E/group_count consecutive experts,
    scored by the sum of their two best selection values) can be chosen.
    """

    gating: Literal["softmax", "sigmoid", "softmax_weight"] = "softmax"
    normalize: bool = True
    scale: float = 1.0
    group_count: int = 1
    group_used: int = 1


# llama.cpp clamps the sum of the top-k weights from below before dividing by it.
MIN_WEIGHT_SUM = np.float32(6.103515625e-5)


def _probabilities(logits: np.ndarray, routing: Routing) -> np.ndarray:
    if routing.gating == "softmax":
        return softmax(logits, axis=-1)
    if routing.gating == "sigmoid":
        return sigmoid(logits)
    return logits


def selection_scores(logits: np.ndarray, routing: Routing, bias: np.ndarray | None = None) -> np.ndarray:
    """(T, E) scores whose order is the order experts are chosen in (before any group limit).

    For softmax gating the logits themselves (softmax keeps their order).
    """
    logits = logits.astype(np.float32, copy=False)
    if routing.gating == "softmax" and bias is None:
        return logits
    probs = _probabilities(logits, routing)
    return probs if bias is None else probs + bias


def near_misses(logits: np.ndarray, chosen: np.ndarray, routing: Routing = Routing(),
                bias: np.ndarray | None = None) -> np.ndarray:
    """The experts each position's router ranked just past the ``k`` it chose (``chosen`` (T, k)): of its 2k
    best by selection score, those it did not choose, flattened (k a position, more where a group limit chose
    past them). A warm start's ranking, not a routing: the group limit is not applied, and argpartition leaves
    the 2k unordered."""
    k = chosen.shape[1]
    scores = selection_scores(logits, routing, bias)
    n = min(2 * k, scores.shape[1])
    best = np.argpartition(-scores, n - 1, axis=1)[:, :n]
    return best[~(best[:, :, None] == chosen[:, None, :]).any(axis=2)]


def _limit_groups(selection: np.ndarray, routing: Routing) -> np.ndarray:
    """Selection with every expert outside the ``group_used`` best groups at -inf."""
    t, e = selection.shape
    groups = selection.reshape(t, routing.group_count, e // routing.group_count)
    score = np.sort(groups, axis=-1)[..., -2:].sum(axis=-1)                  # (T, groups)
    best = np.argsort(-score, axis=-1, kind="stable")[:, :routing.group_used]
    dropped = np.ones(score.shape, bool)
    np.put_along_axis(dropped, best, False, axis=-1)
    return np.where(np.repeat(dropped, e // routing.group_count, axis=-1), np.float32(-np.inf), selection)


def route(logits: np.ndarray, k: int, routing: Routing = Routing(),
          bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The k experts of each position and their weights.

    logits: (T, E) router outputs; ``bias``: (E,) selection bias (``exp_probs_b``).
    Returns ids (T, k) int64 in descending selection score (ties to the lower id)
    and weights (T, k) float32.
    """
    logits = logits.astype(np.float32, copy=False)
    probs = _probabilities(logits, routing)
    selection = probs if bias is None else probs + bias
    if routing.group_count > 1:
        selection = _limit_groups(selection, routing)
    ids = np.argsort(-selection, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, ids, axis=-1)
    if routing.gating == "softmax_weight":
        weights = softmax(weights, axis=-1)
    if routing.normalize:
        weights = weights / np.maximum(np.sum(weights, axis=-1, keepdims=True), MIN_WEIGHT_SUM)
    if routing.scale not in (0.0, 1.0):
        weights = weights * np.float32(routing.scale)
    return ids, weights.astype(np.float32, copy=False)


def router_top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Softmax top-k with the k weights renormalised to sum to 1 (qwen3moe's and Mixtral's routing)."""
    return route(logits, k, Routing())


# --- gated DeltaNet (qwen3next's linear attention): llama.cpp's ssm_conv and gated_delta_net ---------------

def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x)."""
    return x * sigmoid(x)


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + e^x), and x itself above 20 (ggml's and torch's threshold)."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0)))).astype(np.float32)


def l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(sum(x²) + eps) over the last axis (llama.cpp's RMSNorm with eps/n, divided by sqrt(n))."""
    ss = np.sum(np.square(x, dtype=np.float32), axis=-1, keepdims=True, dtype=np.float32)
    return x * (1.0 / np.sqrt(ss + np.float32(eps)))


def causal_conv(x: np.ndarray, state: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A depthwise causal convolution over positions, continued from ``state``.

    x (T, C) this call's inputs; state (C, K-1) the last K-1 inputs before them (zeros at the start);
    weight (C, K), tap K-1 on the newest input. Returns the outputs (T, C), out[t, c] =
    sum_j weight[c, j] * window[c, t + j] over the window state ++ x, and the new state: the window's
    last K-1 inputs.
    """
    window = np.concatenate([state, x.T], axis=1)                         # (C, K-1+T)
    taps = weight.shape[1]
    out = np.zeros((x.shape[0], x.shape[1]), np.float32)
    for j in range(taps):                                                  # K taps, each a vector op
        out += (window[:, j: j + x.shape[0]] * weight[:, j: j + 1]).T
    return out, np.ascontiguousarray(window[:, window.shape[1] - (taps - 1):])


def gated_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                     state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule, one position after another, as ggml's gated_delta_net computes it.

    q, k (T, H, dk), v (T, H, dv), g (T, H) log-decay, beta (T, H), state (H, dv, dk): row j of head h
    is column j of the key-to-value map S. Per position: S ← S·e^g; δ = (v − Sᵀk)·β; S ← S + k δᵀ;
    out = Sᵀq / sqrt(dv). Returns out (T, H, dv) and the new state.
    """
    s = state.copy()
    out = np.empty(v.shape, np.float32)
    scale = np.float32(1.0 / math.sqrt(v.shape[-1]))
    decay = np.exp(g).astype(np.float32)
    for t in range(q.shape[0]):                                            # a recurrence over positions
        s *= decay[t][:, None, None]
        delta = (v[t] - np.einsum("hjk,hk->hj", s, k[t])) * beta[t][:, None]
        s += delta[:, :, None] * k[t][:, None, :]
        out[t] = np.einsum("hjk,hk->hj", s, q[t]) * scale
    return out, s
