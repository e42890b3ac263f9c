"""Routing statistics from a route trace: skew, locality, and cross-layer predictability.

Measurement rules, each avoiding a known trap:

- breadth counts each (run, layer, expert) once, however often it fired;
- locality compares consecutive positions of the same run only, never across runs;
- predictability compares layer L's prediction with layer L + 1's true top-k
  at the same (run, position); a leading dense block's prediction of the first
  block with experts counts too;
- leading dense blocks route nothing: they get no row of layer statistics.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class LayerStats:
    layer: int
    selections: int
    entropy: float          # expert-use entropy / log(E): 1 = uniform
    top10_share: float      # share of selections taken by the top 10% of experts
    breadth: float          # mean over runs of distinct experts used / E
    locality: float         # mean |S_t ∩ S_t-1| / k over consecutive positions of a run


@dataclass(frozen=True)
class PredictorStats:
    predictor: str
    recall_at_k: float      # |P_k ∩ S| / k  (= precision at k)
    recall_at_2k: float     # |P_2k ∩ S| / k
    precision_at_2k: float  # |P_2k ∩ S| / 2k


@dataclass(frozen=True)
class TraceStats:
    expert_count: int
    expert_used_count: int
    runs: int
    positions: int
    layers: list[LayerStats]
    predictors: list[PredictorStats]
    uniform_locality: float  # k / E: what independent uniform routing would give

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _layer_stats(layer: int, routes: dict[tuple[int, int], list[int]], e: int, k: int) -> LayerStats:
    counts = np.zeros(e, np.int64)
    per_run: dict[int, set[int]] = defaultdict(set)
    overlaps: list[float] = []
    for (run, pos), experts in sorted(routes.items()):
        counts[experts] += 1
        per_run[run].update(experts)
        prev = routes.get((run, pos - 1))
        if prev is not None:
            overlaps.append(len(set(prev) & set(experts)) / k)
    p = counts / max(counts.sum(), 1)
    nz = p[p > 0]
    top = np.sort(counts)[::-1][: max(1, math.ceil(0.1 * e))]
    return LayerStats(
        layer=layer,
        selections=int(counts.sum()),
        entropy=float(-(nz * np.log(nz)).sum() / math.log(e)),
        top10_share=float(top.sum() / max(counts.sum(), 1)),
        breadth=float(np.mean([len(s) / e for s in per_run.values()])),
        locality=float(np.mean(overlaps)) if overlaps else float("nan"),
    )


def compute(records: Iterable[dict[str, Any]]) -> TraceStats:
    """Statistics of one trace (header first, then route records)."""
    it = iter(records)
    header = next(it)
    e, k, n_layer = header["expert_count"], header["expert_used_count"], header["block_count"]
    first = header.get("leading_dense_block_count", 0)  # the first layer with experts
    routes: list[dict[tuple[int, int], list[int]]] = [{} for _ in range(n_layer)]
    predicted: dict[str, dict[tuple[int, int, int], list[int]]] = defaultdict(dict)
    for rec in it:
        key = (rec["run"], rec["pos"])
        routes[rec["layer"]][key] = rec["experts"]
        for name, ranked in rec.get("predicted", {}).items():
            predicted[name][(rec["run"], rec["pos"], rec["layer"])] = ranked
    preds = []
    for name, table in predicted.items():
        hits_k, hits_2k, n = 0, 0, 0
        for (run, pos, layer), ranked in table.items():
            truth = routes[layer + 1].get((run, pos))
            if truth is None:
                continue
            t = set(truth)
            hits_k += len(t & set(ranked[:k]))
            hits_2k += len(t & set(ranked[: 2 * k]))
            n += 1
        if n:
            preds.append(PredictorStats(name, hits_k / (n * k), hits_2k / (n * k), hits_2k / (n * 2 * k)))
    return TraceStats(
        expert_count=e, expert_used_count=k,
        runs=len({run for run, _ in routes[first]}), positions=len(routes[first]),
        # blocks without experts among the others (llama4's interleaved dense blocks) route nothing: no row
        layers=[_layer_stats(i, routes[i], e, k) for i in range(first, n_layer) if any(routes[i].values())],
        predictors=sorted(preds, key=lambda p: -p.recall_at_k),
        uniform_locality=k / e,
    )


def format_table(stats: TraceStats) -> str:
    """A plain-text report of :func:`compute`'s result."""
    lines = [f"runs {stats.runs}  positions {stats.positions}  experts {stats.expert_count}  top-{stats.expert_used_count}",
             "layer  entropy  top10%share  breadth  locality (uniform {:.3f})".format(stats.uniform_locality)]
    lines += [f"{s.layer:5d}  {s.entropy:7.3f}  {s.top10_share:11.3f}  {s.breadth:7.3f}  {s.locality:8.3f}"
              for s in stats.layers]
    lines.append("predictor               recall@k  recall@2k  precision@2k")
    lines += [f"{p.predictor:22s}  {p.recall_at_k:8.3f}  {p.recall_at_2k:9.3f}  {p.precision_at_2k:12.3f}"
              for p in stats.predictors]
    return "\n".join(lines)
