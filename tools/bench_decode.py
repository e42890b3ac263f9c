"""Teacher-forced decode and prefill speed: our engine (per kernel backend) beside llama.cpp, same file, same ids.

The model must fit in RAM (this measures kernels and overheads, not the disk):
our engine holds every expert in its cache, llama.cpp maps the file. The same
fixed ids are fed one at a time (DESIGN's "replay" protocol, so neither engine
can fall into a cached loop); prefill is the same ids as one batch. With
``--context N`` the decoded tokens follow N positions of context (the first N
ids, fed as one untimed batch), so decode is measured at that depth of the KV
cache, where attention's share of a step grows.

Every arm runs in its own worker process, started after the page cache is
dropped (when allowed) and kept for the whole benchmark: two copies of ggml
(ggml-python's and llama.cpp's) must not share one process, whose dynamic
linker would bind both to one set of ``ggml_*`` symbols. The parent drives the
workers in turn, so arms interleave run by run (the order flips every run);
run 0 of each arm is a warm-up (caches filled, graphs built) and not counted,
then ``--runs`` timed runs each. An arm of ours is a kernel backend
(``numpy``, ``ggml``, ``auto``), optionally with one environment setting for
its worker after an ``@`` (``ggml@COLIBRI_GGML_EXPERT_GEMM=0``): the A/B of a
switch in one run. The decode switches (``kernels/ggml_cpu.KNOBS``):
``COLIBRI_GGML_GRAPHS=off`` (one graph per product, NumPy trunk ops),
``COLIBRI_GGML_EXPERTS=each`` (one product per
expert instead of ``ggml_mul_mat_id``), ``COLIBRI_GGML_ATTENTION=f16``
(llama.cpp's flash-attention rounding over the f16 cache), ``COLIBRI_GGML_STEP=layers``
(two graphs per block and one for the head instead of one graph per step
whose experts are all resident), ``COLIBRI_TRUNK_HUGE_PAGES=off`` (the
resident trunk on 4 KiB pages). ``--cache-per-layer N`` gives our engine N
expert slots per layer instead of every expert: a cache smaller than the
working set, so that steps miss (llama.cpp still maps the whole file).

    python tools/bench_decode.py MODEL.gguf --runs 5 --tokens 32 --prefill 128 --arms ggml,llama.cpp
    python tools/bench_decode.py MODEL.gguf --context 2048 --arms ggml,ggml@COLIBRI_GGML_ATTENTION=f16,llama.cpp
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from colibri_aio.bench.lock import exclusive
from colibri_aio.bench.receipt import header as receipt_header, host_line, spread, write as write_receipt
from colibri_aio.bench.arms import arm_env
from colibri_aio.bench.pagecache import drop_page_cache

ROOT = Path(__file__).resolve().parents[1]
EVERY_EXPERT = 10**6   # cache slots per layer: every expert of any model


# --- workers: one engine each, answering {"op": "decode"|"prefill", "ids": [...]} with seconds ---

class Ours:
    """Our engine with one kernel backend; every expert cached (a model in RAM)."""

    def __init__(self, path: Path, kernels: str, n_ctx: int, cache_per_layer: int = EVERY_EXPERT) -> None:
        from colibri_aio.engine.engine import Engine

        self.loop = asyncio.new_event_loop()
        self.engine = self.loop.run_until_complete(Engine.open(
            path, prefetch="off", n_ctx=n_ctx, cache_per_layer=cache_per_layer, kernels=kernels))
        self.describe = f"{self.engine.kernels.name}: {self.engine.kernels.reason}"

    def decode(self, ids: list[int], context: int = 0) -> float:
        net = self.engine.net

        async def run() -> float:
            net.reset()
            await net.forward(ids[: context + 1])
            t0 = time.perf_counter()
            for t in ids[context + 1:]:
                await net.forward([t])
            return time.perf_counter() - t0

        return self.loop.run_until_complete(run())

    def prefill(self, ids: list[int]) -> float:
        net = self.engine.net

        async def run() -> float:
            net.reset()
            t0 = time.perf_counter()
            await net.forward(ids)
            return time.perf_counter() - t0

        return self.loop.run_until_complete(run())

    def close(self) -> None:
        """Close the engine on its loop (its tasks end instead of being destroyed pending at exit)."""
        self.loop.run_until_complete(self.engine.aclose())
        self.loop.close()


class LlamaCpp:
    def __init__(self, path: Path, n_ctx: int) -> None:
        import llama_cpp
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=2, n_threads_batch=2, n_batch=512,
                         logits_all=False, verbose=False)
        self.describe = f"llama-cpp-python {llama_cpp.__version__}, n_threads=2, mmap"

    def decode(self, ids: list[int], context: int = 0) -> float:
        self.llm.reset()
        self.llm.eval(ids[: context + 1])
        t0 = time.perf_counter()
        for t in ids[context + 1:]:
            self.llm.eval([t])
        return time.perf_counter() - t0

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - t0


def worker(arm: str, path: Path, n_ctx: int, cache_per_layer: int) -> int:
    engine = LlamaCpp(path, n_ctx) if arm == "llama.cpp" else Ours(path, arm, n_ctx, cache_per_layer)
    print(json.dumps({"ready": engine.describe}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        print(json.dumps({"seconds": getattr(engine, cmd.pop("op"))(**cmd)}), flush=True)
    if isinstance(engine, Ours):
        engine.close()
    return 0


class Worker:
    def __init__(self, arm: str, path: Path, n_ctx: int, cache_per_layer: int) -> None:
        self.arm = arm
        backend, env = arm_env(arm)
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", backend, str(path), "--n-ctx", str(n_ctx),
                                      "--cache-per-layer", str(cache_per_layer)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.describe = self._reply()["ready"]

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"worker {self.arm} died (exit {self.proc.wait()})")
        return json.loads(line)

    def time(self, op: str, ids: list[int], **options: int) -> float:
        self.proc.stdin.write(json.dumps({"op": op, "ids": ids, **options}) + "\n")
        self.proc.stdin.flush()
        return self._reply()["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def _ratio(r: dict, key: str, arm: str) -> str:
    """The arm's ratio to llama.cpp; 1 for llama.cpp itself, '-' when it did not run."""
    return "1.000" if arm == "llama.cpp" else (f"{r[key]:.3f}" if key in r else "-")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--tokens", type=int, default=32, help="decode tokens per run (teacher-forced)")
    p.add_argument("--prefill", type=int, default=128, help="prefill positions per run")
    p.add_argument("--context", type=int, default=0, help="positions of context before the decoded tokens")
    p.add_argument("--arms", default="auto,llama.cpp")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "evidence")
    p.add_argument("--lock", type=Path, default=None, help="hold this lock file exclusively during each run")
    p.add_argument("--cache-per-layer", type=int, default=EVERY_EXPERT,
                   help="our expert slots per layer (default: every expert)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--n-ctx", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.cache_per_layer < 1:
        p.error("--cache-per-layer must be at least 1")
    if args.worker:
        return worker(args.worker, args.model, args.n_ctx, args.cache_per_layer)
    if min(args.runs, args.tokens, args.prefill) < 1 or args.context < 0:
        p.error("--runs, --tokens and --prefill must be positive, --context not negative")
    arms = args.arms.split(",")
    rng = np.random.default_rng(args.seed)
    decoded = args.context + args.tokens + 1
    ids = rng.integers(3, 2048, max(decoded, args.prefill)).tolist()
    with exclusive(args.lock):
        dropped = drop_page_cache()
        workers = {a: Worker(a, args.model, len(ids) + 8, args.cache_per_layer) for a in arms}
    samples: dict[str, dict[str, list[float]]] = {a: {"decode_tok_s": [], "prefill_tok_s": []} for a in arms}
    try:
        for run in range(args.runs + 1):
            for a in (arms if run % 2 == 0 else arms[::-1]):
                with exclusive(args.lock):
                    d = workers[a].time("decode", ids[:decoded], context=args.context)
                    pf = workers[a].time("prefill", ids[: args.prefill])
                if run == 0:
                    continue  # warm-up
                samples[a]["decode_tok_s"].append(args.tokens / d)
                samples[a]["prefill_tok_s"].append(args.prefill / pf)
                print(json.dumps({"arm": a, "run": run, "decode_tok_s": args.tokens / d,
                                  "prefill_tok_s": args.prefill / pf}), flush=True)
    finally:
        for w in workers.values():
            w.close()
    summary = {a: {k: spread(v) | {"samples": v} for k, v in s.items()} for a, s in samples.items()}
    ratios = {}
    if "llama.cpp" in summary:
        ref = summary["llama.cpp"]
        for a in arms:
            if a != "llama.cpp":
                ratios[a] = {k: summary[a][k]["median"] / ref[k]["median"] for k in ("decode_tok_s", "prefill_tok_s")}
    receipt = {
        **receipt_header("tools/bench_decode.py"), "model": args.model.name,
        "model_bytes": args.model.stat().st_size, "tokens": args.tokens, "prefill": args.prefill,
        "context": args.context, "page_cache_dropped": dropped, "cache_per_layer": args.cache_per_layer,
        "arms": {a: w.describe for a, w in workers.items()},
        "summary": summary, "ratios_vs_llama_cpp": ratios,
    }
    stamp = receipt["date"]
    where = "in RAM" if args.cache_per_layer == EVERY_EXPERT else f"{args.cache_per_layer} expert slots per layer"
    lines = [f"# Decode and prefill, {where} — {stamp}", "",
             f"{host_line(receipt)}, commit `{receipt['commit']}`, model `{args.model.name}` "
             f"({receipt['model_bytes'] / 1e9:.2f} GB), load average at end {receipt['load_average']}", "",
             f"Command: `{receipt['command']}`", "",
             f"Teacher-forced decode of {args.tokens} fixed ids one at a time"
             + (f" after {args.context} positions of context (one untimed batch)" if args.context else "")
             + f"; prefill of {args.prefill} ids as one "
             f"batch. One worker process per arm (page cache dropped before they started: {dropped}); "
             f"{args.runs} timed runs per arm after one warm-up, arms interleaved (order flipped every run).", ""]
    lines += [f"- {a}: {w.describe}" for a, w in workers.items()]
    lines += ["", "| arm | decode tok/s median [min–max] | prefill tok/s median [min–max] | decode ÷ llama.cpp | "
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
