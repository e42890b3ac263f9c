"""The dense part of a MoE transformer block, described once and run by any kernel backend.

A block is: combine the previous block's experts (or take the embeddings),
attention (pre-norm, q/k/v, optional per-head q/k norm, RoPE, causal
grouped-query attention over the KV cache, output projection, residual),
then the FFN norm and the router (softmax, top-k, renormalised). What varies
between families is data (:class:`AttentionSpec`), not code; the routed
experts stay outside (the expert source delivers them, ``expert_ffns`` runs
them into :attr:`Routed.contrib`).

:func:`numpy_attention_router` and :func:`numpy_logits` are the reference;
the ggml backend builds the same computation as one graph per block.

Shape legend: T positions, D embedding, H heads, Hkv KV heads, d head dim,
E experts, k experts per position, S context positions, V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from colibri_aio.kernels.ops import attention, rms_norm, rope_cos_sin, rope_neox, router_top_k
from colibri_aio.kernels.qtensor import QTensor

__all__ = ["AttentionSpec", "BlockInput", "DenseWeights", "Routed", "numpy_attention_router", "numpy_logits",
           "RopeTables", "scatter"]


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """What the dense block of a family needs to know: sizes, norms, RoPE and routing."""

    n_head: int
    n_head_kv: int
    head_dim: int
    rms_eps: float
    rope_base: float
    qk_norm: bool
    n_expert: int
    top_k: int


class DenseWeights(Protocol):
    """A block's resident weights (colibri_aio.gguf.model.BlockWeights has them)."""

    attn_norm: np.ndarray      # (D,)
    attn_q: QTensor            # (H*d, D)
    attn_k: QTensor            # (Hkv*d, D)
    attn_v: QTensor            # (Hkv*d, D)
    attn_q_norm: np.ndarray    # (d,)
    attn_k_norm: np.ndarray    # (d,)
    attn_output: QTensor       # (D, H*d)
    ffn_norm: np.ndarray       # (D,)
    ffn_gate_inp: np.ndarray   # (E, D) float32


@dataclass(slots=True)
class Routed:
    """A block after attention and routing, waiting for its experts.

    ``contrib[t, r]`` receives the output of the expert ranked r for position
    t; the block's output is ``residual + sum over r of weights[:, r] *
    contrib[:, r]``, which the next block (or the logits) computes. A
    backend may return views of buffers it reuses: they are valid until the
    same block runs again.
    """

    x: np.ndarray          # (T, D) the block's input
    residual: np.ndarray   # (T, D) x + attention
    moe_input: np.ndarray  # (T, D) ffn_norm(residual): what the experts multiply
    ids: np.ndarray        # (T, k) routed experts, highest weight first
    weights: np.ndarray    # (T, k) float32, summing to 1 per position
    contrib: np.ndarray    # (T, k, D) float32, filled by expert_ffns

    def output(self) -> np.ndarray:
        """The block's output (NumPy): residual + the experts' outputs weighted, summed in rank order."""
        return self.residual + (self.contrib * self.weights[:, :, None]).sum(axis=1)


BlockInput = np.ndarray | Routed  # embeddings (T, D), or the previous block still to be combined


def scatter(contrib: np.ndarray, cells: list, out: np.ndarray, t: int) -> None:
    """Expert outputs stacked in batch order (``out``) into their (position, rank) cells of ``contrib``;
    ``cells[i]``: expert i's rank (one position) or its (positions, ranks) arrays."""
    if t == 1:
        contrib[0, cells] = out
    else:
        contrib[np.concatenate([p for p, _ in cells]), np.concatenate([r for _, r in cells])] = out


def block_input(x: BlockInput) -> np.ndarray:
    return x.output() if isinstance(x, Routed) else x


class RopeTables:
    """cos/sin tables of the positions last asked for (every block of a step shares them)."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.tables: tuple[np.ndarray, np.ndarray] | None = None

    def get(self, positions: np.ndarray, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
        key = (positions.tobytes(), head_dim, base)
        if key != self.key:
            self.key, self.tables = key, rope_cos_sin(positions, head_dim, base)
        return self.tables


def numpy_attention_router(kernels, spec: AttentionSpec, w: DenseWeights, x: BlockInput, positions: np.ndarray,
                           k_cache: np.ndarray, v_cache: np.ndarray, rope: RopeTables) -> Routed:
    """The reference dense block; ``k_cache``/``v_cache`` (S, Hkv, d) of this block, written at ``positions``.

    ``kernels`` runs the products (q/k/v in one ``linears`` call).
    """
    x = block_input(x)
    t, d = x.shape[0], spec.head_dim
    cos, sin = rope.get(positions, d, spec.rope_base)
    h = rms_norm(x, w.attn_norm, spec.rms_eps)
    q, k, v = kernels.linears((w.attn_q, w.attn_k, w.attn_v), h)
    q, k = q.reshape(t, spec.n_head, d), k.reshape(t, spec.n_head_kv, d)
    if spec.qk_norm:
        q, k = rms_norm(q, w.attn_q_norm, spec.rms_eps), rms_norm(k, w.attn_k_norm, spec.rms_eps)
    q, k = rope_neox(q, cos, sin), rope_neox(k, cos, sin)
    k_cache[positions] = k
    v_cache[positions] = v.reshape(t, spec.n_head_kv, d)
    s = int(positions[-1]) + 1
    o = attention(q, k_cache[:s], v_cache[:s], positions)
    residual = x + kernels.linear(w.attn_output, o)
    moe_input = rms_norm(residual, w.ffn_norm, spec.rms_eps)
    ids, weights = router_top_k(moe_input @ w.ffn_gate_inp.T, spec.top_k)
    contrib = np.empty((t, spec.top_k, x.shape[1]), np.float32)
    return Routed(x, residual, moe_input, ids, weights, contrib)


def numpy_logits(kernels, norm: np.ndarray, output: QTensor, x: BlockInput, eps: float,
                 rows: Literal["last", "all"]) -> np.ndarray:
    """Final norm and output head: (V,) for the last position or (T, V) for all; a fresh array."""
    x = block_input(x)
    x = x if rows == "all" else x[-1:]
    out = kernels.linear(output, rms_norm(x, norm, eps))
    return out if rows == "all" else out[0]
