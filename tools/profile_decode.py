"""Where the time of one decode step goes, per kernel backend: expert matvecs, attention
projections, attention itself, the output head, routing, and the rest (Python overhead).

The forward pass's ``linear`` and ``attention`` and the MoE step are wrapped
with timers; each ``linear`` call is attributed by the tensor it multiplies
(attn_q/k/v/output, the output head, or an expert). Routing is the MoE step
minus its expert matvecs (router product, top-k, the cache's bookkeeping).
Teacher-forced decode of fixed ids on a model held in RAM (every expert
cached), after one warm-up pass; n runs, median and min–max per category.

    python tools/profile_decode.py MODEL.gguf --runs 5 --tokens 16
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from colibri_aio.arch import layers
from colibri_aio.engine.engine import Engine
from colibri_aio.kernels import backend
from colibri_aio.bench.receipt import header as receipt_header, write as write_receipt

ROOT = Path(__file__).resolve().parents[1]
CATEGORIES = ("expert matvecs", "attention projections", "attention", "output head", "routing", "python overhead")


class Timers:
    """Seconds per category, filled by wrappers around the forward pass's helpers."""

    def __init__(self, model) -> None:
        self.t: dict[str, float] = defaultdict(float)
        self.kind = {id(model.output.data): "output head"}
        for b in model.blocks:
            for w in (b.attn_q, b.attn_k, b.attn_v, b.attn_output):
                self.kind[id(w.data)] = "attention projections"
        self._linear, self._attention, self._moe = layers.linear, layers.attention, layers.MoETransformer._moe

    def install(self) -> None:
        timers = self

        def linear(w, x):
            t0 = time.perf_counter()
            out = timers._linear(w, x)
            timers.t[timers.kind.get(id(w.data), "expert matvecs")] += time.perf_counter() - t0
            return out

        def attention(*a):
            t0 = time.perf_counter()
            out = timers._attention(*a)
            timers.t["attention"] += time.perf_counter() - t0
            return out

        async def moe(net, *a, **k):
            t0, before = time.perf_counter(), timers.t["expert matvecs"]
            out = await timers._moe(net, *a, **k)
            timers.t["moe step"] += time.perf_counter() - t0 - (timers.t["expert matvecs"] - before)
            return out

        layers.linear, layers.attention, layers.MoETransformer._moe = linear, attention, moe

    def take(self) -> dict[str, float]:
        out, self.t = dict(self.t), defaultdict(float)
        return out


async def one_run(engine: Engine, timers: Timers, ids: list[int]) -> dict[str, float]:
    net = engine.net
    net.reset()
    await net.forward(ids[:1])
    timers.take()
    t0 = time.perf_counter()
    for t in ids[1:]:
        await net.forward([t])
    wall = time.perf_counter() - t0
    t = timers.take()
    n = len(ids) - 1
    per = {"expert matvecs": t.get("expert matvecs", 0.0), "attention projections": t.get("attention projections", 0.0),
           "attention": t.get("attention", 0.0), "output head": t.get("output head", 0.0),
           "routing": t.get("moe step", 0.0)}
    per["python overhead"] = wall - sum(per.values())
    return {k: v / n * 1e3 for k, v in per.items()} | {"total": wall / n * 1e3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--kernels", default="numpy,auto")
    p.add_argument("--out", type=Path, default=ROOT / "evidence")
    args = p.parse_args()
    ids = np.random.default_rng(0).integers(3, 2048, args.tokens + 1).tolist()
    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(Engine.open(args.model, prefetch="off", n_ctx=len(ids) + 1,
                                                 cache_per_layer=10**6))
    timers = Timers(engine.model)
    timers.install()
    arms = args.kernels.split(",")
    samples: dict[str, list[dict[str, float]]] = {a: [] for a in arms}
    for run in range(args.runs + 1):
        for a in arms:
            backend.set_backend(a)
            r = loop.run_until_complete(one_run(engine, timers, ids))
            if run:
                samples[a].append(r)
    loop.run_until_complete(engine.aclose())
    summary = {a: {k: {"median": statistics.median(s[k] for s in xs), "min": min(s[k] for s in xs),
                       "max": max(s[k] for s in xs)} for k in (*CATEGORIES, "total")} for a, xs in samples.items()}
    receipt = {**receipt_header("tools/profile_decode.py"), "model": args.model.name,
               "unit": "ms per decoded token", "summary": summary, "samples": samples}
    stamp = receipt["date"]
    lines = [f"# One decode step, by category — {stamp}", "",
             f"host `{receipt['host']}`, commit `{receipt['commit']}`, model `{args.model.name}` (every expert "
             f"cached: a model in RAM), load average at end {receipt['load_average']}", "",
             f"Command: `{receipt['command']}`", "",
             "ms per decoded token, median [min–max] over the runs; routing is the MoE step without its expert "
             "work (router product, top-k, the source's bookkeeping); Python overhead is the rest of the wall time.",
             "", "| category | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
    for k in (*CATEGORIES, "total"):
        cells = [f"{summary[a][k]['median']:.2f} [{summary[a][k]['min']:.2f}–{summary[a][k]['max']:.2f}]"
                 for a in arms]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    write_receipt(args.out, f"profile_decode_{stamp}", receipt, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
