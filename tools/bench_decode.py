"""Teacher-forced decode and prefill speed: our engine (per kernel backend) beside llama.cpp, same file, same ids.

The model must fit in RAM (this measures kernels and overheads, not the disk):
our engine holds every expert in its cache, llama.cpp maps the file. The same
fixed ids are fed one at a time (DESIGN's "replay" protocol, so neither engine
can fall into a cached loop); prefill is the same ids as one batch. Arms are
interleaved, run 0 of each arm is a warm-up (caches filled, kernels loaded) and
not counted, then ``--runs`` timed runs each.

An arm of ours is a kernel backend (``numpy``, ``numba``, ``auto``), optionally
with the compiled matmul path after a slash (``auto/blas``, ``auto/fused``; see
``colibri_aio.kernels.jit.set_matmul``); without one it runs the default path.

    python tools/bench_decode.py MODEL.gguf --runs 5 --tokens 32 --arms auto/blas,auto/fused,llama.cpp
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

# colibri_aio first, as in the CLI: it sets OPENBLAS_NUM_THREADS=1 before NumPy loads OpenBLAS.
from colibri_aio import __version__
import numpy as np

from colibri_aio.engine.engine import Engine
from colibri_aio.kernels import backend
from colibri_aio.bench.receipt import header as receipt_header, write as write_receipt

ROOT = Path(__file__).resolve().parents[1]


class Ours:
    """Our engine with one kernel backend (and matmul path); the arms share one engine (and its warm expert cache)."""

    _shared: dict[Path, tuple[asyncio.AbstractEventLoop, Engine]] = {}

    def __init__(self, path: Path, arm: str, n_ctx: int) -> None:
        self.kernels, _, self.matmul = arm.partition("/")
        if path not in self._shared:
            loop = asyncio.new_event_loop()
            engine = loop.run_until_complete(Engine.open(
                path, prefetch="off", n_ctx=n_ctx, cache_per_layer=10**6))  # every expert fits: a model in RAM
            self._shared[path] = (loop, engine)
        self.loop, self.engine = self._shared[path]
        self._select()
        backend.warm_up()

    def _select(self) -> None:
        """This arm's backend and matmul path (the engine is shared, so before every run)."""
        select(self.kernels, self.matmul)

    def decode(self, ids: list[int]) -> float:
        self._select()
        net = self.engine.net

        async def run() -> float:
            net.reset()
            await net.forward(ids[:1])
            t0 = time.perf_counter()
            for t in ids[1:]:
                await net.forward([t])
            return time.perf_counter() - t0

        return self.loop.run_until_complete(run())

    def prefill(self, ids: list[int]) -> float:
        self._select()
        net = self.engine.net

        async def run() -> float:
            net.reset()
            t0 = time.perf_counter()
            await net.forward(ids)
            return time.perf_counter() - t0

        return self.loop.run_until_complete(run())


class LlamaCpp:
    def __init__(self, path: Path, n_ctx: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=2, n_threads_batch=2, n_batch=512,
                         logits_all=False, verbose=False)

    def decode(self, ids: list[int]) -> float:
        self.llm.reset()
        self.llm.eval(ids[:1])
        t0 = time.perf_counter()
        for t in ids[1:]:
            self.llm.eval([t])
        return time.perf_counter() - t0

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - t0


def select(kernels: str, matmul: str) -> None:
    """Use backend ``kernels`` and, if named, the compiled matmul path ``matmul`` (else the default)."""
    backend.set_backend(kernels)
    if backend.backend_name() == "numba":
        from colibri_aio.kernels import jit

        jit.set_matmul(matmul or jit.DEFAULT_MATMUL)
    elif matmul:
        raise SystemExit(f"arm {kernels}/{matmul}: a matmul path needs the compiled kernels")


def _kernels_of(arm: str) -> str:
    kernels, _, matmul = arm.partition("/")
    select(kernels, matmul)
    return f"{backend.backend_name()}: {backend.backend_reason()}"


def _ratio(r: dict, key: str, arm: str) -> str:
    """The arm's ratio to llama.cpp; 1 for llama.cpp itself, '-' when it did not run."""
    return "1.000" if arm == "llama.cpp" else (f"{r[key]:.3f}" if key in r else "-")


def stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--tokens", type=int, default=32, help="decode tokens per run (teacher-forced)")
    p.add_argument("--prefill", type=int, default=64, help="prefill positions per run")
    p.add_argument("--arms", default="numpy,auto,llama.cpp")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "evidence")
    args = p.parse_args()
    arms = args.arms.split(",")
    rng = np.random.default_rng(args.seed)
    ids = rng.integers(3, 2048, max(args.tokens + 1, args.prefill)).tolist()
    n_ctx = len(ids) + 8
    engines = {a: (LlamaCpp(args.model, n_ctx) if a == "llama.cpp" else Ours(args.model, a, n_ctx)) for a in arms}
    samples: dict[str, dict[str, list[float]]] = {a: {"decode_tok_s": [], "prefill_tok_s": []} for a in arms}
    for run in range(args.runs + 1):
        for a in arms:
            d = engines[a].decode(ids[: args.tokens + 1])
            pf = engines[a].prefill(ids[: args.prefill])
            if run == 0:
                continue  # warm-up
            samples[a]["decode_tok_s"].append(args.tokens / d)
            samples[a]["prefill_tok_s"].append(args.prefill / pf)
            print(json.dumps({"arm": a, "run": run, "decode_tok_s": args.tokens / d,
                              "prefill_tok_s": args.prefill / pf}), flush=True)
    summary = {a: {k: stats(v) for k, v in s.items()} for a, s in samples.items()}
    ratios = {}
    if "llama.cpp" in summary:
        ref = summary["llama.cpp"]
        for a in arms:
            if a != "llama.cpp":
                ratios[a] = {k: summary[a][k]["median"] / ref[k]["median"] for k in ("decode_tok_s", "prefill_tok_s")}
    receipt = {
        **receipt_header("tools/bench_decode.py"), "model": args.model.name,
        "model_bytes": args.model.stat().st_size, "tokens": args.tokens, "prefill": args.prefill,
        "engine_version": __version__, "openblas_num_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "kernels": {a: _kernels_of(a) for a, e in engines.items() if isinstance(e, Ours)},
        "summary": summary, "ratios_vs_llama_cpp": ratios,
        "note": "shared 2-vCPU machine; llama-cpp-python 0.3.36 built from source (AVX-512), n_threads=2",
    }
    stamp = receipt["date"]
    lines = [f"# Decode and prefill, in RAM — {stamp}", "",
             f"host `{receipt['host']}`, commit `{receipt['commit']}`, model `{args.model.name}` "
             f"({receipt['model_bytes'] / 1e9:.2f} GB), load average at end {receipt['load_average']}", "",
             f"Command: `{receipt['command']}`", "",
             f"Teacher-forced decode of {args.tokens} fixed ids one at a time; prefill of {args.prefill} ids as one "
             f"batch. {args.runs} timed runs per arm after one warm-up, arms interleaved.", "",
             "| arm | decode tok/s median [min–max] | prefill tok/s median [min–max] | decode ÷ llama.cpp | "
             "prefill ÷ llama.cpp |", "|---|---|---|---|---|"]
    for a in arms:
        d, pf = summary[a]["decode_tok_s"], summary[a]["prefill_tok_s"]
        r = ratios.get(a, {})
        lines.append(f"| {a} | {d['median']:.2f} [{d['min']:.2f}–{d['max']:.2f}] | {pf['median']:.2f} "
                     f"[{pf['min']:.2f}–{pf['max']:.2f}] | {_ratio(r, 'decode_tok_s', a)} | {_ratio(r, 'prefill_tok_s', a)} |")
    write_receipt(args.out, f"decode_{stamp}", receipt, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
