"""Decode steps on whole ggml graphs: the forward pass of one position with a few graph launches per block.

:class:`GraphDecode` is mixed into a family's net (before :class:`MoETransformer`).
When the net runs on the ggml backend and decodes one position without an
observer, each block is one attention-and-router graph, the expert source's
stream of the chosen experts, and one experts graph
(:mod:`colibri_aio.kernels.ggml_decode`); the output head is one graph. When
the expert source keeps its experts in one strided pool with a slot table
(:meth:`CachedExpertSource.resident`), a step whose every chosen expert is
resident runs as a single graph, blocks and head (:meth:`GraphDecode._step_on_one_graph`;
``COLIBRI_GGML_STEP=layers`` turns it off). Anything
else (prefill, tracing, the NumPy backend, a block shape the graphs do not
cover) takes the per-operation pass, which also names the place of any
non-finite value: a step whose graphs produce one is run again that way.
"""
from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import TYPE_CHECKING

import numpy as np

from colibri_aio.arch.lookahead import moe_norm
from colibri_aio.arch.layers import MoETransformer, RouteObserver
from colibri_aio.kernels.ops import Routing

if TYPE_CHECKING:
    from colibri_aio.kernels.ggml_decode import DecodeGraphs

_UNSET = object()


class GraphDecode(MoETransformer):
    """Decode of one position as whole ggml graphs: attention with optional q/k/v biases, q/k norm and
    RoPE, softmax top-k (renormalised or not, by ``args.routing``), SwiGLU experts, an optional gated
    shared expert (:mod:`colibri_aio.kernels.ggml_decode` lists the variants and what others lack).

    The defaults are qwen3moe's block; a family whose block differs says how in the class attributes
    below, which must describe what its per-operation :meth:`attention` and :meth:`shared_expert` do.
    """

    graph_qk_norm = "head"        # RMSNorm of q and k: per head, "whole" (over the projection), or "none"
    graph_neox_rope = True        # False: NORMAL RoPE (adjacent pairs)
    graph_shared_expert = False   # True: :meth:`gated_shared_expert` (ffn_*_shexp behind ffn_gate_inp_shexp)
    _decode_graphs: object = _UNSET

    def decode_graphs(self) -> DecodeGraphs | None:
        """The net's decode graphs, or None when this net's steps take the per-operation pass."""
        if self._decode_graphs is _UNSET:
            self._decode_graphs = self._make_decode_graphs()
        return self._decode_graphs  # type: ignore[return-value]

    def _make_decode_graphs(self) -> DecodeGraphs | None:
        if self.kernels.name != "ggml":
            return None
        from colibri_aio.kernels import ggml_cpu, ggml_decode

        if ggml_cpu.knob("graphs") != "on":
            return None
        a, model, cache = self.args, self.model, self.cache
        if (not all(a.is_moe(i) for i in range(a.block_count)) or any(w is not None for w in cache.windows)
                or a.routing not in (Routing(), Routing(normalize=False)) or cache.layout.values_in_keys
                or a.n_rot > a.key_length):
            return None
        kernels = self.kernels
        shapes = []
        for blk in model.blocks:
            if any(blk.get(n) is not None for n in ("attn_output.bias", "ffn_gate_inp.bias", "exp_probs_b.bias")):
                return None
            biases = [blk.get(n) is not None for n in ("attn_q.bias", "attn_k.bias", "attn_v.bias")]
            if any(biases) and not all(biases):
                return None
            mats = [blk.get(n) for n in ("attn_q", "attn_k", "attn_v", "attn_output")]
            shared = [blk.get(n) for n in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
                      if self.graph_shared_expert]
            if any(m is None or m.ggml_type not in kernels.types for m in mats + shared):
                return None
            q, k, v = mats[:3]
            sigs = [kernels._mat(m) for m in mats]
            at = kernels._address
            # One product over the three (one graph node); repacked copies follow each other as the originals do.
            fused = (sigs[0].gid, sigs[0].packed) == (sigs[1].gid, sigs[1].packed) == (sigs[2].gid, sigs[2].packed) \
                and at(q.data) + q.nbytes == at(k.data) and at(k.data) + k.nbytes == at(v.data)
            shapes.append(ggml_decode.AttentionShape(
                *sigs, heads=a.head_count, heads_kv=a.head_count_kv,
                key_width=a.key_length, value_width=a.value_length, n_rot=a.n_rot, rope_base=a.rope_freq_base,
                n_ctx_orig=a.context_length, eps=a.rms_eps, experts=a.expert_count, used=a.expert_used_count,
                kv_dtype=np.dtype(cache.dtype).name, qkv_fused=fused,
                f16_attention=ggml_cpu.knob("attention") == "f16", qk_norm=self.graph_qk_norm,
                neox_rope=self.graph_neox_rope, qkv_bias=all(biases), normalize=a.routing.normalize))
        return ggml_decode.DecodeGraphs(kernels, shapes, self.graph_shared_expert)

    _step_blocks: list[tuple] | None = None   # each block's arguments of DecodeGraphs.attention after x
    _step_logits: np.ndarray | None = None   # the head's output of a one-graph step, for output_logits
    _step_missed = False                     # the last step routed to an expert that was not resident
    one_graph_steps = 0                      # steps run as one graph
    one_graph_misses = 0                     # one-graph steps discarded: an expert was not resident

    async def _blocks(self, tok: np.ndarray, positions: np.ndarray, observer: RouteObserver | None) -> np.ndarray:
        self._step_logits = None
        graphs = self.decode_graphs() if tok.size == 1 and observer is None else None
        if graphs is not None:
            x = await self._step_on_one_graph(graphs, tok, positions)
            if x is not None:
                return x
            misses = self._expert_misses()
            x = await self._blocks_on_graphs(graphs, tok, positions)
            self._step_missed = self._expert_misses() != misses
            if x is not None:
                graphs.steps += 1
                return x
        return await super()._blocks(tok, positions, observer)

    def output_logits(self, rows: np.ndarray) -> np.ndarray:
        logits, self._step_logits = self._step_logits, None
        if logits is not None:
            return logits.copy()
        graphs = self.decode_graphs() if len(rows) == 1 else None
        if graphs is None:
            return super().output_logits(rows)
        return graphs.head(np.ascontiguousarray(rows, np.float32), self.model.output_norm, self.model.output)

    def _expert_misses(self) -> int:
        """Demand misses of the expert source so far (-1 for a source without a cache)."""
        policy = getattr(self.experts, "policy", None)
        return -1 if policy is None else policy.cache.stats.misses

    async def _step_on_one_graph(self, graphs: DecodeGraphs, tok: np.ndarray, positions: np.ndarray) -> np.ndarray | None:
        """The residual stream after every block, and the logits (kept for :meth:`output_logits`), from one
        graph for the whole step, when every expert it routes to is resident in the source's pool; None
        when the step must run block by block instead (nothing of this attempt is kept but the KV cache
        rows at this position, which that run writes again before any block reads them).

        The graph picks each block's experts through the source's slot table (ResidentExperts) while it
        runs; afterwards the table says whether each chosen expert was really in (a slot that was not
        ready was read for nothing, its result is dropped). The graph runs on this thread, the event
        loop's, so no read can start into a slot and no slot can change hands while it runs: the table
        cannot go stale under it. The source then counts the step as its per-block requests would have.
        Nothing was read, so nothing is hinted or prefetched: lookahead only pays when something misses.
        It is tried while the step before found every expert resident: where experts miss every step (a
        cache smaller than the working set) each try would be a step computed twice.
        """
        source = self.experts
        if (self._step_missed or graphs.step_knob != "graph" or not hasattr(source, "resident")
                or graphs.shared_expert_on):   # the step graph has no shared expert (qwen2moe): block by block
            return None
        a, model, cache, position = self.args, self.model, self.cache, int(positions[0])
        resident = source.resident(range(a.block_count), a.expert_count)
        if resident is None:
            return None
        if source.reading:
            await asyncio.sleep(0)  # let reads that have landed report (their slots become ready)
        graphs.begin(position, len(cache.k[0]))
        blocks = self._attention_args()
        shape = graphs.step_shape(model.experts, resident.depth, resident.stride, resident.bases, model.output)
        if shape is None:
            return None
        graphs.step(shape, self.embed(tok), blocks, resident.slots, resident.bases,
                    (model.output_norm, model.output))
        for layer in range(a.block_count):
            cache.wrote(layer, position + 1)
        used = a.expert_used_count
        chosen = graphs.step_order[:, :used]
        if not resident.ready[np.arange(a.block_count)[:, None], chosen].all():
            self.one_graph_misses += 1
            self._step_missed = True
            return None
        if not np.isfinite(graphs.step_check[0]):
            return None       # the per-block graphs find the place, or the per-operation pass names it
        chosen = np.sort(chosen, axis=1)
        source.routed([(layer, row.tolist()) for layer, row in enumerate(chosen)])
        self.one_graph_steps += 1
        graphs.steps += 1
        self._step_logits = graphs.step_logits
        return graphs.step_x[-1:]

    def _attention_args(self) -> list[tuple]:
        """Each block's arguments of :meth:`DecodeGraphs.attention` after x (norms, mats, router, the block's
        cache arrays, q/k/v biases), made again only when the cache's arrays are new ones."""
        model, cache, blocks = self.model, self.cache, self._step_blocks
        if blocks is None or blocks[0][3] is not cache.k[0]:
            blocks = self._step_blocks = [
                ((blk.attn_norm, blk.get("attn_q_norm"), blk.get("attn_k_norm"), moe_norm(model, layer)),
                 (blk.attn_q, blk.attn_k, blk.attn_v, blk.attn_output), blk.ffn_gate_inp, cache.k[layer],
                 cache.v[layer], (blk.get("attn_q.bias"), blk.get("attn_k.bias"), blk.get("attn_v.bias")))
                for layer, blk in enumerate(model.blocks)]
        return blocks

    async def _blocks_on_graphs(self, graphs: DecodeGraphs, tok: np.ndarray,
                                positions: np.ndarray) -> np.ndarray | None:
        """The residual stream (1, D) after every block, or None when a non-finite value appeared."""
        cache, position = self.cache, int(positions[0])
        x = self.embed(tok)
        self._check_finite(x, "the token embedding (token_embd)", positions)
        graphs.begin(position, len(cache.k[0]))
        used = self.args.expert_used_count
        for layer, args in enumerate(self._attention_args()):
            graphs.attention(layer, x, *args)
            cache.wrote(layer, position + 1)
            if not (np.isfinite(graphs.weights).all() and np.isfinite(graphs.check[0])):
                return None
            x = await self._experts_on_graphs(graphs, layer, x, graphs.order[0, :used].tolist())
        return x if np.isfinite(x).all() else None

    async def _experts_on_graphs(self, graphs: DecodeGraphs, layer: int, layer_input: np.ndarray,
                                 ids: list[int]) -> np.ndarray:
        """The residual stream after block ``layer``'s experts ``ids`` (in rank order), plus the shared
        expert's output when the family has one (its graph runs once this layer's reads are out).

        All of them in the source's first batch (resident, or landed): one graph. Otherwise each batch
        runs as it arrives and the same rank-ordered sum follows in NumPy, which rounds as the graph
        does (one float32 product, then one addition at a time), so arrival never changes a bit.
        """
        predicted = self._lookahead(layer, layer_input, graphs.residual, graphs.moe_input)
        h, weights = graphs.moe_input, graphs.weights[0]
        terms: list[np.ndarray | None] = [None] * len(ids)
        first = True
        async with aclosing(self.experts.stream(layer, sorted(ids))) as stream:
            async for batch in stream:
                if first:
                    first = False
                    if predicted is not None:
                        self.experts.hint(layer + 1, predicted)
                    if graphs.shared_expert_on:
                        blk = self.model.blocks[layer]
                        graphs.shared_expert((blk.ffn_gate_shexp, blk.ffn_up_shexp, blk.ffn_down_shexp),
                                             blk.ffn_gate_inp_shexp)
                    if len(batch) == len(ids):
                        by_id = dict(batch)
                        ordered = [by_id[e] for e in ids]
                        return graphs.experts(ordered, graphs.stackable(ordered))
                ys = self.kernels.expert_ffns([w for _, w in batch], [h] * len(batch))
                for (expert, _), y in zip(batch, ys):
                    rank = ids.index(expert)
                    terms[rank] = y[0] * weights[rank]
        acc = terms[0]
        for term in terms[1:]:
            acc = acc + term
        if graphs.shared_expert_on:
            acc = acc + graphs.shared
        return graphs.residual + acc
