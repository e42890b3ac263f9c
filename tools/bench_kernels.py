"""Benchmark the quantised kernels on Qwen3-30B-A3B expert shapes; write a receipt to evidence/.

For each shape (rows x cols) and GGML type it measures, in G weights/s:

* ``matvec``  - :func:`colibri_aio.kernels.quant.matvec`, one position (decode);
* ``matmul``  - :func:`colibri_aio.kernels.quant.matmul` with ``--positions`` positions (prefill);
* ``decode``  - the decoding half of a matmul alone: every chunk decoded and
  scaled into the kernel's float32 scratch, no product (``dequantize`` would
  add a fresh output array's first-touch page faults);

beside float32 BLAS on a float32 matrix of the same shape, measured in the same
run and interleaved with them: ``f32 gemv`` (``np.dot(W, x)``, the product
alone) and ``f32 gemm`` (``X @ W.T``).

Each sample is one sweep over enough distinct copies of the weights to exceed
the last-level cache (``--cold-mb``), as experts streamed from the buffer pool
are: nothing is measured out of a warm cache by accident. Each run is a fresh
child process; ``--arms`` runs the same measurements under different
environments (e.g. ``OPENBLAS_NUM_THREADS=1``, or ``COLIBRI_QUANT_<NAME>=<int>``
to set a tuning constant of the quant module), alternating arm by arm.

    python tools/bench_kernels.py --runs 7 --arms default,OPENBLAS_NUM_THREADS=1
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from colibri_aio.bench.receipt import git_state, host_facts, spread, write

ROOT = Path(__file__).resolve().parents[1]
ALL_TYPES = ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4", "Q2_K", "Q3_K",
             "IQ4_XS", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "TQ1_0", "TQ2_0", "NVFP4",
             "BF16", "F16", "F32"]
TUNING_PREFIX = "COLIBRI_QUANT_"  # an arm may set a module constant of quant, e.g. COLIBRI_QUANT_MATVEC_CHUNK_WEIGHTS
TARGETS = {("Q8_0", "matvec"): 3.0, ("Q4_K", "matvec"): 1.5}  # G weights/s, 2 threads


# --- child: one run of every measurement ---

def _tensor(type_name: str, shape: tuple[int, int], rng: np.random.Generator):
    """A valid weight tensor: quantised random data, or (types gguf cannot quantise) random blocks
    with finite scales."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
    from colibri_aio.kernels.qtensor import QTensor

    t = GGMLQuantizationType[type_name]
    # The f16 scales of each block; NVFP4's UE4M3 scales are finite for every byte; IQ1_M's f16 is the top
    # nibbles of the four uint16 at bytes 48-55.
    k_scale_bytes = {"Q4_K": slice(0, 4), "Q5_K": slice(0, 4), "Q6_K": slice(208, 210), "Q2_K": slice(80, 84),
                     "Q3_K": slice(108, 110), "IQ4_NL": slice(0, 2), "IQ4_XS": slice(0, 2), "IQ1_S": slice(0, 2),
                     "IQ2_XXS": slice(0, 2), "IQ2_XS": slice(0, 2), "IQ2_S": slice(0, 2), "IQ3_XXS": slice(0, 2),
                     "IQ3_S": slice(0, 2), "IQ1_M": slice(0, 0), "NVFP4": slice(0, 0)}
    if type_name in k_scale_bytes:
        block, type_size = GGML_QUANT_SIZES[t]
        blocks = rng.integers(0, 256, (shape[0] * shape[1] // block, type_size), dtype=np.uint8)
        sl = k_scale_bytes[type_name]
        n_f16 = (sl.stop - sl.start) // 2
        blocks[:, sl] = (rng.uniform(-1, 1, (blocks.shape[0], n_f16)) * 2e-3).astype(np.float16).view(np.uint8)
        if type_name == "IQ1_M":
            words = blocks[:, 48:56].view(np.uint16)
            d = (rng.uniform(-1, 1, (blocks.shape[0], 1)) * 2e-3).astype(np.float16).view(np.uint16)
            words &= np.uint16(0x0FFF)
            words |= ((d >> np.array([0, 4, 8, 12], np.uint16)) & np.uint16(0xF)) << np.uint16(12)
        raw = blocks.reshape(-1)
    else:
        raw = quants.quantize(rng.standard_normal(shape).astype(np.float32), t).view(np.uint8).reshape(-1)
    return QTensor(np.ascontiguousarray(raw), t, shape)


def _copies(raw: np.ndarray, n: int) -> np.ndarray:
    """``n`` copies of ``raw`` at distinct addresses, touched."""
    out = np.empty((n, raw.size), raw.dtype)
    out[:] = raw
    return out


def _sweep_seconds(fn, items) -> tuple[float, float]:
    """Wall and CPU seconds (all threads of the process) for one call per item."""
    t0, c0 = time.perf_counter(), time.process_time()
    for item in items:
        fn(item)
    return time.perf_counter() - t0, time.process_time() - c0


def _decode_only(w) -> None:
    """Decode and scale every chunk of ``w`` into scratch, as matmul does, without the product."""
    from colibri_aio.kernels import quant

    fmt = quant._format_of(w)
    quant._for_chunks(w, fmt, quant.MATMUL_CHUNK_WEIGHTS,
                      lambda s0, s1, raw, s: quant._chunk_weights(fmt, raw, s, w.cols, fmt.has_bias))


def child_run(args: argparse.Namespace) -> list[dict]:
    """One sample of every (shape, type, op), interleaved; returns the samples."""
    from colibri_aio.kernels import quant
    from colibri_aio.kernels.qtensor import QTensor

    quant.set_num_threads(args.threads)
    for key, value in os.environ.items():  # arm knobs: COLIBRI_QUANT_<CONSTANT>=<int>
        if key.startswith(TUNING_PREFIX):
            name = key[len(TUNING_PREFIX):]
            if not hasattr(quant, name):
                raise SystemExit(f"{key}: colibri_aio.kernels.quant has no {name}")
            setattr(quant, name, int(value))
    rng = np.random.default_rng(args.seed)
    samples = []
    for shape in args.shapes:
        rows, cols = shape
        n_weights = rows * cols
        x = rng.standard_normal(cols).astype(np.float32)
        xs = rng.standard_normal((args.positions, cols)).astype(np.float32)
        n_f32 = max(2, int(args.cold_mb * 2**20 // (4 * n_weights)))
        f32 = _copies(rng.standard_normal(n_weights).astype(np.float32), n_f32).reshape(n_f32, rows, cols)
        ops = {}
        for name in args.types:
            w = _tensor(name, shape, rng)
            n = max(2, int(args.cold_mb * 2**20 // w.nbytes))
            ws = [QTensor(r, w.ggml_type, shape) for r in _copies(w.data, n)]
            ops[(name, "matvec")] = (lambda v: quant.matvec(v, x), ws)
            ops[(name, "matmul")] = (lambda v: quant.matmul(v, xs), ws)
            if name in args.decode_types:
                ops[(name, "decode")] = (_decode_only, ws)
        ops[("F32-BLAS", "f32 gemv")] = (lambda m: np.dot(m, x), list(f32))
        ops[("F32-BLAS", "f32 gemm")] = (lambda m: xs @ m.T, list(f32))
        for fn, items in ops.values():  # warm-up: first touches, thread pool, BLAS threads
            fn(items[0])
        order = list(ops)
        rng.shuffle(order)  # a different interleaving each run
        for key in order:
            fn, items = ops[key]
            seconds, cpu_seconds = _sweep_seconds(fn, items)
            weights = n_weights * len(items)
            samples.append({"shape": list(shape), "type": key[0], "op": key[1], "calls": len(items),
                            "seconds": seconds, "cpu_seconds": cpu_seconds,
                            "gweights_per_s": weights / seconds / 1e9,
                            "gweights_per_cpu_s": weights / cpu_seconds / 1e9})
    return samples


# --- parent: arms x runs of child processes, then the receipt ---

def _arm_env(arm: str) -> dict[str, str]:
    env = dict(os.environ)
    if arm != "default":
        for item in arm.split("+"):
            key, _, value = item.partition("=")
            env[key] = value
    return env


def _commit() -> dict:
    state = git_state("kernels", "tools/bench_kernels.py")
    return {"sha": state["sha"], "kernel_files_modified": bool(state["modified"])}


def _blas_config() -> dict:
    try:
        deps = np.show_config(mode="dicts")["Build Dependencies"]
        return {k: deps[k] for k in ("blas", "lapack") if k in deps}
    except Exception as e:  # the config layout differs between NumPy versions
        return {"error": repr(e)}


def _kernel_constants() -> dict:
    from colibri_aio.kernels import quant
    return {k: getattr(quant, k) for k in dir(quant) if k.isupper() and isinstance(getattr(quant, k), int)}


def _summary(samples: list[dict], arm: str, shape: list[int], type_name: str, op: str,
             key: str = "gweights_per_s") -> dict | None:
    v = [s[key] for s in samples
         if s["arm"] == arm and s["shape"] == shape and s["type"] == type_name and s["op"] == op]
    if not v:
        return None
    return spread(v)


def _fmt(s: dict | None) -> str:
    return "-" if s is None else f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"


def write_receipt(out_dir: Path, meta: dict, samples: list[dict]) -> tuple[Path, Path]:
    stamp = meta["when_utc"].replace("-", "").replace(":", "")[:15] + "Z"
    lines = [f"# kernels {stamp}", "",
             f"- command: `{meta['command']}`",
             f"- commit: `{meta['commit']['sha']}`" + (" (kernel files modified)" if meta['commit']['kernel_files_modified'] else ""),
             f"- host: {meta['host']['hostname']}, {meta['host']['cpu']}, {meta['host']['cpus']} CPUs; "
             f"load average at start {meta['loadavg_start']}, at end {meta['loadavg_end']}",
             f"- NumPy {meta['numpy']}, BLAS {meta['blas'].get('blas', {}).get('name', '?')} "
             f"{meta['blas'].get('blas', {}).get('version', '')}; OPENBLAS_* in the environment: {meta['openblas_env'] or 'none'}",
             f"- kernel constants {meta['kernel_constants']}",
             f"- kernel threads {meta['threads']}; matmul with {meta['positions']} positions; "
             f"each sample sweeps distinct copies of the weights, >= {meta['cold_mb']:g} MiB of them "
             f"(more than the last-level cache when above its size)",
             f"- {meta['runs']} runs per arm, arms alternating: {', '.join(meta['arms'])}; G weights/s, median [min-max]", ""]
    for arm in meta["arms"]:
        lines += [f"## arm: {arm}", "",
                  "| shape | type | matvec | matmul | decode alone | f32 gemv (same run) | f32 gemm (same run) |",
                  "|---|---|---|---|---|---|---|"]
        for shape in meta["shapes"]:
            gemv = _summary(samples, arm, shape, "F32-BLAS", "f32 gemv")
            gemm = _summary(samples, arm, shape, "F32-BLAS", "f32 gemm")
            for t in meta["types"]:
                lines.append(f"| {shape[0]}x{shape[1]} | {t} | {_fmt(_summary(samples, arm, shape, t, 'matvec'))} | "
                             f"{_fmt(_summary(samples, arm, shape, t, 'matmul'))} | "
                             f"{_fmt(_summary(samples, arm, shape, t, 'decode'))} | {_fmt(gemv)} | {_fmt(gemm)} |")
        lines += ["", f"Per CPU-second (all threads of the process; less sensitive to other jobs on the machine "
                  f"than wall time; two idle cores give at most twice this):", "",
                  "| shape | type | matvec | matmul | decode alone | f32 gemv | f32 gemm |", "|---|---|---|---|---|---|---|"]
        for shape in meta["shapes"]:
            cpu = lambda t, op: _fmt(_summary(samples, arm, shape, t, op, "gweights_per_cpu_s"))
            for t in meta["types"]:
                lines.append(f"| {shape[0]}x{shape[1]} | {t} | {cpu(t, 'matvec')} | {cpu(t, 'matmul')} | "
                             f"{cpu(t, 'decode')} | {cpu('F32-BLAS', 'f32 gemv')} | {cpu('F32-BLAS', 'f32 gemm')} |")
        lines.append("")
        for (t, op), target in TARGETS.items():
            meds = [s["median"] for shape in meta["shapes"] if (s := _summary(samples, arm, shape, t, op))]
            if meds:
                verdict = "met" if min(meds) >= target else "missed"
                lines.append(f"- target {t} {op} >= {target} G weights/s: {verdict} (medians {', '.join(f'{m:.2f}' for m in meds)})")
        lines.append("")
    return write(out_dir, f"kernels_{stamp}", {**meta, "samples": samples}, "\n".join(lines) + "\n")


def _shape(text: str) -> tuple[int, int]:
    rows, cols = text.lower().split("x")
    return int(rows), int(cols)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", default=",".join(ALL_TYPES))
    p.add_argument("--decode-types", default="Q8_0,Q4_K", help="types whose decoding is also timed alone")
    p.add_argument("--shapes", default="768x2048,2048x768", help="rows x cols (expert gate/up, down)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--positions", type=int, default=8)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--cold-mb", type=float, default=64.0)
    p.add_argument("--arms", default="default", help="comma-separated: default, or VAR=value[+VAR=value]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "evidence"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.types = [t for t in args.types.split(",") if t]
    args.decode_types = [t for t in args.decode_types.split(",") if t in args.types]
    args.shapes = [_shape(s) for s in args.shapes.split(",")]
    if args.child:
        json.dump(child_run(args), sys.stdout)
        return 0
    if args.runs < 5:
        p.error("--runs must be >= 5")
    arms = args.arms.split(",")
    meta = {"command": " ".join([sys.executable, *sys.argv]), "commit": _commit(), "host": host_facts(),
            "when_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "numpy": np.__version__, "blas": _blas_config(),
            "openblas_env": {k: v for k, v in os.environ.items() if k.startswith("OPENBLAS")},
            "kernel_constants": _kernel_constants(),
            "threads": args.threads, "positions": args.positions, "cold_mb": args.cold_mb,
            "runs": args.runs, "arms": arms, "shapes": [list(s) for s in args.shapes], "types": args.types,
            "loadavg_start": list(os.getloadavg())}
    child_argv = [sys.executable, __file__, "--child", "--types", ",".join(args.types),
                  "--decode-types", ",".join(args.decode_types) or "none",
                  "--shapes", ",".join(f"{r}x{c}" for r, c in args.shapes), "--threads", str(args.threads),
                  "--positions", str(args.positions), "--cold-mb", str(args.cold_mb)]
    samples = []
    for run in range(args.runs):
        for arm in arms:
            out = subprocess.run([*child_argv, "--seed", str(args.seed + run)], env=_arm_env(arm),
                                 capture_output=True, text=True, check=True)
            for s in json.loads(out.stdout):
                samples.append({**s, "arm": arm, "run": run})
            print(f"run {run + 1}/{args.runs} arm {arm}: done", file=sys.stderr)
    meta["loadavg_end"] = list(os.getloadavg())
    json_path, md_path = write_receipt(Path(args.out), meta, samples)
    print(md_path.read_text())
    print(f"receipt: {json_path} {md_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
