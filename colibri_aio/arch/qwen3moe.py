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
from typing import Any, Literal, Protocol

import numpy as np

from colibri_aio.errors import UserError
from colibri_aio.experts import ExpertBatch, ExpertSource
from colibri_aio.gguf.model import Model
from colibri_aio.kernels.backend import Kernels, NumpyKernels
from colibri_aio.kernels.blocks import AttentionSpec, BlockInput, Routed
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


def _cells(ids: np.ndarray) -> dict[int, Any]:
    """Where each routed expert's outputs go: expert -> its rank (one position), or expert ->
    (positions, ranks) arrays (several): ``ids`` (T, k) is the router's choice per position."""
    t, k = ids.shape
    if t == 1:
        return {e: r for r, e in enumerate(ids[0].tolist())}
    flat = ids.ravel()
    order = np.argsort(flat, kind="stable")
    experts, starts = np.unique(flat[order], return_index=True)
    ends = [*starts[1:].tolist(), flat.size]
    return {e: (order[s:b] // k, order[s:b] % k) for e, s, b in zip(experts.tolist(), starts.tolist(), ends)}


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
        self.spec = AttentionSpec(n_head=a.head_count, n_head_kv=a.head_count_kv, head_dim=a.key_length,
                                  rms_eps=a.rms_eps, rope_base=a.rope_freq_base, qk_norm=True,
                                  n_expert=a.expert_count, top_k=a.expert_used_count)
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
        positions = np.arange(self.n_past, self.n_past + tok.size, dtype=np.int32)
        x: BlockInput = embed_rows(self.kernels, self.model.token_embd, tok)       # (T, D)
        pending = None  # the previous block's experts, all in memory, left for the next kernel call to run
        try:
            for layer in range(a.block_count):
                routed = self.kernels.attention_router(self.spec, self.model.blocks[layer], x, positions,
                                                       self.cache, layer, pending)
                pending = self._release(pending)
                pending = await self._moe(layer, routed, positions, observer)
                x = routed
            out = self.kernels.logits(self.model.output_norm, self.model.output, x, a.rms_eps, logits, pending)
        finally:
            self._release(pending)
        self.n_past += tok.size
        return out

    def _release(self, pending: tuple | None) -> None:
        if pending is not None:
            self.experts.release()

    async def _moe(self, layer: int, routed: Routed, positions: np.ndarray,
                   observer: RouteObserver | None) -> tuple | None:
        """Fetch each routed expert once (batch-union) and run it into ``routed.contrib``.

        Experts arrive in batches, in whatever order the source delivers them
        (the cached ones first, then misses as their reads land); a batch is
        computed by one kernel call, each expert's outputs landing in their
        (position, rank) cells. The next block sums the cells in rank order,
        so neither arrival order nor batching changes a bit.

        Decode with every expert in memory: nothing is computed here; returns
        ``(experts, ranks)``, held by the source, for the next kernel call to
        run first (one graph call per block instead of two).
        """
        h = routed.moe_input
        if observer is not None:
            observer.on_layer_input(layer, routed.x)
            observer.on_route(layer, positions, routed.residual, h, routed.ids, routed.weights)
        predicted = self._lookahead(layer, routed.x, routed.residual, h)
        cells = _cells(routed.ids)
        experts = sorted(cells)
        batch = self.experts.ready(layer, experts)
        if batch is not None:  # every expert in memory: one batch, no task switch
            if predicted is not None:
                self.experts.hint(layer + 1, predicted)
            if h.shape[0] == 1:
                return [w for _, w in batch], [cells[e] for e, _ in batch]
            try:
                self._run_experts(batch, cells, routed)
            finally:
                self.experts.release()
            return None
        # aclosing: on an error mid-layer the source still drains its in-flight reads.
        async with aclosing(self.experts.stream(layer, experts)) as stream:
            async for batch in stream:
                if predicted is not None:  # this layer's demand reads are submitted by now
                    self.experts.hint(layer + 1, predicted)
                    predicted = None
                self._run_experts(batch, cells, routed)
        return None

    def _run_experts(self, batch: ExpertBatch, cells: dict[int, Any], routed: Routed) -> None:
        """One kernel call for a batch of experts, each output into its (position, rank) cells."""
        where = [cells[e] for e, _ in batch]
        h = routed.moe_input
        rows = None if h.shape[0] == 1 else [r for r, _ in where]
        self.kernels.expert_ffns([w for _, w in batch], h, rows, into=(routed.contrib, where))

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
