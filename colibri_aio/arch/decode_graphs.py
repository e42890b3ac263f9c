"""Decode steps as ggml graphs, traced from the family's one description of its block.

:class:`GraphDecode` is the base of every family's net. When the net runs on
the ggml backend and decodes one position without an observer, the step runs
on graphs of :mod:`colibri_aio.kernels.ggml_graph`, each traced once (per
context bucket) from the same :meth:`~MoETransformer.attention`,
:meth:`~MoETransformer.shared_expert` and :meth:`~MoETransformer.dense_ffn`
the per-operation pass runs:

- one graph for the whole step, blocks and head, when every expert it routes
  to is resident in the expert source's pool (:meth:`ExpertSource.resident`):
  each block picks its experts through the pool's slot table inside the graph;
- otherwise, per block, an attention-and-router graph, the expert source's
  stream of the chosen experts, the shared expert's graph once the reads are
  out, and one experts graph (or a dense block's FFN graph); one head graph.

A prompt (several positions of one sequence, no observer) runs in spans of at
most PREFILL_CHUNK positions (:meth:`GraphDecode._spans_on_graphs`): per block
the same attention-and-router graph, traced for the span's positions together
(every product over all of them, attention causal over the cache), then its
experts, each read once: when all are resident, one graph over every row, as
llama.cpp runs a batch; else each arriving batch as one product over its cells.

Anything else (tracing, the NumPy backend, ``COLIBRI_GGML_GRAPHS=off``,
``COLIBRI_GGML_PREFILL=ops``, a recurrent family's prompt) takes the
per-operation pass, which also names the place of a non-finite value: a step
whose graphs produce one is run again that way.
"""
from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import dataclass
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np

from colibri_aio.arch.layers import PREFILL_CHUNK, MoETransformer, RouteObserver
from colibri_aio.policy.step_path import StepPathGuess

if TYPE_CHECKING:
    from colibri_aio.experts import ResidentExperts
    from colibri_aio.kernels.ggml_graph import DecodeGraphs, ExpertsShape, GgmlBuilder, Node

_UNSET = object()


@dataclass(slots=True)
class StepBuffers:
    """Where the graphs of one net's steps of B rows (sequences) leave what the next graph, or the caller,
    reads."""

    stream: np.ndarray      # (B, D) the residual stream entering a block (and leaving the last)
    residual: np.ndarray    # (B, D) after the block's attention
    moe_input: np.ndarray   # (B, D) its FFN's input
    order: np.ndarray       # (B, E) int32 experts by descending selection score
    weights: np.ndarray     # (B, k) the first k's weights
    check: np.ndarray       # (1,) finite when nothing in the last graph broke
    shared: np.ndarray      # (B, D) the shared expert's output
    shared_check: np.ndarray
    logits: np.ndarray      # (B, V)
    step_order: np.ndarray  # (blocks, B, E) of a one-graph step
    step_weights: np.ndarray  # (blocks, B, k)
    step_check: np.ndarray
    terms: np.ndarray       # (B, k, D) each row's weighted expert outputs in rank order, before their sum

    def first(self, rows: int) -> StepBuffers:
        """The same buffers' first ``rows`` rows (views at the same addresses, so graphs traced for any
        number of rows point into one set)."""
        return StepBuffers(self.stream[:rows], self.residual[:rows], self.moe_input[:rows], self.order[:rows],
                           self.weights[:rows], self.check, self.shared[:rows], self.shared_check,
                           self.logits[:rows], self.step_order[:, :rows], self.step_weights[:, :rows],
                           self.step_check, self.terms[:rows])

    @classmethod
    def make(cls, blocks: int, dim: int, experts: int, used: int, vocab: int, rows: int = 1) -> StepBuffers:
        z = np.zeros
        return cls(z((rows, dim), np.float32), z((rows, dim), np.float32), z((rows, dim), np.float32),
                   z((rows, experts), np.int32), z((rows, used), np.float32), z(1, np.float32),
                   z((rows, dim), np.float32), z(1, np.float32), z((rows, vocab), np.float32),
                   z((blocks, rows, experts), np.int32), z((blocks, rows, used), np.float32), z(1, np.float32),
                   z((rows, used, dim), np.float32))


class GraphDecode(MoETransformer):
    """A net whose decode steps run as ggml graphs traced from its description (module docstring)."""

    _decode_graphs: object = _UNSET
    _buffers: StepBuffers                    # the step's (its number of rows'): the graphs' traces read it
    step_path: StepPathGuess                 # whether a step tries the one graph (policy/step_path.py)
    one_graph_steps = 0                      # steps run as one graph
    one_graph_misses = 0                     # one-graph steps discarded: an expert was not resident
    batch_steps = 0                          # decode_batch steps of several sequences run together
    expert_cell_products = 0                 # arriving batches of a batched step run over all its rows at once
    span_expert_graphs = 0                   # a span's blocks whose experts, all resident, ran as one graph

    def decode_graphs(self) -> DecodeGraphs | None:
        """The net's decode graphs, or None when this net's steps take the per-operation pass."""
        if self._decode_graphs is _UNSET:
            self._decode_graphs = self._make_decode_graphs()
        return self._decode_graphs  # type: ignore[return-value]

    def _make_decode_graphs(self) -> DecodeGraphs | None:
        k, a, model = self.kernels, self.args, self.model
        if k.name != "ggml" or self.settings.get("ggml_graphs") != "on":
            return None
        mats = [model.output, *(m for blk in model.blocks for m in blk.matrices())]
        if any(m.ggml_type not in k.types for m in mats):
            return None
        from colibri_aio.kernels import ggml_graph

        self._buffer_sets: dict[int | str, StepBuffers] = {}   # rows -> buffers; "span": the spans'
        self._buffers = self._buffers_for(1)
        self.step_path = StepPathGuess()
        return ggml_graph.DecodeGraphs(k, self.rope_params(), a.rms_eps,  # type: ignore[arg-type]
                                       f16_attention=self.settings.get("ggml_attention") == "f16")

    def _buffers_for(self, rows: int) -> StepBuffers:
        """The buffers of steps of ``rows`` sequences (made once: the graphs traced for them point at them)."""
        if rows not in self._buffer_sets:
            a = self.args
            self._buffer_sets[rows] = StepBuffers.make(a.block_count, a.embedding_length, a.expert_count,
                                                       a.expert_used_count, self.model.output.rows, rows)
        return self._buffer_sets[rows]

    def batchable(self) -> bool:
        """Whether :meth:`decode_batch` steps several sequences on one set of graphs: on the decode graphs,
        for a family without recurrent layers (their state update is one sequence's; the others take one
        step per sequence)."""
        return self.decode_graphs() is not None and not any(r is not None for r in self.args.recurrent_states())

    async def _logits(self, tok: np.ndarray, positions: np.ndarray, observer: RouteObserver | None,
                      logits: Literal["last", "all"]) -> np.ndarray:
        graphs = self.decode_graphs() if observer is None else None
        if graphs is not None and tok.size == 1:
            graphs.begin([(self.slots.index(self.slot), self.cache, int(positions[0]))])
            out = await self._step_on_graphs(graphs, tok)
            if out is not None:
                return out
        elif graphs is not None and self._spans_fit():
            return await self._spans_on_graphs(graphs, tok, positions, logits)
        return await super()._logits(tok, positions, observer, logits)

    def _spans_fit(self) -> bool:
        """Whether a prompt runs as spans on the graphs (:meth:`_spans_on_graphs`): ``COLIBRI_GGML_PREFILL=
        graphs``, experts as stacks, and no recurrent layer (its state steps one position at a time)."""
        if self.settings.get("ggml_prefill") != "graphs" or self.settings.get("ggml_experts") == "each":
            return False
        return not any(r is not None for r in self.args.recurrent_states())

    async def _spans_on_graphs(self, graphs: DecodeGraphs, tok: np.ndarray, positions: np.ndarray,
                               logits: Literal["last", "all"]) -> np.ndarray:
        """The logits of a prompt's ids ``tok`` at ``positions``, as ``forward`` gives them (the last
        position's (1, V), or every position's (T, V) by the per-operation head), in spans of at most
        PREFILL_CHUNK positions, each run together block by block (:meth:`DecodeGraphs.begin_span`): every
        product over all its positions at once, attention causal over the cache, each expert read once for
        the span and multiplied over all the (position, rank) cells routed to it in one product. From a span
        whose graphs show a non-finite value on, the per-operation pass runs the rest (and names the place);
        the spans before it stay, their keys in the cache.

        A span's logits are llama.cpp's arithmetic (its products over all positions, llama.cpp's kernels), not
        bit for bit those of its positions decoded one by one; within this backend they depend only on the
        ids, whatever the cache, its size or the order experts arrive in (an expert's cells are always one
        product)."""
        streams: list[np.ndarray] = []
        for s in range(0, len(tok), PREFILL_CHUNK):
            span = tok[s: s + PREFILL_CHUNK]
            graphs.begin_span(self.slots.index(self.slot), self.cache, int(positions[s]), len(span))
            self._buffers = self._span_buffers().first(len(span))
            self.step_unions = []
            try:
                ran = await self._blocks_on_graphs(graphs, span)
                if ran:
                    graphs.commit_span()
            finally:
                graphs.span = None
            if not ran:
                rest = await MoETransformer._logits(self, tok[s:], positions[s:], None, logits)
                if logits == "last" or not streams:
                    return rest
                return np.concatenate([MoETransformer.output_logits(self, np.concatenate(streams)), rest])
            graphs.spans += 1
            if logits == "all":
                streams.append(self._buffers.stream.copy())
        if logits == "all":
            return MoETransformer.output_logits(self, np.concatenate(streams))
        last = self._buffers.stream[-1:]  # the head of the last position alone: the decode step's graph
        self._buffers = self._buffers_for(1)
        np.copyto(self._buffers.stream, last)
        return self._head(graphs)

    def _span_buffers(self) -> StepBuffers:
        """The buffers of spans: PREFILL_CHUNK rows, made at the first span (no logits rows: a span's head runs
        on its last row alone, in the one-row buffers)."""
        if "span" not in self._buffer_sets:
            a = self.args
            self._buffer_sets["span"] = StepBuffers.make(0, a.embedding_length, a.expert_count, a.expert_used_count,
                                                         0, PREFILL_CHUNK)
        return self._buffer_sets["span"]

    async def _step_on_graphs(self, graphs: DecodeGraphs, tok: np.ndarray) -> np.ndarray | None:
        """The logits (B, V) of the step :meth:`DecodeGraphs.begin` began, for its tokens ``tok`` (B,): on one
        graph when it can, else block by block; None when a non-finite value appeared."""
        self._buffers = self._buffers_for(len(tok))
        self.step_unions = []
        discarded = self.one_graph_misses
        out = await self._step_on_one_graph(graphs, tok)
        if out is None:
            misses = self.experts.misses
            out = await self._step_on_block_graphs(graphs, tok)
            self.step_path.observe(self.experts.misses == misses and self.one_graph_misses == discarded)
        else:
            self.step_path.observe(True)
        if out is not None:
            graphs.steps += 1
        return out

    async def decode_batch(self, rows: Sequence[tuple[int, int]]) -> np.ndarray:
        """One decode step of several sequences on one set of graphs (see :meth:`MoETransformer.decode_batch`):
        attention per sequence over its own cache, every product by a trunk matrix once for all rows where
        that gives each row its bits alone (:meth:`GgmlKernels.rows_alike`), each expert read once for the
        rows that route to it. A step whose graphs show a non-finite value runs again one sequence at a time,
        which names the place."""
        self._check_batch(rows)
        graphs = self.decode_graphs() if len(rows) > 1 and self.batchable() else None
        if graphs is None:
            return await super().decode_batch(rows)
        slots = [self.slots[index] for index, _ in rows]
        tok = np.array([token for _, token in rows], np.int64)
        self.experts.step(len(rows), len(rows))
        for s in slots:
            s.cache.start(s.n_past)
        graphs.begin([(index, s.cache, s.n_past) for (index, _), s in zip(rows, slots)])
        out = await self._step_on_graphs(graphs, tok)
        if out is None or not np.isfinite(out).all():
            return await super().decode_batch(rows)
        for s, token in zip(slots, tok.tolist()):
            s.cache.commit(s.n_past + 1)
            s.n_past += 1
            s.ids.append(token)
        self.batch_steps += 1
        return out

    def output_logits(self, rows: np.ndarray) -> np.ndarray:
        graphs = self.decode_graphs() if len(rows) == 1 else None
        if graphs is None:
            return super().output_logits(rows)
        self._buffers = self._buffers_for(1)
        np.copyto(self._buffers.stream, rows)
        return self._head(graphs)

    # --- the graphs, traced from the description ---------------------------------------------

    def _attention_graph(self, f: GgmlBuilder, layer: int) -> list[tuple[Node, np.ndarray]]:
        """Block ``layer``'s attention and, for a block with experts, its router: the residual after the
        attention, the FFN's input, the experts in order and the first k's weights."""
        b = self._buffers
        _, x2, h2 = self.block_attention(f, layer, f.input(b.stream))
        outputs = [(x2, b.residual), (h2, b.moe_input)]
        if self.args.is_moe(layer):
            order, _, weights = self._route(f, layer, h2)
            outputs += [(order, b.order), (weights, b.weights)]
        return [*outputs, (f.check_total(), b.check)]

    def _route(self, f: GgmlBuilder, layer: int, h: Node) -> tuple[Node, Node, Node]:
        blk, a = self.model.blocks[layer], self.args
        logits = f.linear(blk.ffn_gate_inp, h)
        if blk.get("ffn_gate_inp.bias") is not None:
            logits = f.add(logits, blk["ffn_gate_inp.bias"])
        return f.route(logits, a.expert_used_count, a.routing, blk.get("exp_probs_b.bias"))

    def _dense_graph(self, f: GgmlBuilder, layer: int) -> list[tuple[Node, np.ndarray]]:
        b = self._buffers
        out = f.add(f.input(b.residual), self.dense_ffn(f, layer, f.input(b.moe_input)))
        return [(out, b.stream), (f.check_total(), b.check)]

    def _shared_graph(self, f: GgmlBuilder, layer: int) -> list[tuple[Node, np.ndarray]]:
        b = self._buffers
        shared = self.shared_expert(f, layer, f.input(b.moe_input))
        return [(shared, b.shared), (f.check_total(), b.shared_check)]

    def _head_graph(self, f: GgmlBuilder) -> list[tuple[Node, np.ndarray]]:
        b, model = self._buffers, self.model
        logits = f.linear(model.output, f.rms_norm(f.input(b.stream), model.output_norm))
        return [(logits, b.logits), (f.check_total(), b.check)]

    def _step_graph(self, f: GgmlBuilder, resident: ResidentExperts) -> list[tuple[Node, np.ndarray]]:
        """The whole step: every block's attention and router, its experts picked through the pool's slot
        table and run over the pool (or its dense FFN), the head. The same nodes as the per-block graphs,
        so the same bits."""
        a, b, model = self.args, self._buffers, self.model
        x = f.input(b.stream)
        outputs = []
        for layer in range(a.block_count):
            _, x2, h2 = self.block_attention(f, layer, x)
            if not a.is_moe(layer):
                x = f.add(x2, self.dense_ffn(f, layer, h2))
                continue
            order, top, weights = self._route(f, layer, h2)
            shape = self._experts_shape(layer, depth=resident.depth, gate_up=self._pool_gate_up(resident, layer))
            x = f.experts_in_pool(shape, h2, x2, top, weights, resident.slots[layer], resident.bases[layer],
                                  resident.strides[layer], self._expert_biases(layer), self.shared_expert(f, layer, h2))
            outputs += [(order, b.step_order[layer]), (weights, b.step_weights[layer])]
        logits = f.linear(model.output, f.rms_norm(x, model.output_norm))
        return [*outputs, (x, b.stream), (logits, b.logits), (f.check_total(), b.step_check)]

    # --- running them -----------------------------------------------------------------------

    async def _step_on_one_graph(self, graphs: DecodeGraphs, tok: np.ndarray) -> np.ndarray | None:
        """The logits of this step from one graph, when every expert it routes to is resident in the
        source's pool; None when the step must run block by block instead (nothing of this attempt is
        kept but the KV cache rows at this position, which that run writes again before any block reads
        them).

        The graph picks each block's experts through the source's slot table while it runs; afterwards
        the table says whether each chosen expert was really in (a slot that was not ready was read for
        nothing, its result is dropped). The graph runs on this thread, the event loop's, so no read can
        start into a slot and no slot can change hands while it runs. The source then counts the step as
        its per-block requests would have. Nothing was read, so nothing is hinted: lookahead only pays
        when something misses. It is tried only while steps are seldom missing an expert
        (:class:`StepPathGuess`): a try that misses is a step computed twice.
        """
        source, a = self.experts, self.args
        if self.settings.get("ggml_step") != "graph":
            return None
        layers = [layer for layer in range(a.block_count) if a.is_moe(layer)]
        resident = source.resident(layers, a.expert_count)
        if resident is None:
            return None
        if resident.holds_all and source.warming and not resident.ready[layers].all():
            # Experts in the page cache while the warm start fills it (the first steps after a prompt): a step
            # routes to one not read yet almost surely (a prompt of 32 leaves ~12% of the 8-layer cut's experts
            # unread: 1 - 0.88^64 for 8 choices in 8 layers), and the one graph would be a step computed for
            # nothing. Block by block waits only for its own; the one graph follows once the fill is over.
            return None
        if not self.step_path.try_one_graph():
            return None
        if source.reading:
            await asyncio.sleep(0)  # let reads that have landed report (their slots become ready)
        from colibri_aio.kernels.ggml_graph import STEP_SCRATCH

        # Room for the graph's tensors: ~160 a block for one row (85 nodes), each further row's attention and
        # routing ~96 more (measured on the 8-layer cut: 684 nodes at one row, 2548 at eight).
        n_nodes = (160 + 96 * (len(tok) - 1)) * a.block_count + 4096
        graph = graphs.traced(("step",), lambda f: self._step_graph(f, resident), n_nodes=n_nodes,
                              max_arena=STEP_SCRATCH)
        if graph is None:
            return None
        b = self._buffers
        np.copyto(b.stream, self.embed(tok))
        graphs.run(graph)
        for layer in range(a.block_count):
            graphs.wrote(layer)
        chosen = b.step_order[layers, :, :a.expert_used_count]                        # (blocks, B, k)
        if not resident.ready[np.asarray(layers)[:, None, None], chosen].all():
            self.one_graph_misses += 1
            return None
        if not np.isfinite(b.step_check[0]):
            return None       # the per-block graphs find the place, or the per-operation pass names it
        routed = [(layer, np.unique(row).tolist()) for layer, row in zip(layers, chosen)]
        source.routed(routed)
        self.step_unions = [len(experts) for _, experts in routed]
        self.one_graph_steps += 1
        return b.logits.copy()

    async def _step_on_block_graphs(self, graphs: DecodeGraphs, tok: np.ndarray) -> np.ndarray | None:
        """The logits (B, V) of this step, block by block, or None when a non-finite value appeared."""
        return self._head(graphs) if await self._blocks_on_graphs(graphs, tok) else None

    async def _blocks_on_graphs(self, graphs: DecodeGraphs, tok: np.ndarray) -> bool:
        """The residual stream after every block into the stream buffer, block by block; False when a
        non-finite value appeared."""
        a, b, n = self.args, self._buffers, len(tok)
        x = self.embed(tok)
        if not np.isfinite(x).all():
            return False
        np.copyto(b.stream, x)
        used = a.expert_used_count
        for layer in range(a.block_count):
            graphs.run(graphs.traced(("attention", layer), lambda f: self._attention_graph(f, layer)))
            graphs.wrote(layer)
            if not np.isfinite(b.check[0]):
                return False
            predicted = self._lookahead(layer, b.stream, b.residual, b.moe_input)
            if not a.is_moe(layer):
                if predicted is not None:
                    self.experts.hint(layer + 1, predicted)
                graphs.run(graphs.traced(("dense", layer), lambda f: self._dense_graph(f, layer), rows=n))
                if not np.isfinite(b.check[0]):
                    return False
                continue
            if not await self._experts_on_graphs(graphs, layer, b.order[:, :used].tolist(), predicted):
                return False
        return bool(np.isfinite(b.stream).all())

    def _head(self, graphs: DecodeGraphs) -> np.ndarray:
        """Logits (B, V) of the rows in the stream buffer; NaN when the head's input is not finite (as the
        per-operation backend gives)."""
        b = self._buffers
        graphs.run(graphs.traced(("head",), self._head_graph, rows=len(b.stream)))
        logits = b.logits.copy()
        if not np.isfinite(b.check[0]):
            logits[:] = np.nan
        return logits

    async def _experts_on_graphs(self, graphs: DecodeGraphs, layer: int, ids: list[list[int]],
                                 predicted: list[int] | None) -> bool:
        """The residual stream after block ``layer``'s experts into the stream buffer, for each row its experts
        ``ids[row]`` (in rank order), plus the shared expert's output (its graph runs once this layer's reads
        are out); False when a non-finite value appeared in the shared expert. Each expert any row routes to
        is read once (the union).

        Several rows (a batched step), where the experts' type allows (:meth:`_cells_together`): each batch
        as it arrives in one product over every (row, rank) cell it serves, each expert's weights loaded once
        for all its rows. Otherwise row by row: a row whose experts are all in the source's first batch
        (resident, or landed) in one graph, the others batch by batch, giving each expert's weighted output.
        Either way the rank-ordered sum follows in NumPy, which rounds as the graph does (one addition at a
        time, then the shared expert, then the residual), so neither arrival nor the other rows change a
        bit. (A batch's weights are only held while it is being used: the source may reuse its slots for
        the next.)
        """
        b = self._buffers
        shared_on = self.shared_expert_on(layer)
        together = self._cells_together(layer, len(ids), span=graphs.span is not None)
        terms = b.terms
        summed = [False] * len(ids)           # rows whose one graph gave their whole sum
        first = True
        union = sorted(set().union(*ids))
        self.step_unions.append(len(union))
        if graphs.span is not None:   # a prompt's: what its router nearly chose is what a warm start reads first
            used = len(ids[0])
            self.experts.near_misses(layer, b.order[:, used:2 * used].ravel().tolist())
        async with aclosing(self.experts.stream(layer, union)) as stream:
            async for batch in stream:
                by_id = dict(batch)
                if first:
                    if predicted is not None:
                        self.experts.hint(layer + 1, predicted)
                    if shared_on:
                        graphs.run(graphs.traced(("shared", layer), lambda f: self._shared_graph(f, layer),
                                                 rows=len(ids)))
                        if not np.isfinite(b.shared_check[0]):
                            return False
                if graphs.span is not None and self._span_per_expert(layer):
                    self.weighted_terms(layer, batch, b.moe_input, np.asarray(ids), b.weights, terms)
                    first = False
                    continue
                if first and graphs.span is not None and len(by_id) == len(union) \
                        and self._span_on_graphs(graphs, layer, ids, by_id):
                    return True
                if not (together and self._cells_on_graphs(graphs, layer, ids, by_id)):
                    self._rows_on_graphs(graphs, layer, ids, by_id, first, summed)
                first = False
        self._rank_sums([i for i, done in enumerate(summed) if not done], terms, shared_on)
        return True

    def _cells_together(self, layer: int, rows: int, span: bool = False) -> bool:
        """Whether a step of ``rows`` rows runs block ``layer``'s experts over all its rows at once: several
        rows, ``COLIBRI_GGML_EXPERT_CELLS=batch``, and a product over several cells gives each cell its
        own bits for the experts' types on this build (:meth:`GgmlKernels.cells_alike`). A span's rows always
        do (they owe no position the bits it has alone), unless experts run one by one."""
        shape = self._experts_shape(layer)
        if span:
            return not shape.each
        if rows < 2 or self.settings.get("ggml_expert_cells") != "batch":
            return False
        return not shape.each and self.kernels.cells_alike(shape.gate) and self.kernels.cells_alike(shape.down)  # type: ignore[attr-defined]

    def _span_per_expert(self, layer: int) -> bool:
        """Whether a span's experts of block ``layer`` run one product per expert over all its rows
        (:meth:`weighted_terms`, as the per-operation prefill runs them) rather than ``ggml_mul_mat_id`` over
        the cells, which loads an expert's weights for every cell: SwiGLU experts without biases of a type
        llamafile's GEMM multiplies (:meth:`GgmlKernels.on_gemm`; its products carry vec_dot's bits, row for
        row, so a cell's bits are the ones it has in any other path), and repacked experts with biases or
        another activation (gpt-oss's MXFP4: each expert's products on the repacked GEMM). Decided by the
        block's experts alone, never by how they arrive, so a span's bits do not depend on the cache."""
        shape = self._experts_shape(layer)
        if shape.activation == "swiglu" and not shape.biased:
            return not shape.weights_first and self.kernels.on_gemm(shape.gate, shape.down)  # type: ignore[attr-defined]
        return shape.gate.packed and shape.down.packed

    def _span_on_graphs(self, graphs: DecodeGraphs, layer: int, ids: list[list[int]], by_id: dict) -> bool:
        """A span's experts, every one in the first batch (resident), in one graph over all its rows that also
        sums them into the stream: the bits the cells and the rank-ordered sum give (:meth:`DecodeGraphs.
        experts_over_rows`); False when they are not one stack (the caller runs them as cells)."""
        b = self._buffers
        shared_on = self.shared_expert_on(layer)
        if not graphs.experts_over_rows(self._experts_shape(layer), b.moe_input, b.residual, b.stream, by_id,
                                        np.asarray(ids, np.int32), b.weights, self._expert_biases(layer),
                                        b.shared if shared_on else None):
            return False
        self.span_expert_graphs += 1
        return True

    def _cells_on_graphs(self, graphs: DecodeGraphs, layer: int, ids: list[list[int]], by_id: dict) -> bool:
        """Each (row, rank) cell whose expert is in ``by_id`` (one arriving batch) into the terms buffer, all
        in one product (:meth:`DecodeGraphs.expert_cells`); False (nothing written) when the batch's experts
        are not one stack, for the caller to run the rows one by one."""
        b = self._buffers
        routed = np.asarray(ids, np.int32)                                    # (B, k)
        rows, ranks = np.nonzero(np.isin(routed, np.fromiter(by_id, np.int32, len(by_id))))
        if rows.size == 0:
            return True
        out = graphs.expert_cells(self._experts_shape(layer), b.moe_input[rows], by_id, routed[rows, ranks],
                                  np.ascontiguousarray(b.weights[rows, ranks]), self._expert_biases(layer))
        if out is None:
            return False
        b.terms[rows, ranks] = out
        if graphs.span is None:
            self.expert_cell_products += 1
        return True

    def _rows_on_graphs(self, graphs: DecodeGraphs, layer: int, ids: list[list[int]], by_id: dict, first: bool,
                        summed: list[bool]) -> None:
        """Each row's experts of one arriving batch, row by row: a row whose experts all came in the first
        batch in one graph that also sums them (``summed``), the others' weighted outputs into the terms
        buffer."""
        b = self._buffers
        shared_on = self.shared_expert_on(layer)
        biases = self._expert_biases(layer)
        for i, row in enumerate(ids):
            ranks = [rank for rank, expert in enumerate(row) if expert in by_id]
            if not ranks:
                continue
            one = slice(i, i + 1)
            if first and len(ranks) == len(row):
                graphs.experts(self._experts_shape(layer), b.moe_input[one], b.residual[one], b.stream[one],
                               [by_id[e] for e in row], row, b.weights[one], biases,
                               b.shared[one] if shared_on else None)
                summed[i] = True
                continue
            shape = self._experts_shape(layer, used=len(ranks))
            ys = graphs.experts(shape, b.moe_input[one], b.residual[one], b.stream[one],
                                [by_id[row[r]] for r in ranks], [row[r] for r in ranks],
                                np.ascontiguousarray(b.weights[i, ranks][None]), biases, terms=True)
            b.terms[i, ranks] = ys

    def _rank_sums(self, rows: list[int], terms: np.ndarray, shared_on: bool) -> None:
        """The stream of ``rows`` = residual + (((t0 + t1) + t2) ... + shared): their terms summed in rank
        order one addition at a time, as the graphs add, for all these rows at once."""
        if not rows:
            return
        b = self._buffers
        every = len(rows) == len(b.stream)
        t = terms if every else terms[rows]
        acc = t[:, 0]
        for r in range(1, t.shape[1]):
            acc = acc + t[:, r]
        if shared_on:
            acc = acc + (b.shared if every else b.shared[rows])
        if every:
            np.add(b.residual, acc, out=b.stream)
        else:
            b.stream[rows] = b.residual[rows] + acc

    # --- what a block's experts are ---------------------------------------------------------

    def shared_expert_on(self, layer: int) -> bool:
        """Whether block ``layer`` has a shared expert (:meth:`MoETransformer.shared_expert`)."""
        return "ffn_up_shexp" in self.model.blocks[layer]

    def _expert_biases(self, layer: int) -> list[np.ndarray] | None:
        blk = self.model.blocks[layer]
        biases = [blk.get(f"ffn_{p}_exps.bias") for p in ("gate", "up", "down")]
        return None if biases[0] is None else biases  # type: ignore[return-value]

    def _experts_shape(self, layer: int, *, used: int | None = None, depth: int = 0,
                       gate_up: bool = False) -> ExpertsShape:
        """The experts graph's shape for block ``layer`` (its experts' types and sizes, from the file's
        expert table), made once per block and batch size; ``depth`` and ``gate_up`` are the pool's (the
        experts graph finds its batch's own)."""
        key = (layer, used, depth, gate_up)
        shapes = self.__dict__.setdefault("_experts_shapes", {})
        if key not in shapes:
            from colibri_aio.kernels.ggml_graph import ExpertsShape

            k, first = self.kernels, self.model.experts[layer][0]
            biased = self._expert_biases(layer) is not None
            # The source says which matrices it delivers repacked (every expert alike: LandedPacking).
            packing = getattr(self.experts, "packing", None)
            gate, down = ((r, packing is not None and packing.packs(r)) for r in (first.gate, first.down))
            shapes[key] = ExpertsShape(
                k.expert_mat(*gate), k.expert_mat(*down),  # type: ignore[attr-defined]
                used or self.args.expert_used_count, depth, gate_up, self.expert_activation, biased,
                self.shared_expert_on(layer), each=self.settings.get("ggml_experts") == "each",
                n_experts=self.args.expert_count if biased else 0, weights_first=self.expert_weights_first)
        return shapes[key]

    def _pool_gate_up(self, resident: ResidentExperts, layer: int) -> bool:
        """Whether each expert's up matrix follows its gate in the pool (one product of 2F rows)."""
        first = self.model.experts[layer][0]
        base = resident.bases[layer]
        return (self.expert_activation == "swiglu" and self._expert_biases(layer) is None
                and base[1] - base[0] == first.gate.nbytes)
