"""The decoder every family shares: kernels, KV cache, attention, routing, experts, prefill.

A family module subclasses :class:`MoETransformer` and writes its attention
(and its shared expert, its dense FFN) once, as functions of a
:class:`~colibri_aio.arch.graph.Builder` ``f`` from the shared pieces here
(:meth:`~MoETransformer.qkv`, :meth:`~MoETransformer.attend`,
:meth:`~MoETransformer.ffn` ...); both backends run that description
(:mod:`colibri_aio.arch.graph`). This module runs it at once, on arrays: the
NumPy reference, and on the ggml kernels the per-operation pass;
:mod:`colibri_aio.arch.decode_graphs` runs it as ggml graphs
(``arch/__init__.py`` says how to add a family).

Routed experts arrive through an :class:`~colibri_aio.experts.ExpertSource`, so
no family knows whether their bytes came from mmap, RAM or io_uring.

Shape legend: T positions in this call, D embedding_length, H head_count,
Hkv head_count_kv, d key_length, dv value_length, E expert_count,
k expert_used_count, V vocab_size, S context positions held in the KV cache.
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np

from colibri_aio.arch.graph import Builder, NumpyBuilder, RopeParams, Value
from colibri_aio.arch.kvcache import DEFAULT_KV_TYPE, KVCache, default_context
from colibri_aio.arch.lookahead import moe_norm, predictor_state, rank_experts, router_logits
from colibri_aio.errors import NonFiniteError, UserError
from colibri_aio.experts import ExpertSource, ExpertWeights
from colibri_aio.kernels.backend import Kernels, NumpyKernels
from colibri_aio.kernels.ops import near_misses, rms_norm, route, swiglu, swiglu_oai
from colibri_aio.kernels.qtensor import QTensor
from colibri_aio.settings import Settings

if TYPE_CHECKING:
    from colibri_aio.gguf.model import BlockWeights, Model

# Positions per forward step of a long prompt: bounds activation memory (and the
# attention scores), while keeping batch-union wide enough to read each expert once.
PREFILL_CHUNK = 256

Rope = tuple[np.ndarray, np.ndarray]  # cos, sin tables (T, n_rot/2) of this call's positions
# Routed experts' activations (``MoETransformer.expert_activation``): SwiGLU, and gpt-oss's clamped one.
EXPERT_ACTIVATIONS = {"swiglu": swiglu, "swiglu_oai": swiglu_oai}


@dataclass(slots=True, eq=False)
class SeqSlot:
    """One sequence a net holds: its KV cache, its length and the token ids behind it."""

    cache: KVCache
    n_past: int = 0
    ids: list[int] = field(default_factory=list)


class RouteObserver(Protocol):
    """Receives every routing decision (used by ``trace`` and the lookahead predictor)."""

    def on_layer_input(self, layer: int, x: np.ndarray) -> None:
        """``x``: (T, D) the residual stream entering block ``layer``."""

    def on_route(self, layer: int, positions: np.ndarray, residual: np.ndarray,
                 moe_input: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> None:
        """``residual``: (T, D) post-attention residual; ``moe_input``: (T, D) after the MoE norm;
        ``ids``/``weights``: (T, k) chosen experts in the order chosen (descending weight; descending
        biased score where the router has a selection bias, exp_probs_b). A dense block (no routed
        experts) reports ``ids``/``weights`` of shape (T, 0) and its FFN input as ``moe_input``."""


def embed_rows(kernels: Kernels, token_embd: QTensor, ids: np.ndarray) -> np.ndarray:
    """Rows of the token embedding for ``ids``, dequantised: (T, D)."""
    table = token_embd.data.reshape(token_embd.rows, -1)        # (V, bytes per row)
    rows = np.ascontiguousarray(table[ids]).reshape(-1)
    return kernels.dequantize(QTensor(rows, token_embd.ggml_type, (len(ids), token_embd.cols)))


class MoETransformer:
    """A pre-norm MoE decoder bound to an expert source and a KV cache; families subclass it.

    Per block: ``x += attention(attn_norm(x))``, then ``x += moe(moe_norm(x))``
    where moe sums the routed experts (batch-union reads, rank-ordered sum)
    and the family's shared expert, if any; a leading dense block
    (``args.is_moe(layer)`` false) runs its resident :meth:`dense_ffn` instead.
    Subclasses implement :meth:`attention` and may override the hooks below it.
    """

    # The routed experts' activation (EXPERT_ACTIVATIONS); their biases, when the file has
    # ffn_{gate,up,down}_exps.bias, are added to each product (the block's row of the expert).
    expert_activation = "swiglu"
    # The router weight multiplies each routed expert's input instead of its output (llama4: llama.cpp's
    # weight_before_ffn); the shape of every expert's graph says so (ExpertsShape.weights_first).
    expert_weights_first = False

    def __init__(self, model: Model, experts: ExpertSource, n_ctx: int | None = None,
                 kernels: Kernels | None = None, kv_type: str = DEFAULT_KV_TYPE,
                 settings: Settings | None = None, n_seq: int = 1) -> None:
        """``n_ctx``: KV-cache positions (default: the model's, at most 4096; never more than the model's);
        ``kernels``: the backend every product runs on (None: the NumPy reference); the caller owns it;
        ``kv_type``: "f16" or "f32" storage of keys and values (see :mod:`colibri_aio.arch.kvcache`);
        ``settings``: the engine's switches (None: read now; the ggml decode graphs' are among them);
        ``n_seq``: sequences held at once, each in a slot with its own KV cache of ``n_ctx`` positions
        (:meth:`use` picks the one ``forward`` continues; :meth:`decode_batch` steps several together)."""
        a = model.args
        self.model, self.args, self.experts = model, a, experts
        self.settings = settings if settings is not None else Settings.read()
        self.kernels: Kernels = kernels if kernels is not None else NumpyKernels()
        # The trunk's matrices, resident for the net's life: the backend may keep them in its own layout too.
        self.repacked_nbytes = self.kernels.resident([model.output, *(m for b in model.blocks for m in b.matrices())])
        self.n_ctx = min(n_ctx or default_context(a.context_length), a.context_length)
        self.kv_type = kv_type
        if n_seq < 1:
            raise ValueError(f"n_seq must be at least 1, not {n_seq}")
        self.slots = [SeqSlot(self.make_cache()) for _ in range(n_seq)]
        self.slot = self.slots[0]      # the sequence forward, prefill and rewind work on
        self.step_unions: list[int] = []   # a batched step's distinct experts per MoE block, where it knows them
        # The hidden state that predicts the next layer's experts (see arch/lookahead.PREDICTORS);
        # None: no hints (Placement.lookahead sets it).
        self.lookahead: str | None = None

    # --- the sequence being computed ---------------------------------------------------------

    def use(self, index: int) -> SeqSlot:
        """Make slot ``index`` the sequence ``forward``, ``prefill``, ``rewind`` and ``checkpoint`` work on."""
        self.slot = self.slots[index]
        return self.slot

    @property
    def cache(self) -> KVCache:
        return self.slot.cache

    @property
    def n_past(self) -> int:
        """Positions of the current slot's context."""
        return self.slot.n_past

    @n_past.setter
    def n_past(self, value: int) -> None:
        self.slot.n_past = value

    @property
    def ids(self) -> list[int]:
        """The token ids behind the current slot's cache: positions 0..n_past-1."""
        return self.slot.ids

    # --- kernels: every product of every family ------------------------------------------

    def linear(self, w: QTensor, x: np.ndarray) -> np.ndarray:
        """x (T, cols) -> (T, rows)."""
        return self.kernels.linear(w, x)

    def linears(self, ws: Sequence[QTensor], x: np.ndarray) -> list[np.ndarray]:
        """Several products on one input (one graph on the ggml backend)."""
        return self.kernels.linears(ws, x)

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """Token embedding rows (T, D)."""
        return embed_rows(self.kernels, self.model.token_embd, ids)

    def expert_outputs(self, layer: int, experts: Sequence[tuple[int, ExpertWeights]],
                       xs: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Each routed expert, down(act(gate x + b_gate, up x + b_up)) + b_down, on the rows routed to it:
        (n_i, D) each; SwiGLU experts without biases in one kernel call for the batch."""
        blk = self.model.blocks[layer]
        b_gate, b_up, b_down = (blk.get(f"ffn_{p}_exps.bias") for p in ("gate", "up", "down"))
        if self.expert_activation == "swiglu" and b_gate is None:
            return self.kernels.expert_ffns([w for _, w in experts], xs)
        act = EXPERT_ACTIVATIONS[self.expert_activation]
        outs = []
        for (e, w), x in zip(experts, xs):
            gate, up = self.linears((w.gate, w.up), x)
            if b_gate is not None:
                gate, up = gate + b_gate[e], up + b_up[e]
            y = self.linear(w.down, act(gate, up))
            outs.append(y if b_down is None else y + b_down[e])
        return outs

    def weighted_terms(self, layer: int, batch: Sequence[tuple[int, ExpertWeights]], h: np.ndarray, ids: np.ndarray,
                       weights: np.ndarray, terms: np.ndarray) -> None:
        """Each (position, rank) cell routed to an expert of ``batch`` gets that expert's weighted output in
        ``terms`` (T, k, D): every expert on all its positions at once (:meth:`expert_outputs`); ``ids`` and
        ``weights`` (T, k) are the routing of the positions ``h`` (T, D)."""
        cells = [np.nonzero(ids == expert) for expert, _ in batch]               # (rows, ranks) each
        first_w = self.expert_weights_first
        ys = self.expert_outputs(layer, batch, [h[rows] * weights[rows, ranks][:, None] if first_w else h[rows]
                                                for rows, ranks in cells])
        for (rows, ranks), y in zip(cells, ys):
            terms[rows, ranks] = y if first_w else y * weights[rows, ranks][:, None]

    # --- shared pieces the families' blocks are written with (f: the backend's Builder) ------------

    def qkv(self, f: Builder, blk: BlockWeights, h: Value) -> tuple[Value, Value, Value]:
        """q (T, H, d), k (T, Hkv, d), v (T, Hkv, dv): attn_q/k/v products, plus their biases when present."""
        a = self.args
        q, k, v = (y if blk.get(n + ".bias") is None else f.add(y, blk[n + ".bias"])
                   for n, y in zip(("attn_q", "attn_k", "attn_v"), f.linears((blk.attn_q, blk.attn_k, blk.attn_v), h)))
        return (f.heads(q, a.head_count, a.key_length), f.heads(k, a.head_count_kv, a.key_length),
                f.heads(v, a.head_count_kv, a.value_length))

    def attend(self, f: Builder, layer: int, q: Value, k: Value, v: Value, **options: object) -> Value:
        """``f.attend`` (the cache keeps k and v; ``options``: scale, sinks), projected by attn_output
        (+ its bias): (T, D)."""
        return self.project_heads(f, layer, f.attend(layer, q, k, v, **options))  # type: ignore[arg-type]

    def project_heads(self, f: Builder, layer: int, o: Value) -> Value:
        """attn_output (+ its bias) on the heads' concatenated outputs o (T, H * dv): (T, D)."""
        blk = self.model.blocks[layer]
        out = f.linear(blk.attn_output, o)
        bias = blk.get("attn_output.bias")
        return out if bias is None else f.add(out, bias)

    def ffn(self, f: Builder, blk: BlockWeights, h: Value, suffix: str = "") -> Value:
        """A dense SwiGLU FFN of resident tensors ``ffn_{gate,up,down}<suffix>``: (T, D) -> (T, D)."""
        gate, up = f.linears((blk["ffn_gate" + suffix], blk["ffn_up" + suffix]), h)
        return f.linear(blk["ffn_down" + suffix], f.swiglu(gate, up))

    def gated_shared_expert(self, f: Builder, layer: int, h: Value) -> Value:
        """sigmoid(ffn_gate_inp_shexp · h) * ffn_shexp(h): the shared expert with a scalar gate per position."""
        blk = self.model.blocks[layer]
        gate = f.sigmoid(f.linear(blk["ffn_gate_inp_shexp"].reshape(1, -1), h))          # (T, 1)
        return f.mul(self.ffn(f, blk, h, "_shexp"), gate)

    def block_attention(self, f: Builder, layer: int, x: Value) -> tuple[Value, Value, Value]:
        """The first half of block ``layer`` on its input x (T, D): the attention's output, the residual
        after it, x2 = x + attention(attn_norm(x)), and the FFN's input moe_norm(x2)."""
        attn = self.attention(f, layer, f.rms_norm(x, self.model.blocks[layer].attn_norm))
        x2 = f.add(x, attn)
        return attn, x2, f.rms_norm(x2, moe_norm(self.model, layer))

    # --- family hooks ----------------------------------------------------------------------------

    def make_cache(self) -> KVCache:
        """The KV cache of ``args.kv_layout()`` and ``args.kv_windows()``: what the plan's ``kv_cache_nbytes``
        counts."""
        a = self.args
        return KVCache(a.block_count, self.n_ctx, a.kv_layout(), self.kv_type, a.kv_windows(),
                       [a.kv_chunked(layer) for layer in range(a.block_count)], a.recurrent_states())

    def rope_tables(self, positions: np.ndarray) -> Rope:
        """cos/sin for this call's positions (computed once per call, used by every layer): the angles
        :meth:`rope_params` describes, scaled as ``args.rope_scaling`` says."""
        a = self.args
        return a.rope_scaling.tables(positions, a.n_rot, a.rope_freq_base)

    def rope_params(self) -> RopeParams:
        """RoPE as ggml's rope_ext takes it (the graphs' rotation): the same angles as :meth:`rope_tables`."""
        a = self.args
        return a.rope_scaling.params(a.n_rot, a.rope_freq_base)

    def attention(self, f: Builder, layer: int, h: Value) -> Value:
        """The family's attention on the normed input h (T, D): (T, D)."""
        raise NotImplementedError

    def shared_expert(self, f: Builder, layer: int, h: Value) -> Value | None:
        """The always-on expert added to the routed sum, when the block has one: ``ffn_*_shexp``, behind a
        sigmoid gate when the block has ``ffn_gate_inp_shexp`` (qwen2moe); None without."""
        blk = self.model.blocks[layer]
        if "ffn_up_shexp" not in blk:
            return None
        if "ffn_gate_inp_shexp" in blk:
            return self.gated_shared_expert(f, layer, h)
        return self.ffn(f, blk, h, "_shexp")

    def dense_ffn(self, f: Builder, layer: int, h: Value) -> Value:
        """The FFN of a leading dense block (no routed experts): ``ffn_{gate,up,down}``."""
        return self.ffn(f, self.model.blocks[layer], h)

    # --- the pass -----------------------------------------------------------------------------------

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
        self.rewind(0)

    def rewind(self, n_past: int) -> None:
        """Keep the first ``n_past`` positions of the context and forget the rest.

        Attention reads the cache only up to the position it computes, so
        what lies beyond ``n_past`` is never seen and is overwritten later.
        A sliding-window layer holds only its last window of positions: ``n_past``
        must be one it can continue from (:meth:`resumable`).
        """
        if not 0 <= n_past <= self.n_past:
            raise ValueError(f"cannot rewind to {n_past}: the context holds {self.n_past} positions")
        if not self.cache.can_continue(n_past):
            raise ValueError(f"cannot rewind to {n_past}: the sliding-window layers no longer hold the keys "
                             f"before it (resumable({n_past}) = {self.resumable(n_past)})")
        self._truncate(n_past)

    def resumable(self, n_past: int) -> int:
        """The longest prefix of at most ``n_past`` positions the cache can continue from: ``n_past``; else,
        for recurrent layers (whose state cannot be wound back), the longest kept checkpoint within it
        (:meth:`checkpoint`); else 0, as when a sliding-window layer has let go of keys position ``n_past``
        would see (the ring holds the last window of positions: rewinding past one position beyond it
        means running the prefix again)."""
        n_past = min(n_past, self.n_past)
        for candidate in (n_past, *reversed([c for c in self.cache.checkpoints if c < n_past])):
            if self.cache.can_continue(candidate):
                return candidate
        return 0

    def checkpoint(self) -> None:
        """Keep the recurrent layers' state of the context as it is now, so a later prompt that shares
        this prefix continues from here (:meth:`resumable`); nothing for a net without such layers."""
        self.cache.checkpoint()

    def _truncate(self, n_past: int) -> None:
        self.n_past = n_past
        del self.ids[n_past:]
        self.cache.forget_after(n_past)

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
        self.cache.start(self.n_past)
        try:
            out = await self._logits(tok, positions, observer, logits)
            self.cache.commit(self.n_past + tok.size)
        except BaseException:
            # A ring may have taken this call's keys in the slots of ones the context still needs.
            if not self.cache.can_continue(self.n_past):
                self._truncate(0)
            raise
        self.n_past += tok.size
        self.ids.extend(tok.tolist())
        self._check_finite(out, "the output head (output_norm, output)", positions[-len(out):])
        return out if logits == "all" else out[0]

    async def decode_batch(self, rows: Sequence[tuple[int, int]]) -> np.ndarray:
        """One decode step of several sequences: for each (slot, token) of ``rows``, ``token`` at that slot's
        next position. Returns the logits (len(rows), V), row i for ``rows[i]``: bit for bit what ``forward``
        of that token on that slot alone gives. Here one sequence after another; the decode graphs step them
        together (:class:`~colibri_aio.arch.decode_graphs.GraphDecode`). Leaves the last row's slot current."""
        self._check_batch(rows)
        out = []
        for index, token in rows:
            self.use(index)
            out.append(await self.forward([token]))
        return np.stack(out)

    def _check_batch(self, rows: Sequence[tuple[int, int]]) -> None:
        """Refuse a step ``decode_batch`` cannot run whole, before any sequence moves."""
        if not rows:
            raise UserError("a decode step needs at least one sequence")
        indices = [index for index, _ in rows]
        if len(set(indices)) != len(indices):
            raise ValueError(f"a sequence appears twice in one step: slots {indices}")
        for index, token in rows:
            if not 0 <= index < len(self.slots):
                raise ValueError(f"no slot {index}: the net holds {len(self.slots)} sequences")
            if not 0 <= token < self.args.vocab_size:
                raise UserError(f"token id out of range [0, {self.args.vocab_size})")
            if self.slots[index].n_past + 1 > self.n_ctx:
                raise UserError(f"context full: slot {index} holds {self.slots[index].n_past} of n_ctx {self.n_ctx}")

    async def _logits(self, tok: np.ndarray, positions: np.ndarray, observer: RouteObserver | None,
                      logits: Literal["last", "all"]) -> np.ndarray:
        """The logits (n, V) of the last position, or of every one, after every block (the cache written)."""
        x = await self._blocks(tok, positions, observer)
        return self.output_logits(x if logits == "all" else x[-1:])

    def output_logits(self, rows: np.ndarray) -> np.ndarray:
        """The output head on the final residual rows (n, D): output · output_norm(rows), (n, V)."""
        return self.linear(self.model.output, rms_norm(rows, self.model.output_norm, self.args.rms_eps))

    async def _blocks(self, tok: np.ndarray, positions: np.ndarray, observer: RouteObserver | None) -> np.ndarray:
        """The residual stream (T, D) after every block, the KV cache written at ``positions``."""
        a = self.args
        f = NumpyBuilder(self.kernels, self.cache, positions, self.rope_tables(positions), a.rms_eps)
        x = self.embed(tok)                                                        # (T, D)
        self._check_finite(x, "the token embedding (token_embd)", positions)
        for layer in range(a.block_count):
            if observer is not None:
                observer.on_layer_input(layer, x)
            layer_input = x
            attn, x, h = self.block_attention(f, layer, x)
            self._check_finite(attn, f"layer {layer} attention", positions)
            ffn = self._moe if a.is_moe(layer) else self._dense
            x = x + await ffn(f, layer, h, positions, layer_input, x, observer)
        return x

    def _check_finite(self, x: np.ndarray, where: str, positions: np.ndarray) -> None:
        """A NaN or infinity never turns into tokens: stop, naming where it appeared (broken weights)."""
        if not np.isfinite(x).all():
            bad = positions[~np.isfinite(x.reshape(len(positions), -1)).all(axis=1)]
            raise NonFiniteError(f"{self.model.path}: non-finite values from {where} at position {int(bad[0])}: "
                                 f"the model's weights there are broken (`doctor --verify` scans every tensor)")

    def route_logits(self, layer: int, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Experts (T, k) and weights (T, k) of router ``layer`` from its logits (T, E), by ``args.routing``."""
        return route(logits, self.args.expert_used_count, self.args.routing,
                     self.model.blocks[layer].get("exp_probs_b.bias"))

    async def _moe(self, f: NumpyBuilder, layer: int, h: np.ndarray, positions: np.ndarray, layer_input: np.ndarray,
                   residual: np.ndarray, observer: RouteObserver | None) -> np.ndarray:
        """Route, fetch each unique expert once (batch-union), and sum in routing order (+ the shared expert).

        Experts arrive in batches, in whatever order the source delivers them; each one's
        weighted output lands in its (position, rank) cell and the cells are
        summed in rank order afterwards, so arrival order never changes a bit.
        The shared expert runs once this layer's reads are submitted.
        """
        a = self.args
        logits = router_logits(self.model, layer, h)
        ids, weights = self.route_logits(layer, logits)
        self._check_finite(weights, f"layer {layer} router (ffn_gate_inp)", positions)
        if len(positions) > 1:   # a prompt's: what its router nearly chose is what a warm start reads first
            self.experts.near_misses(layer, near_misses(logits, ids, a.routing,
                                                        self.model.blocks[layer].get("exp_probs_b.bias")).tolist())
        if observer is not None:
            observer.on_route(layer, positions, residual, h, ids, weights)
        predicted = self._lookahead(layer, layer_input, residual, h)
        contrib = np.zeros((h.shape[0], a.expert_used_count, a.embedding_length), np.float32)  # (T, k, D)
        shared: np.ndarray | None = None
        first = True
        # aclosing: on an error mid-layer the source still drains its in-flight reads.
        async with aclosing(self.experts.stream(layer, np.unique(ids).tolist())) as stream:
            async for batch in stream:
                if first:  # after this layer's demand reads, which went out with the first batch
                    first = False
                    if predicted is not None:
                        self.experts.hint(layer + 1, predicted)
                    shared = self.shared_expert(f, layer, h)
                self.weighted_terms(layer, batch, h, ids, weights, contrib)
        out = contrib.sum(axis=1)
        if not np.isfinite(out).all():
            bad = np.unique(ids[~np.isfinite(contrib).all(axis=2)]).tolist()
            self._check_finite(out, f"layer {layer} expert{'s' if len(bad) > 1 else ''} "
                                    f"{', '.join(map(str, bad))}", positions)
        if shared is None:
            return out
        self._check_finite(shared, f"layer {layer} shared expert", positions)
        return out + shared

    async def _dense(self, f: NumpyBuilder, layer: int, h: np.ndarray, positions: np.ndarray,
                     layer_input: np.ndarray, residual: np.ndarray, observer: RouteObserver | None) -> np.ndarray:
        """A leading dense block's FFN. When the next block has experts, lookahead hints them first,
        so their reads overlap this FFN and the next block's attention."""
        if observer is not None:
            t = h.shape[0]
            observer.on_route(layer, positions, residual, h, np.zeros((t, 0), np.int64), np.zeros((t, 0), np.float32))
        predicted = self._lookahead(layer, layer_input, residual, h)
        if predicted is not None:
            self.experts.hint(layer + 1, predicted)
        out = self.dense_ffn(f, layer, h)
        self._check_finite(out, f"layer {layer} dense FFN", positions)
        return out

    def _lookahead(self, layer: int, layer_input: np.ndarray, residual: np.ndarray,
                   h: np.ndarray) -> list[int] | None:
        """Layer + 1's likely experts from router layer + 1 on this layer's hidden state.

        One position: its top 2k in router order (the scheduler policy reads
        the first k it does not hold). Several (prefill): the union of their
        top-k, most-voted first. None when lookahead is off, on the last layer, or when
        layer + 1 is a dense block (no experts to read).
        """
        if self.lookahead is None or layer + 1 >= self.args.block_count or not self.args.is_moe(layer + 1):
            return None
        state = predictor_state(self.model, self.lookahead, layer, layer_input, residual, h)
        k = self.args.expert_used_count
        ranked = rank_experts(self.model, layer + 1, state, 2 * k)
        if ranked.shape[0] == 1:
            return ranked[0].tolist()
        ranked = ranked[:, :k]
        ids, votes = np.unique(ranked, return_counts=True)
        return ids[np.argsort(-votes, kind="stable")].tolist()
