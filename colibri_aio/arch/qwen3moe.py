"""The qwen3moe family: prefill and one-token decode over a preallocated KV cache.

Routed experts arrive through an :class:`~colibri_aio.experts.ExpertSource`, so
this file never knows whether their bytes came from mmap, RAM or io_uring.

Shape legend: T positions in this call, D embedding_length, H head_count,
Hkv head_count_kv, d key_length, E expert_count, k expert_used_count,
V vocab_size, S context positions held in the KV cache.
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import aclosing
from typing import Literal, Protocol

import numpy as np

from colibri_aio.errors import UserError
from colibri_aio.experts import ExpertSource
from colibri_aio.gguf.model import Model
from colibri_aio.kernels.backend import Kernels, NumpyKernels
from colibri_aio.kernels.ops import attention, rms_norm, rope_cos_sin, rope_neox, router_top_k
from colibri_aio.kernels.qtensor import QTensor
from colibri_aio.arch.lookahead import predictor_state, rank_experts


class RouteObserver(Protocol):
    """Receives every routing decision (used by ``trace`` and the lookahead predictor)."""

    def on_layer_input(self, layer: int, x: np.ndarray) -> None:
        """``x``: (T, D) the residual stream entering block ``layer``."""

    def on_route(self, layer: int, positions: np.ndarray, residual: np.ndarray,
                 moe_input: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> None:
        """``residual``: (T, D) post-attention residual; ``moe_input``: (T, D) after ffn_norm;
        ``ids``/``weights``: (T, k) chosen experts in descending weight."""


def embed_rows(kernels: Kernels, token_embd: QTensor, ids: np.ndarray) -> np.ndarray:
    """Rows of the token embedding for ``ids``, dequantised: (T, D)."""
    table = token_embd.data.reshape(token_embd.rows, -1)        # (V, bytes per row)
    rows = np.ascontiguousarray(table[ids]).reshape(-1)
    return kernels.dequantize(QTensor(rows, token_embd.ggml_type, (len(ids), token_embd.cols)))


# Positions per forward step of a long prompt: bounds activation memory (and the
# attention scores), while keeping batch-union wide enough to read each expert once.
PREFILL_CHUNK = 256


class KVCache:
    """Keys and values of every layer for up to ``n_ctx`` positions, allocated once."""

    def __init__(self, n_layer: int, n_ctx: int, n_kv: int, head_dim: int) -> None:
        self.n_ctx = n_ctx
        self.k = np.zeros((n_layer, n_ctx, n_kv, head_dim), np.float32)
        self.v = np.zeros((n_layer, n_ctx, n_kv, head_dim), np.float32)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class Qwen3MoE:
    """A qwen3moe model bound to an expert source, a kernel backend and a KV cache.

    ``kernels`` runs every product (default: the NumPy reference kernels).
    """

    def __init__(self, model: Model, experts: ExpertSource, n_ctx: int | None = None,
                 kernels: Kernels | None = None) -> None:
        a = model.args
        self.model, self.args, self.experts = model, a, experts
        self.kernels: Kernels = kernels if kernels is not None else NumpyKernels()
        self.n_ctx = min(n_ctx or a.context_length, a.context_length)
        self.cache = KVCache(a.block_count, self.n_ctx, a.head_count_kv, a.key_length)
        self.n_past = 0
        # The hidden state that predicts the next layer's experts (see trace.PREDICTORS); None = off.
        self.lookahead: str | None = None

    async def prefill(self, ids: Sequence[int], *, logits: Literal["last", "all"] = "last",
                      observer: RouteObserver | None = None) -> np.ndarray:
        """``forward`` over ``ids`` in chunks of PREFILL_CHUNK positions; logits as ``forward`` gives them."""
        rows = [await self.forward(ids[s: s + PREFILL_CHUNK], logits=logits, observer=observer)
                for s in range(0, len(ids), PREFILL_CHUNK)]
        if not rows:
            raise UserError("forward needs at least one token")
        return np.concatenate(rows, axis=0) if logits == "all" else rows[-1]

    def reset(self) -> None:
        """Forget the context (the KV cache memory is kept and overwritten)."""
        self.n_past = 0

    async def forward(self, ids: Sequence[int], *, logits: Literal["last", "all"] = "last",
                      observer: RouteObserver | None = None) -> np.ndarray:
        """Run ``ids`` at positions n_past.. and return logits: (V,) for the last or (T, V) for all."""
        a = self.args
        tok = np.asarray(ids, dtype=np.int64)
        if tok.size == 0:
            raise UserError("forward needs at least one token")
        if tok.min() < 0 or tok.max() >= a.vocab_size:
            raise UserError(f"token id out of range [0, {a.vocab_size})")
        if self.n_past + tok.size > self.n_ctx:
            raise UserError(f"context full: {self.n_past} + {tok.size} tokens > n_ctx {self.n_ctx}")
        self.experts.step(tok.size)
        positions = np.arange(self.n_past, self.n_past + tok.size)
        cos, sin = rope_cos_sin(positions, a.key_length, a.rope_freq_base)
        x = embed_rows(self.kernels, self.model.token_embd, tok)                  # (T, D)
        for layer in range(a.block_count):
            if observer is not None:
                observer.on_layer_input(layer, x)
            layer_input = x
            x = x + self._attention(layer, rms_norm(x, self.model.blocks[layer].attn_norm, a.rms_eps),
                                    positions, cos, sin)
            h = rms_norm(x, self.model.blocks[layer].ffn_norm, a.rms_eps)
            x = x + await self._moe(layer, h, positions, layer_input, x, observer)
        self.n_past += tok.size
        rows = x if logits == "all" else x[-1:]
        out = self.kernels.linear(self.model.output, rms_norm(rows, self.model.output_norm, a.rms_eps))
        return out if logits == "all" else out[0]

    def _attention(self, layer: int, h: np.ndarray, positions: np.ndarray,
                   cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        a, blk, t = self.args, self.model.blocks[layer], h.shape[0]
        q, k, v = self.kernels.linears((blk.attn_q, blk.attn_k, blk.attn_v), h)
        q = q.reshape(t, a.head_count, a.key_length)
        k = k.reshape(t, a.head_count_kv, a.key_length)
        v = v.reshape(t, a.head_count_kv, a.value_length)
        q = rope_neox(rms_norm(q, blk.attn_q_norm, a.rms_eps), cos, sin)
        k = rope_neox(rms_norm(k, blk.attn_k_norm, a.rms_eps), cos, sin)
        self.cache.k[layer, positions] = k
        self.cache.v[layer, positions] = v
        s = int(positions[-1]) + 1
        o = attention(q, self.cache.k[layer, :s], self.cache.v[layer, :s], positions)
        return self.kernels.linear(blk.attn_output, o)

    async def _moe(self, layer: int, h: np.ndarray, positions: np.ndarray, layer_input: np.ndarray,
                   residual: np.ndarray, observer: RouteObserver | None) -> np.ndarray:
        """Route, fetch each unique expert once (batch-union), and sum in routing order.

        Experts arrive in batches, in whatever order the source delivers them
        (the cached ones first, then misses as their reads land); a batch is
        computed by one kernel call. Each expert's weighted output lands in its
        (position, rank) cell and the cells are summed in rank order afterwards,
        so neither arrival order nor batching changes a bit.
        """
        a = self.args
        ids, weights = router_top_k(h @ self.model.blocks[layer].ffn_gate_inp.T, a.expert_used_count)
        if observer is not None:
            observer.on_route(layer, positions, residual, h, ids, weights)
        predicted = self._lookahead(layer, layer_input, residual, h)
        contrib = np.zeros((h.shape[0], a.expert_used_count, a.embedding_length), np.float32)  # (T, k, D)
        # aclosing: on an error mid-layer the source still drains its in-flight reads.
        async with aclosing(self.experts.stream(layer, np.unique(ids).tolist())) as stream:
            async for batch in stream:
                if predicted is not None:  # this layer's demand reads are submitted by now
                    self.experts.hint(layer + 1, predicted)
                    predicted = None
                cells = [np.nonzero(ids == expert) for expert, _ in batch]
                xs = [h if h.shape[0] == 1 else h[rows] for rows, _ in cells]
                outs = self.kernels.expert_ffns([w for _, w in batch], xs)
                for (rows, ranks), y in zip(cells, outs):
                    contrib[rows, ranks] = y * weights[rows, ranks][:, None]
        return contrib.sum(axis=1)

    def _lookahead(self, layer: int, layer_input: np.ndarray, residual: np.ndarray,
                   h: np.ndarray) -> list[int] | None:
        """Layer + 1's likely experts from router layer + 1 on this layer's hidden state.

        One position: its top 2k in router order (the scheduler's predictor
        decides how many are worth reading). Several (prefill): the union of
        their top-k, most-voted first. None when lookahead is off or on the last layer.
        """
        if self.lookahead is None or layer + 1 >= self.args.block_count:
            return None
        state = predictor_state(self.model, self.lookahead, layer, layer_input, residual, h)
        k = self.args.expert_used_count
        ranked = rank_experts(self.model.blocks[layer + 1].ffn_gate_inp, state, 2 * k)
        if ranked.shape[0] == 1:
            return ranked[0].tolist()
        ranked = ranked[:, :k]
        ids, votes = np.unique(ranked, return_counts=True)
        return ids[np.argsort(-votes, kind="stable")].tolist()
