"""Where the time of one decode step goes: native kernels versus everything Python does around them.

Teacher-forced decode of fixed ids on a model held in RAM (every expert
cached), after one warm-up pass; n runs, median and min–max per category,
per kernel backend. Timers wrap:

* the engine's kernel backend, per operation (``linears`` = q/k/v, ``linear``
  split into attention output and output head, ``expert_ffns``, ``dequantize``);
  for ggml also the native graph computation alone (``ggml_graph_compute``,
  threads included), so a call's wrapper (graph lookup, re-pointing, output
  arrays) shows as its own line;
* the forward pass's NumPy trunk ops (RMSNorm, RoPE, attention, router top-k);
* the MoE step without its kernel calls (router product, the expert source's
  bookkeeping, scattering outputs).

On the decode graphs (qwen3moe on ggml: arch/decode_graphs.py) the kernel lines
are the block attention-and-router graph, the block experts graph and the
output head graph, or, when every expert a step routes to is resident, the
one-graph step (all blocks and the head) and what Python does around it;
NumPy does no trunk op there.

**Python overhead** = wall time − native kernel time: for ggml the time inside
``ggml_graph_compute``, for NumPy the time inside kernel calls (NumPy's own
per-call overhead counts as kernel time there, which flatters it). The
target of issue 12 is below 5% of the step for the fast backend.

With ``--context N`` the decoded tokens follow N positions of context (one
untimed batch), as in tools/bench_decode.py.

    python tools/profile_decode.py MODEL.gguf --runs 5 --tokens 32 --kernels ggml
    COLIBRI_GGML_ATTENTION=f16 python tools/profile_decode.py MODEL.gguf --context 2048
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from colibri_aio.arch import graph, layers, rope
from colibri_aio.engine.engine import Engine
from colibri_aio.bench.lock import exclusive
from colibri_aio.bench.receipt import header as receipt_header, host_line, write as write_receipt

ROOT = Path(__file__).resolve().parents[1]
# The trunk's NumPy ops, as the shared forward pass (arch/layers.py) and the NumPy runner of the families'
# descriptions (arch/graph.py NumpyBuilder) import them.
NUMPY_OPS = {rope: ("rope_cos_sin", "rope_yarn_cos_sin"), layers: ("route",), graph: ("rms_norm", "rope_neox", "rope_norm", "attention")}


class Timers:
    """Seconds per category, filled by wrappers installed on one engine."""

    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)

    def timed(self, category, fn):
        """``fn`` wrapped; ``category`` is a name or a function of the call's arguments."""
        timers = self

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                name = category(*a) if callable(category) else category
                timers.t[name] += time.perf_counter() - t0

        return wrapper

    def install(self, engine: Engine) -> None:
        k, model = engine.kernels, engine.model
        head = id(model.output.data)
        k.linears = self.timed("kernel: q/k/v (linears)", k.linears)
        k.linear = self.timed(lambda w, x: "kernel: output head" if id(w.data) == head
                              else "kernel: attention output", k.linear)
        k.expert_ffns = self.timed("kernel: expert FFNs", k.expert_ffns)
        k.head_linears = self.timed("kernel: per-head products (MLA lifts)", k.head_linears)
        k.dequantize = self.timed("kernel: embedding rows", k.dequantize)
        if k.name == "ggml":
            from colibri_aio.kernels import ggml_cpu
            ggml_cpu.Graph.run = self.timed("native: ggml_graph_compute", ggml_cpu.Graph.run)
        for module, names in NUMPY_OPS.items():
            for name in names:
                setattr(module, name, self.timed(f"numpy: {name}", getattr(module, name)))
        moe, timers = layers.MoETransformer._moe, self
        graphs = getattr(engine.net, "decode_graphs", lambda: None)()
        if graphs is not None:  # decode steps on whole graphs (arch/decode_graphs.py)
            # each traced graph by its kind: attention (+ router), dense, shared, head, step (the whole step)
            graphs.run = self.timed(lambda graph: f"kernel: {graph.key[0]} graph", graphs.run)
            graphs.experts = self.timed("kernel: block experts graph", graphs.experts)
            from colibri_aio.arch import decode_graphs
            one_graph = decode_graphs.GraphDecode._step_on_one_graph
            step_key = "kernel: step graph"

            async def one_graph_step(net, *a, **kw):
                t0, inner = time.perf_counter(), timers.t[step_key]
                out = await one_graph(net, *a, **kw)
                timers.t["one-graph step without its graph (slot check, scheduler)"] += (
                    time.perf_counter() - t0 - (timers.t[step_key] - inner))
                return out

            decode_graphs.GraphDecode._step_on_one_graph = one_graph_step
            on_graphs = decode_graphs.GraphDecode._experts_on_graphs
            inner_keys = ("kernel: block experts graph", "kernel: expert FFNs")

            async def experts_step(net, *a, **kw):
                t0, inner = time.perf_counter(), sum(timers.t[k] for k in inner_keys)
                out = await on_graphs(net, *a, **kw)
                inner = sum(timers.t[k] for k in inner_keys) - inner
                timers.t["moe step without kernels and routing"] += time.perf_counter() - t0 - inner
                return out

            decode_graphs.GraphDecode._experts_on_graphs = experts_step

        async def moe_step(net, *a, **kw):
            t0, inner = time.perf_counter(), timers.t["kernel: expert FFNs"] + timers.t["numpy: route"]
            out = await moe(net, *a, **kw)
            inner = timers.t["kernel: expert FFNs"] + timers.t["numpy: route"] - inner
            timers.t["moe step without kernels and routing"] += time.perf_counter() - t0 - inner
            return out

        layers.MoETransformer._moe = moe_step

    def take(self) -> dict[str, float]:
        out, self.t = dict(self.t), defaultdict(float)
        return out


async def one_run(engine: Engine, timers: Timers, ids: list[int], context: int = 0) -> dict[str, float]:
    net = engine.net
    net.reset()
    await net.forward(ids[: context + 1])
    timers.take()
    t0 = time.perf_counter()
    for t in ids[context + 1:]:
        await net.forward([t])
    wall = time.perf_counter() - t0
    t = timers.take()
    kernel_calls = sum(v for k, v in t.items() if k.startswith("kernel:"))
    native = t.get("native: ggml_graph_compute", kernel_calls)
    t["kernel call wrappers"] = kernel_calls - native if "native: ggml_graph_compute" in t else 0.0
    t["other (forward pass, embedding, residuals)"] = (
        wall - kernel_calls - sum(v for k, v in t.items() if k.startswith("numpy:"))
        - t.get("moe step without kernels and routing", 0.0)
        - t.get("one-graph step without its graph (slot check, scheduler)", 0.0))
    t["python overhead"] = wall - native
    n = len(ids) - 1 - context
    out = {k: v / n * 1e3 for k, v in t.items()}
    out["total"] = wall / n * 1e3
    out["python overhead %"] = 100 * (wall - native) / wall
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--context", type=int, default=0, help="positions of context before the decoded tokens")
    p.add_argument("--kernels", default="ggml")
    p.add_argument("--out", type=Path, default=ROOT / "evidence")
    p.add_argument("--lock", type=Path, default=None, help="hold this lock file exclusively during each run")
    args = p.parse_args()
    if min(args.runs, args.tokens) < 1 or args.context < 0:
        p.error("--runs and --tokens must be positive, --context not negative")
    ids = np.random.default_rng(0).integers(3, 2048, args.context + args.tokens + 1).tolist()
    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(Engine.open(args.model, prefetch="off", n_ctx=len(ids) + 1,
                                                 cache_per_layer=10**6, kernels=args.kernels))
    timers = Timers()
    timers.install(engine)
    samples = []
    for run in range(args.runs + 1):
        with exclusive(args.lock):
            r = loop.run_until_complete(one_run(engine, timers, ids, args.context))
        if run:
            samples.append(r)
    loop.run_until_complete(engine.aclose())
    keys = sorted({k for s in samples for k in s}, key=lambda k: (k in ("total", "python overhead",
                                                                       "python overhead %"), k))
    summary = {k: {"median": statistics.median(s.get(k, 0.0) for s in samples),
                   "min": min(s.get(k, 0.0) for s in samples), "max": max(s.get(k, 0.0) for s in samples)}
               for k in keys}
    receipt = {**receipt_header("tools/profile_decode.py"), "model": args.model.name, "kernels": args.kernels,
               "kernels_reason": engine.kernels.reason, "unit": "ms per decoded token", "context": args.context,
               "settings": {k: v for k, v in os.environ.items() if k.startswith("COLIBRI_")}, "summary": summary,
               "samples": samples}
    stamp = receipt["date"]
    lines = [f"# One decode step, by category — {stamp}", "",
             f"{host_line(receipt)}, commit `{receipt['commit']}`, model `{args.model.name}` (every expert "
             f"cached: a model in RAM), kernels {engine.kernels.name} ({engine.kernels.reason}), load average "
             f"at end {receipt['load_average']}", "", f"Command: `{receipt['command']}`", "",
             f"ms per decoded token over {args.tokens} teacher-forced tokens"
             + (f" after {args.context} positions of context" if args.context else "")
             + "".join(f", {k}={v}" for k, v in receipt["settings"].items())
             + f", median [min–max] of {args.runs} runs. "
             "Kernel lines include the native time inside them; **python overhead** is wall time minus native "
             "kernel time (tools/profile_decode.py docstring).", "", "| category | ms/token |", "|---|---|"]
    for k in keys:
        s = summary[k]
        lines.append(f"| {k} | {s['median']:.3f} [{s['min']:.3f}–{s['max']:.3f}] |")
    write_receipt(args.out, f"profile_decode_{stamp}", receipt, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
