"""Kernel backends side by side, against a streaming read of the same bytes; a receipt in evidence/.

Arms (one fresh child process per arm and run, arms alternating; G weights/s
and GB/s of weight bytes, ``--threads`` threads):

* ``numpy`` - the reference kernels (:mod:`colibri_aio.kernels.quant`), one product a call;
* ``ggml``  - ggml's CPU kernels through :class:`~colibri_aio.kernels.ggml_cpu.GgmlKernels`:
  ``ggml`` one product per graph call (``linear``), ``ggml x8`` eight products of the same
  shape in one graph (``linears``, as the engine batches a layer's experts or q/k/v).

Every child also times a **streaming read** of exactly the bytes each op sweeps
(NumPy ``add.reduce`` over them as uint64, split over the same number of
threads): the memory-bandwidth roofline of a kernel that must read every byte
once. Each op's sample is paired with a read sample taken right before it, and
the receipt quotes kernel ÷ read per pair.

Each sample sweeps distinct copies of the weights, more than ``--cold-mb`` in
all (far above the 32 MiB last-level cache), as experts streamed from the pool
are: nothing is measured from a warm cache by accident.

    python tools/bench_backends.py --runs 5 --lock /work/cpu.lock
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench_kernels import _copies, _tensor as _valid_tensor
from colibri_aio.bench.lock import exclusive
from colibri_aio.bench.receipt import header, host_line, spread, write

ROOT = Path(__file__).resolve().parents[1]
EXPERT, ATTN, HEAD = "768x2048,2048x768", "4096x2048,512x2048,2048x4096", "151936x2048"
TARGET = 0.85  # Q8_0 and Q4_K matvec: share of the streaming read (issue 12)
SETTLE_S = 0.01  # idle between sweeps: a ggml call leaves OpenMP threads spinning for ~3 ms


def _tensor(type_name: str, shape: tuple[int, int], rng: np.random.Generator):
    """Valid weights; the output head tiles 4096 valid rows instead of quantising 0.3 G weights."""
    from gguf import GGMLQuantizationType
    from colibri_aio.kernels.qtensor import QTensor

    if shape[0] <= 4096:
        return _valid_tensor(type_name, shape, rng)
    t = GGMLQuantizationType[type_name]
    part = _valid_tensor(type_name, (4096, shape[1]), rng)
    raw = np.tile(part.data, -(-shape[0] // 4096))[:QTensor.nbytes_for(t, shape)]
    return QTensor(np.ascontiguousarray(raw), t, shape)


# --- child ---

class Reader:
    """Streams bytes: uint64 sums over equal parts on ``threads`` threads (NumPy releases the GIL)."""

    def __init__(self, threads: int) -> None:
        self.pool = ThreadPoolExecutor(threads)
        self.threads = threads

    def __call__(self, raw: np.ndarray) -> None:
        words = raw[: raw.size // 8 * 8].view(np.uint64)
        parts = np.array_split(words, self.threads)
        for f in [self.pool.submit(np.add.reduce, p) for p in parts]:
            f.result()


def _arm_ops(arm: str, threads: int, x: np.ndarray, xs: dict[int, np.ndarray]):
    """(matvec(w), {T: matmul(w)}, batched matvec(list of w) or None) for one arm."""
    if arm == "numpy":
        from colibri_aio.kernels import quant
        quant.set_num_threads(threads)
        return (lambda w: quant.matvec(w, x)), {t: (lambda w, v=v: quant.matmul(w, v)) for t, v in xs.items()}, None
    from colibri_aio.kernels.ggml_cpu import GgmlKernels
    k = GgmlKernels(threads)
    x2 = x[None, :]
    return (lambda w: k.linear(w, x2)), {t: (lambda w, v=v: k.linear(w, v)) for t, v in xs.items()}, \
        (lambda ws: k.linears(ws, x2))


def _sweep(fn, items) -> tuple[float, float]:
    time.sleep(SETTLE_S)
    c0, t0 = time.process_time(), time.perf_counter()
    for item in items:
        fn(item)
    return time.perf_counter() - t0, time.process_time() - c0


def child_run(args) -> list[dict]:
    """One run of one arm: every (shape, type, op), each sample paired with a streaming read of its bytes."""
    from colibri_aio.kernels.qtensor import QTensor

    rng = np.random.default_rng(args.seed)
    reader = Reader(args.threads)
    samples = []
    for shape in args.shapes:
        rows, cols = shape
        x = rng.standard_normal(cols).astype(np.float32)
        xs = {t: rng.standard_normal((t, cols)).astype(np.float32) for t in args.positions}
        mv, mms, batched = _arm_ops(args.arm, args.threads, x, xs)
        head = rows * cols > 64 * 2**20  # the output head is only ever a matvec
        for type_name in args.types:
            w = _tensor(type_name, shape, rng)
            n = max(8, -(-int(args.cold_mb * 2**20) // w.nbytes) // 8 * 8)
            ws = [QTensor(r, w.ggml_type, shape) for r in _copies(w.data, n)]
            ops = {"matvec": (mv, ws)}
            if batched is not None:
                ops["matvec x8"] = (batched, [ws[i:i + 8] for i in range(0, len(ws), 8)])
            if not head:
                ops.update({f"matmul {t}": (fn, ws) for t, fn in mms.items()})
            for fn, items in ops.values():  # warm-up: first touches, threads, graphs
                fn(items[0])
            reader(ws[0].data)
            order = list(ops)
            rng.shuffle(order)
            for op in order:
                fn, items = ops[op]
                read_s, _ = _sweep(lambda v: reader(v.data), ws)
                seconds, cpu = _sweep(fn, items)
                nbytes = sum(v.nbytes for v in ws)
                samples.append({"shape": list(shape), "type": type_name, "op": op, "arm": args.arm,
                                "calls": len(items), "bytes": nbytes, "seconds": seconds, "cpu_seconds": cpu,
                                "read_seconds": read_s, "gweights_per_s": rows * cols * len(ws) / seconds / 1e9,
                                "gb_per_s": nbytes / seconds / 1e9, "read_gb_per_s": nbytes / read_s / 1e9,
                                "of_read": read_s / seconds})
            del ws, ops
    return samples


# --- parent ---

def _child(args, arm: str, seed: int) -> list[dict]:
    argv = [sys.executable, __file__, "--child", "--arm", arm, "--seed", str(seed), "--threads", str(args.threads),
            "--types", ",".join(args.types), "--shapes", ",".join(f"{r}x{c}" for r, c in args.shapes),
            "--positions", ",".join(map(str, args.positions)), "--cold-mb", str(args.cold_mb)]
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"child {arm} failed:\n{out.stderr}")
    return json.loads(out.stdout)


def _fmt(s: dict | None, digits: int = 2) -> str:
    return "-" if s is None else f"{s['median']:.{digits}f} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"


def _stat(samples, key, **match) -> dict | None:
    v = [s[key] for s in samples if all(s[k] == m for k, m in match.items())]
    return spread(v) if v else None


def markdown(receipt: dict) -> str:
    s, arms = receipt["samples"], receipt["arms"]
    ops = sorted({x["op"] for x in s}, key=lambda o: (o != "matvec", o != "matvec x8", len(o), o))
    lines = [f"# Kernel backends — {receipt['date']}", "",
             f"{host_line(receipt)}, commit `{receipt['commit']}`, load average at start "
             f"{receipt['load_average']}, at end {receipt['load_average_end']}; {receipt['threads']} threads; "
             f"{receipt['runs']} runs per arm, each a fresh process, arms alternating; every sample sweeps "
             f">= {receipt['cold_mb']:g} MiB of distinct copies of the weights", "",
             f"Command: `{receipt['command']}`", "", f"ggml: {receipt.get('ggml', '-')}", "",
             "G weights/s, median [min–max] over runs; **÷ read** is the kernel's GB/s of weight bytes over a "
             "streaming read of the same bytes timed just before it (NumPy uint64 sum, same threads), per pair.", ""]
    for shape in receipt["shapes"]:
        lines += [f"## {shape[0]}x{shape[1]}", "", "| type | op | " + " | ".join(arms) + " | best ÷ read | read GB/s |",
                  "|---|---|" + "---|" * (len(arms) + 2)]
        for t in receipt["types"]:
            for op in ops:
                cells, best = [], None
                for arm in arms:
                    st = _stat(s, "gweights_per_s", shape=shape, type=t, op=op, arm=arm)
                    cells.append(_fmt(st))
                    ratio = _stat(s, "of_read", shape=shape, type=t, op=op, arm=arm)
                    if st is not None and (best is None or ratio["median"] > best["median"]):
                        best = ratio
                if all(c == "-" for c in cells):
                    continue
                read = _stat(s, "read_gb_per_s", shape=shape, type=t, op=op)
                lines.append(f"| {t} | {op} | " + " | ".join(cells) + f" | {_fmt(best)} | {_fmt(read, 1)} |")
        lines.append("")
    lines += ["## Target: Q8_0 and Q4_K matvec >= 85% of the streaming read", ""]
    for t in ("Q8_0", "Q4_K"):
        for op in ("matvec", "matvec x8"):
            for arm in arms:
                r = [st["median"] for shape in receipt["shapes"]
                     if (st := _stat(s, "of_read", shape=shape, type=t, op=op, arm=arm))]
                if r:
                    lines.append(f"- {t} {op} {arm}: ÷ read medians {', '.join(f'{v:.2f}' for v in r)} "
                                 f"(shapes in table order): {'met' if min(r) >= TARGET else 'missed'}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="numpy,ggml")
    p.add_argument("--types", default="Q8_0,Q4_K,Q6_K,Q4_0,Q5_K,F16,BF16")
    p.add_argument("--shapes", default=f"{EXPERT},{ATTN},{HEAD}")
    p.add_argument("--positions", default="8,128", help="matmul batch sizes")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--cold-mb", type=float, default=256.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "evidence")
    p.add_argument("--lock", type=Path, default=None, help="hold this lock file exclusively during each round "
                   "of arms (e.g. /work/cpu.lock on a shared machine)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--arm", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.types = args.types.split(",")
    args.shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
    args.positions = [int(v) for v in args.positions.split(",") if v]
    if args.child:
        json.dump(child_run(args), sys.stdout)
        return 0
    arms = args.arms.split(",")
    receipt = {**header("tools/bench_backends.py"), "arms": arms, "runs": args.runs, "threads": args.threads,
               "cold_mb": args.cold_mb, "types": args.types, "shapes": [list(s) for s in args.shapes],
               "positions": args.positions,
               "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")}
    if "ggml" in arms:
        from colibri_aio.kernels.ggml_cpu import probe
        receipt["ggml"] = probe()
    samples = []
    for run in range(args.runs):
        with exclusive(args.lock):  # the machine is shared: one hold per round of arms, not for the whole benchmark
            for arm in (arms if run % 2 == 0 else arms[::-1]):
                samples += [{**x, "run": run} for x in _child(args, arm, args.seed + run)]
                print(f"run {run + 1}/{args.runs} {arm}: done", file=sys.stderr)
    receipt["load_average_end"] = os.getloadavg()
    receipt["samples"] = samples
    md = markdown(receipt)
    write(args.out, f"kernels_backends_{receipt['date']}", receipt, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
