"""A/B the compiled (numba) kernels against the NumPy ones; write a receipt to evidence/.

Arms, interleaved in a fresh order inside every run (G weights/s, 2 threads):

* ``numpy``        - :mod:`colibri_aio.kernels.quant` (the reference kernels);
* ``numba``        - :mod:`colibri_aio.kernels.jit`, rows split over Python threads (nogil);
  matmul on the fused path (the matvec kernel once per position);
* ``numba-blas``   - the same, matmul on the BLAS path (a chunk of rows decoded to float32,
  then one sgemm with every position); matvec is the same kernel as ``numba``'s;
* ``numba-prange`` - the same kernels, rows split by numba's own thread pool;
* ``numba-int8x``  - Q8_0 matvec with x quantised to int8 per block of 32 (llama.cpp's
  approach; changes numerics, the error is reported);
* ``f32 BLAS``     - ``np.dot(W, x)`` / ``X @ W.T`` on a float32 matrix of the same shape;
* ``int8 sum``     - a compiled sum of the same quantised bytes as int8, on the same
  threads: the streaming roofline of a kernel that must read every byte once.

Each sample sweeps enough distinct copies of the weights to exceed the
last-level cache (``--cold-mb``). Each run is a fresh child process. The
receipt also times compiling the kernels with an empty numba cache (cold) and
loading them from it (warm), each in a fresh process.

    python tools/bench_kernels_jit.py --runs 5
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_kernels import _copies, _tensor as _valid_tensor
from colibri_aio.bench.receipt import git_state, host_facts, spread, write

ROOT = Path(__file__).resolve().parents[1]
EXPERT_SHAPES = "768x2048,2048x768"
ATTN_SHAPES = "4096x2048,512x2048,2048x4096"
HEAD_SHAPE = "151936x2048"
TARGETS = {"Q8_0": 7.0, "Q4_K": 5.0}  # G weights/s, matvec, 2 threads


# --- child: one run ---

def _tensor(type_name: str, shape: tuple[int, int], rng: np.random.Generator):
    """Valid weights (bench_kernels' generator); the output head tiles 4096 rows (rows are whole
    byte runs) instead of quantising 0.3 G weights."""
    from gguf import GGMLQuantizationType
    from colibri_aio.kernels.qtensor import QTensor

    if shape[0] <= 4096:
        return _valid_tensor(type_name, shape, rng)
    t = GGMLQuantizationType[type_name]
    part = _valid_tensor(type_name, (4096, shape[1]), rng)
    raw = np.tile(part.data, -(-shape[0] // 4096))[:QTensor.nbytes_for(t, shape)]
    return QTensor(np.ascontiguousarray(raw), t, shape)


def _int8_sum_kernel():
    """A compiled int8 sum over byte ranges, split over the same threads as the kernels."""
    from numba import njit

    from colibri_aio.kernels import jit

    @njit(nogil=True, cache=False)
    def total(a, lo, hi):
        b = a[lo:hi]
        s = np.int32(0)
        for i in range(b.size):
            s += np.int32(b[i])
        return s

    def run(raw: np.ndarray) -> None:
        a = raw.view(np.int8)
        step = 1 << 18
        jit._run_chunks(a.size // step + 1, 1, lambda c0, c1: total(a, c0 * step, min(a.size, c1 * step)))

    return run


def _ops(args, shape, type_name, x, xs, rng) -> dict:
    """The timed calls of ``args.arm`` on one weight tensor of this type and shape."""
    from colibri_aio.kernels import jit, quant
    from colibri_aio.kernels.qtensor import QTensor

    arm, big = args.arm, shape[0] * shape[1] > 64 * 2**20  # the output head is only ever a matvec
    if arm == "numba-int8x" and type_name != "Q8_0":
        return {}
    w = _tensor(type_name, shape, rng)
    n = max(1, int(args.cold_mb * 2**20 // w.nbytes))
    ws = [QTensor(r, w.ggml_type, shape) for r in _copies(w.data, n)]
    if arm == "roofline":
        summer = _int8_sum_kernel()
        return {(type_name, "int8 sum"): (lambda v: summer(v.data), ws)} if type_name in args.roofline_types else {}
    if arm == "numpy":
        mv, mm = (lambda v: quant.matvec(v, x)), (lambda v: quant.matmul(v, xs))
    elif arm == "numba-int8x":
        mv, mm = (lambda v: jit.matvec_q8(v, x)), None
    else:
        jit.set_parallel("prange" if arm == "numba-prange" else "pool")
        jit.set_matmul("blas" if arm == "numba-blas" else "fused")
        mv, mm = (lambda v: jit.matvec(v, x)), (lambda v: jit.matmul(v, xs))
    ops = {(type_name, "matvec"): (mv, ws)}
    if mm is not None and not big:
        ops[(type_name, "matmul")] = (mm, ws)
    return ops


def _blas_ops(args, shape, x, xs, rng) -> dict:
    rows, cols = shape
    n = max(1, int(args.cold_mb * 2**20 // (4 * rows * cols)))
    f32 = list(rng.standard_normal((n, rows, cols), dtype=np.float32))
    ops = {("F32", "matvec"): (lambda m: np.dot(m, x), f32)}
    if rows * cols <= 64 * 2**20:
        ops[("F32", "matmul")] = (lambda m: xs @ m.T, f32)
    return ops


def child_run(args) -> list[dict]:
    """One run of one arm: every (shape, type, op) of the plan, in a random order per shape."""
    from colibri_aio.kernels import jit, quant

    quant.set_num_threads(args.threads)
    jit.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    samples = []
    for shape, types in args.plan:
        rows, cols = shape
        x = rng.standard_normal(cols).astype(np.float32)
        xs = rng.standard_normal((args.positions, cols)).astype(np.float32)
        ops = {}
        if args.arm == "f32 BLAS":
            ops = _blas_ops(args, shape, x, xs, rng)
        else:
            for t in types:
                ops.update(_ops(args, shape, t, x, xs, rng))
        for fn, items in ops.values():  # warm-up: compile/load, first touches, thread pools
            fn(items[0])
            for _ in range(args.warm_sweeps):  # and, if asked, whole untimed sweeps: steady state
                for item in items:
                    fn(item)
        order = list(ops)
        rng.shuffle(order)
        for key in order:
            fn, items = ops[key]
            c0, t0 = time.process_time(), time.perf_counter()
            for item in items:
                fn(item)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
            samples.append({"shape": list(shape), "type": key[0], "op": key[1], "arm": args.arm,
                            "calls": len(items), "seconds": seconds, "cpu_seconds": cpu,
                            "gweights_per_s": rows * cols * len(items) / seconds / 1e9,
                            "gweights_per_cpu_s": rows * cols * len(items) / max(cpu, 1e-9) / 1e9})
        del ops
    return samples


# --- child: compile / cache-load time, and accuracy ---

def child_compile() -> dict:
    """Seconds to import the jit module and to warm up every kernel (compile, or load from cache)."""
    t0 = time.perf_counter()
    from colibri_aio.kernels import jit
    imported = time.perf_counter() - t0
    warm = jit.warm_up()
    import numba
    return {"import_s": imported, "warm_up_s": warm, "threading_layer_after_prange": _prange_layer(jit, numba)}


def _prange_layer(jit, numba) -> str:
    """Run one prange kernel and name the numba threading layer it used."""
    from colibri_aio.kernels.qtensor import QTensor
    from gguf import GGMLQuantizationType as T

    jit.set_parallel("prange")
    jit.matvec(QTensor(np.zeros(34 * 8, np.uint8), T.Q8_0, (1, 256)), np.zeros(256, np.float32))
    return numba.threading_layer()


def child_accuracy() -> dict:
    """Relative error against gguf's dequantisation times x in float64, per kernel, Q8_0 768x2048."""
    from gguf import quants
    from colibri_aio.kernels import jit, quant

    rng = np.random.default_rng(5)
    out = {}
    for t in ("Q8_0", "Q4_K", "Q6_K"):
        w = _tensor(t, (768, 2048), rng)
        ref = quants.dequantize(w.data, w.ggml_type).reshape(w.shape).astype(np.float64)
        for xname, x in (("normal", rng.standard_normal(2048)), ("positive", np.abs(rng.standard_normal(2048)))):
            x = x.astype(np.float32)
            want = ref @ x
            err = lambda y: float(np.linalg.norm(y - want) / np.linalg.norm(want))
            out[f"{t} {xname} numpy"] = err(quant.matvec(w, x))
            out[f"{t} {xname} numba"] = err(jit.matvec(w, x))
            if t == "Q8_0":
                out[f"{t} {xname} numba-int8x"] = err(jit.matvec_q8(w, x))
    return out


# --- child: teacher-forced decode of a model, one backend ---

def child_decode(args) -> dict:
    """Seconds per token of a fixed id sequence fed one by one (after one untimed pass that warms
    the page cache and the kernels), with the forward pass's kernels taken from the dispatcher."""
    import asyncio

    from colibri_aio.arch import build_net, layers
    from colibri_aio.gguf.model import load
    from colibri_aio.kernels import backend
    from colibri_aio.engine.mapped_source import MappedExpertSource

    backend.set_backend(args.arm)
    backend.set_num_threads(args.threads)
    for name in ("matvec", "matmul", "dequantize"):  # route the forward pass through the dispatcher
        setattr(layers, name, getattr(backend, name))
    warm = backend.warm_up()
    model = load(args.decode_model)
    net = build_net(model, MappedExpertSource(model))
    ids = [int(i) for i in np.random.default_rng(args.seed).integers(0, model.args.vocab_size, args.decode_tokens)]

    async def feed() -> list[float]:
        net.reset()
        times = []
        for t in ids:
            t0 = time.perf_counter()
            await net.forward([t])
            times.append(time.perf_counter() - t0)
        return times

    asyncio.run(feed())  # untimed: page cache, first touches, kernel loading
    times = asyncio.run(feed())
    return {"arm": args.arm, "backend": backend.backend_name(), "reason": backend.backend_reason(),
            "warm_up_s": warm, "token_seconds": times, "median_token_s": statistics.median(times)}


def decode_main(args, meta: dict) -> int:
    """Alternate fresh processes per backend; write kernels_jit_decode_<stamp>.{json,md}."""
    child_args = ["--decode-model", args.decode_model, "--decode-tokens", str(args.decode_tokens),
                  "--threads", str(args.threads)]
    results, order = [], np.random.default_rng(args.seed)
    for run in range(args.runs):
        for arm in order.permutation(["numpy", "auto"]):
            r = _child(args, "decode", extra=[*child_args, "--arm", str(arm), "--seed", str(args.seed)])
            results.append({**r, "run": run})
            print(f"run {run + 1}/{args.runs} {arm}: {r['median_token_s']:.3f} s/token", file=sys.stderr)
    meta["loadavg_end"] = list(os.getloadavg())
    stamp = meta["when_utc"].replace("-", "").replace(":", "")[:15] + "Z"
    out = Path(args.out)
    (out / f"kernels_jit_decode_{stamp}.json").write_text(json.dumps({**meta, "results": results}, indent=1) + "\n")
    lines = [f"# kernels_jit decode {stamp}", "", f"- command: `{meta['command']}`",
             f"- commit: `{meta['commit']['sha']}`; uncommitted kernel files: {meta['commit']['kernel_files_modified'] or 'none'}",
             f"- host: {meta['host']['hostname']}, {meta['host']['cpu']}, {meta['host']['cpus']} CPUs; load average "
             f"at start {meta['loadavg_start']}, at end {meta['loadavg_end']}",
             f"- model `{args.decode_model}`, {args.decode_tokens} fixed random ids fed one at a time (teacher-forced "
             f"decode) after one untimed pass; experts through the mmap source; {args.threads} kernel threads; "
             f"{args.runs} runs, each backend a fresh process, order alternating at random", "",
             "| backend | median s/token (median of runs) [min-max of run medians] | tok/s | warm_up s |", "|---|---|---|---|"]
    for arm in ("numpy", "auto"):
        med = [r["median_token_s"] for r in results if r["arm"] == arm]
        warm = [r["warm_up_s"] for r in results if r["arm"] == arm]
        lines.append(f"| {arm} | {statistics.median(med):.3f} [{min(med):.3f}-{max(med):.3f}] | "
                     f"{1 / statistics.median(med):.2f} | {statistics.median(warm):.2f} |")
    lines += ["", f"- auto: {next(r['reason'] for r in results if r['arm'] == 'auto')}"]
    (out / f"kernels_jit_decode_{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


# --- parent ---

def _commit() -> dict:
    state = git_state("kernels", "tools/bench_kernels_jit.py")
    return {"sha": state["sha"], "kernel_files_modified": state["modified"]}


def _child(args, mode: str, env: dict | None = None, extra: list[str] | None = None):
    out = subprocess.run([sys.executable, __file__, "--child", mode, *(extra or [])], env=env,
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"child {mode} failed:\n{out.stderr}")
    return json.loads(out.stdout)


def _fmt(s: dict | None) -> str:
    return "-" if s is None else f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"


def _summary(samples, metric: str = "gweights_per_s", **k) -> dict | None:
    v = [s[metric] for s in samples if metric in s and all(s[a] == b for a, b in k.items())]
    return spread(v) if v else None


ARMS = ["numpy", "numba", "numba-blas", "numba-prange", "numba-int8x"]
ALL_ARMS = [*ARMS, "roofline", "f32 BLAS"]


def write_receipt(out_dir: Path, meta: dict, samples: list[dict]) -> tuple[Path, Path]:
    stamp = meta["when_utc"].replace("-", "").replace(":", "")[:15] + "Z"
    c = meta["compile"]
    lines = [f"# kernels_jit {stamp}", "",
             f"- command: `{meta['command']}`",
             f"- commit: `{meta['commit']['sha']}`; uncommitted kernel files: {meta['commit']['kernel_files_modified'] or 'none'}",
             f"- host: {meta['host']['hostname']}, {meta['host']['cpu']}, {meta['host']['cpus']} CPUs, "
             f"Python {meta['host']['python']}; load average at start {meta['loadavg_start']}, at end {meta['loadavg_end']}",
             f"- NumPy {meta['numpy']}, numba {meta['numba']}; kernel threads {meta['threads']}; "
             f"OPENBLAS_NUM_THREADS={meta.get('openblas_num_threads')}; "
             f"matmul with {meta['positions']} positions; {meta.get('warm_sweeps', 0)} untimed sweeps before "
             "the timed ones (besides one call per op); each sample sweeps distinct copies of the weights, "
             f">= {meta['cold_mb']:g} MiB (one copy for the output head)",
             f"- {meta['runs']} runs; in each run every arm is a fresh process (so no arm inherits another's "
             "spinning BLAS or OpenMP threads), arms in a new random order per run, and inside an arm the "
             "(type, op) pairs of a shape in a random order; G weights/s (rows x cols x calls / seconds), "
             "median [min-max]", "",
             "## Throughput", "",
             "| shape | type | op | numpy | numba (threads) | numba (BLAS matmul) | numba (prange) | numba int8-x "
             "| int8 sum roofline | f32 BLAS |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for shape, types in meta["plan"]:
        for t in types:
            for op in ("matvec", "matmul"):
                cells = [_fmt(_summary(samples, shape=shape, type=t, op=op, arm=a)) for a in ARMS]
                if all(c == "-" for c in cells):
                    continue
                roof = _fmt(_summary(samples, shape=shape, type=t, op="int8 sum", arm="roofline")) if op == "matvec" else "-"
                blas = _fmt(_summary(samples, shape=shape, type="F32", op=op, arm="f32 BLAS"))
                lines.append(f"| {shape[0]}x{shape[1]} | {t} | {op} | " + " | ".join(cells) + f" | {roof} | {blas} |")
    lines += ["", "## Per CPU-second (weights / CPU time of the process, all its threads)", "",
              "Wall-clock rates above fall when other jobs share the 2 cores; this one much less so.", "",
              "| shape | type | op | numpy | numba (threads) | int8 sum roofline |", "|---|---|---|---|---|---|"]
    for shape, types in meta["plan"]:
        for t in types:
            for op in ("matvec", "matmul"):
                a = _summary(samples, "gweights_per_cpu_s", shape=shape, type=t, op=op, arm="numpy")
                b = _summary(samples, "gweights_per_cpu_s", shape=shape, type=t, op=op, arm="numba")
                if a or b:
                    roof = _summary(samples, "gweights_per_cpu_s", shape=shape, type=t, op="int8 sum", arm="roofline")
                    lines.append(f"| {shape[0]}x{shape[1]} | {t} | {op} | {_fmt(a)} | {_fmt(b)} | "
                                 f"{_fmt(roof) if op == 'matvec' else '-'} |")
    lines += ["", "## Targets (matvec, 2 threads, numba with Python threads)", ""]
    for t, target in TARGETS.items():
        meds = [(f"{s[0]}x{s[1]}", m["median"]) for s, types in meta["plan"] if t in types
                if (m := _summary(samples, shape=s, type=t, op="matvec", arm="numba"))]
        if meds:
            verdict = "met" if min(m for _, m in meds) >= target else "missed"
            lines.append(f"- {t} >= {target} G weights/s: {verdict} ({', '.join(f'{n} {m:.2f}' for n, m in meds)})")
    lines += ["", "## numba faster than numpy (ratio of medians, per shape)", ""]
    for shape, types in meta["plan"]:
        for t in types:
            for op in ("matvec", "matmul"):
                a = _summary(samples, shape=shape, type=t, op=op, arm="numpy")
                b = _summary(samples, shape=shape, type=t, op=op, arm="numba")
                if a and b:
                    lines.append(f"- {shape[0]}x{shape[1]} {t} {op}: x{b['median'] / a['median']:.2f}")
    lines += ["", "## BLAS matmul path vs fused (ratio of medians, per shape)", ""]
    for shape, types in meta["plan"]:
        for t in types:
            a = _summary(samples, shape=shape, type=t, op="matmul", arm="numba")
            b = _summary(samples, shape=shape, type=t, op="matmul", arm="numba-blas")
            if a and b:
                lines.append(f"- {shape[0]}x{shape[1]} {t} matmul, {meta['positions']} positions: "
                             f"x{b['median'] / a['median']:.2f}")
    lines += ["", "## Compile time (fresh process each; import of the jit module + warm_up())", ""]
    lines += ["- not measured in this run (--compile-runs 0)"] if not c["cold"] else [
              f"- cold (empty NUMBA_CACHE_DIR): import {_fmt(spread([r['import_s'] for r in c['cold']]))} s, "
              f"warm_up {_fmt(spread([r['warm_up_s'] for r in c['cold']]))} s (n={len(c['cold'])})",
              f"- warm (cache filled): import {_fmt(spread([r['import_s'] for r in c['warm']]))} s, "
              f"warm_up {_fmt(spread([r['warm_up_s'] for r in c['warm']]))} s (n={len(c['warm'])})"]
    lines += ["", "## Accuracy: relative error vs gguf dequantize(raw) @ x in float64, 768x2048", ""]
    lines += [f"- {k}: {v:.2e}" for k, v in meta["accuracy"].items()]
    return write(out_dir, f"kernels_jit_{stamp}", {**meta, "samples": samples}, "\n".join(lines) + "\n")


def _plan(args) -> list[tuple[list[int], list[str]]]:
    plan = []
    for group, types in ((args.expert_shapes, args.expert_types), (args.attn_shapes, args.attn_types),
                         (args.head_shapes, args.head_types)):
        for s in filter(None, group.split(",")):
            r, c = s.lower().split("x")
            plan.append(([int(r), int(c)], [t for t in types.split(",") if t]))
    return plan


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--expert-shapes", default=EXPERT_SHAPES)
    p.add_argument("--expert-types", default="Q8_0,Q4_K,Q6_K,Q5_K,Q4_0,BF16,F16")
    p.add_argument("--attn-shapes", default=ATTN_SHAPES)
    p.add_argument("--attn-types", default="Q8_0,Q4_K,Q6_K")
    p.add_argument("--head-shapes", default=HEAD_SHAPE)
    p.add_argument("--head-types", default="Q8_0,Q4_K,Q6_K")
    p.add_argument("--roofline-types", default="Q8_0,Q4_K")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--positions", type=int, default=8)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--compile-runs", type=int, default=5)
    p.add_argument("--cold-mb", type=float, default=64.0)
    p.add_argument("--warm-sweeps", type=int, default=0,
                   help="untimed sweeps per op before the timed one (0: only one warm-up call)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "evidence"))
    p.add_argument("--decode-model", help="instead of the kernel sweep: teacher-forced decode of this GGUF, numpy vs auto")
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--child", choices=["run", "compile", "accuracy", "decode"], help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    p.add_argument("--arm", help=argparse.SUPPRESS)
    p.add_argument("--arms", default=",".join(ALL_ARMS), help="arms to run, each in its own process")
    args = p.parse_args(argv)
    args.roofline_types = args.roofline_types.split(",")
    args.arms = [a for a in args.arms.split(",") if a]
    if args.child:
        if args.child == "run":
            args.plan = [(tuple(s), t) for s, t in json.loads(args.plan)]
            result = child_run(args)
        elif args.child == "decode":
            result = child_decode(args)
        else:
            result = child_compile() if args.child == "compile" else child_accuracy()
        json.dump(result, sys.stdout)
        return 0
    if args.runs < 5:
        p.error("--runs must be >= 5")
    import numba
    # The children run the kernels as the engine does: importing colibri_aio sets single-threaded
    # OpenBLAS before NumPy loads it, but the children import NumPy first, so say it here.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    plan = _plan(args) if not args.decode_model else []
    meta = {"command": " ".join([sys.executable, *sys.argv]), "arms": args.arms, "commit": _commit(), "host": host_facts(),
            "when_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "numpy": np.__version__, "numba": numba.__version__, "threads": args.threads,
            "openblas_num_threads": os.environ["OPENBLAS_NUM_THREADS"],
            "positions": args.positions, "cold_mb": args.cold_mb, "runs": args.runs, "plan": plan,
            "warm_sweeps": args.warm_sweeps,
            "loadavg_start": list(os.getloadavg())}
    if args.decode_model:
        return decode_main(args, meta)
    compile_times = {"cold": [], "warm": []}
    for i in range(args.compile_runs):
        with tempfile.TemporaryDirectory(prefix="numba-cache-") as cache:
            env = {**os.environ, "NUMBA_CACHE_DIR": cache}
            compile_times["cold"].append(_child(args, "compile", env))
            compile_times["warm"].append(_child(args, "compile", env))
        print(f"compile {i + 1}/{args.compile_runs}: {compile_times['cold'][-1]} {compile_times['warm'][-1]}",
              file=sys.stderr)
    meta["compile"] = compile_times
    meta["accuracy"] = _child(args, "accuracy")
    child_args = ["--threads", str(args.threads), "--positions", str(args.positions),
                  "--warm-sweeps", str(args.warm_sweeps),
                  "--cold-mb", str(args.cold_mb), "--roofline-types", ",".join(args.roofline_types),
                  "--plan", json.dumps(plan)]
    samples, order = [], np.random.default_rng(args.seed)
    for run in range(args.runs):
        for arm in order.permutation(args.arms):
            for s in _child(args, "run", extra=[*child_args, "--arm", str(arm), "--seed", str(args.seed + run)]):
                samples.append({**s, "run": run})
            print(f"run {run + 1}/{args.runs} arm {arm} done", file=sys.stderr)
    meta["loadavg_end"] = list(os.getloadavg())
    json_path, md_path = write_receipt(Path(args.out), meta, samples)
    print(md_path.read_text())
    print(f"receipt: {json_path} {md_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
