"""Quantised matvec on the ggml backend against the memory-bandwidth roofline of the same bytes.

For each type (Q8_0, Q4_K by default; ``--types all`` for every type the engine
runs on ggml) one weight matrix larger than the
last-level cache (``--shape``, default the 65536 x 2048 of an output head) is
multiplied by one position on the engine's ggml backend (``GgmlKernels.linear``,
``--threads`` threads) on ggml's vec_dot and, for a type ggml repacks on this CPU
(``GgmlKernels.resident``: Q4_0, Q4_K, IQ4_NL, MXFP4 on AVX2), on its repacked copy
(the arm ``repacked``, what the engine runs on its resident trunk by default),
and the same bytes are read by a streaming reduction
(NumPy's vectorised sum of 64-bit words, one slice per thread): the
roofline, measured in the same run. A sample is the mean of ``--passes``
passes; arms alternate sample by sample; n samples each after one warm-up. The receipt quotes GB/s of weight
bytes, median and min–max, and the matvec's fraction of the roofline.

    python tools/bench_roofline.py --runs 7
    python tools/bench_roofline.py --runs 7 --types all
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from colibri_aio.bench.lock import exclusive
from colibri_aio.bench.receipt import header, host_line, spread, write
from colibri_aio.kernels.ggml_cpu import GgmlKernels, repack_types
from colibri_aio.kernels.qtensor import QTensor
from colibri_aio.kernels.quant import SUPPORTED_TYPES

ROOT = Path(__file__).resolve().parents[1]
# Byte offsets of each block's float16 scale(s) (ggml's block_* structs): set to a normal value so no
# product meets a NaN or an infinity. MXFP4's one scale is an E8M0 exponent byte; float types get floats.
F16_SCALES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
              "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
              "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ1_S": (0,),
              "TQ1_0": (52,), "TQ2_0": (64,)}
E8M0_SCALES = {"MXFP4": (0,)}
# IQ1_M's f16 scale is the top nibbles of the four uint16 at this offset, low nibble first. (NVFP4's
# UE4M3 scales are finite for every byte.)
NIBBLE_F16_SCALES = {"IQ1_M": 48}
FLOATS = {"F32": np.float32, "F16": np.float16}
TARGET = 0.85  # issue 12: matvec at >= 85% of the roofline


def weights(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> QTensor:
    """Random blocks of ``type_name`` with finite scales (random finite values for the float types)."""
    t = GGMLQuantizationType[type_name]
    if type_name in FLOATS or type_name == "BF16":
        x = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.01).astype(FLOATS.get(type_name, np.float32))
        raw = (x.view(np.uint32) >> 16).astype(np.uint16) if type_name == "BF16" else x
        return QTensor(raw.reshape(-1).view(np.uint8), t, (rows, cols))
    block, type_size = GGML_QUANT_SIZES[t]
    blocks = rng.integers(0, 256, (rows * cols // block, type_size), dtype=np.uint8)
    for at in F16_SCALES.get(type_name, ()):
        blocks[:, at:at + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    for at in E8M0_SCALES.get(type_name, ()):
        blocks[:, at] = 127 - 7  # 2**-7
    if (at := NIBBLE_F16_SCALES.get(type_name)) is not None:
        words = blocks[:, at:at + 8].view(np.uint16)
        bits = np.uint16(np.float16(0.01).view(np.uint16))
        words &= np.uint16(0x0FFF)
        words |= ((bits >> np.array([0, 4, 8, 12], np.uint16)) & np.uint16(0xF)) << np.uint16(12)
    return QTensor(blocks.reshape(-1), t, (rows, cols))


def engine_types(kernels: GgmlKernels) -> list[str]:
    """Every weight type the engine loads and its ggml backend multiplies, in GGUF's order."""
    return [t.name for t in sorted(SUPPORTED_TYPES & kernels.types, key=lambda t: t.value)]


def streaming_read(threads: int):
    """A function summing a uint8 array as 64-bit words, one slice per thread (NumPy's integer sum is
    vectorised and releases the GIL; one thread of it alone nearly saturates this machine's memory)."""
    pool = ThreadPoolExecutor(threads)

    def read(data: np.ndarray) -> int:
        words = data[: data.size // 8 * 8].view(np.uint64)
        parts = np.array_split(words, threads)
        return sum(pool.map(lambda part: int(part.sum()), parts))

    return read


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", default="Q8_0,Q4_K", help="comma-separated GGUF type names, or all")
    p.add_argument("--shape", default="65536x2048", help="rows x cols of the weight matrix")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--passes", type=int, default=5, help="passes over the matrix per sample (their mean time)")
    p.add_argument("--out", type=Path, default=ROOT / "evidence")
    p.add_argument("--lock", type=Path, default=None, help="hold this lock file exclusively during the run")
    args = p.parse_args()
    rows, cols = map(int, args.shape.split("x"))
    rng = np.random.default_rng(0)
    kernels = GgmlKernels(args.threads, repack=False)
    packing = GgmlKernels(args.threads, repack=True)
    repackable = {t.name for t in repack_types()} if rows % 16 == 0 else set()
    known = engine_types(kernels)
    names = known if args.types == "all" else args.types.split(",")
    if unknown := [n for n in names if n not in known]:
        p.error(f"--types: {', '.join(unknown)} not among the types the engine runs on ggml ({','.join(known)})")
    read = streaming_read(args.threads)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    samples: dict[str, dict[str, list[float]]] = {}
    with exclusive(args.lock):
        for name in names:
            w = weights(name, rows, cols, rng)
            arms = {"ggml matvec": lambda: kernels.linear(w, x), "streaming read": lambda: read(w.data)}
            if name in repackable:
                packing.resident([w])
                arms["repacked"] = lambda: packing.linear(w, x)
            got = samples[name] = {arm: [] for arm in arms}
            for run in range(args.runs + 1):
                for arm in (list(arms) if run % 2 else list(arms)[::-1]):
                    t0 = time.perf_counter()
                    for _ in range(args.passes):
                        arms[arm]()
                    dt = (time.perf_counter() - t0) / args.passes
                    if run:
                        got[arm].append(w.nbytes / dt / 1e9)
            del w
            packing.close()           # drops the repacked copy
    kernels.close()
    receipt = {**header("tools/bench_roofline.py"), "shape": [rows, cols], "threads": args.threads,
               "kernels": kernels.description, "unit": "GB/s of weight bytes", "samples": samples,
               "summary": {t: {a: spread(v) for a, v in s.items()} for t, s in samples.items()}}
    stamp = receipt["date"]
    lines = [f"# Matvec against the memory-bandwidth roofline — {stamp}", "",
             f"{host_line(receipt)}, commit `{receipt['commit']}`, {kernels.description}, {args.threads} threads, "
             f"load average at end {receipt['load_average']}", "", f"Command: `{receipt['command']}`", "",
             f"One ({rows} x {cols}) weight matrix per type, one position; the roofline is a streaming read of "
             f"the same bytes on {args.threads} threads in the same run, arms alternating; n = {args.runs} "
             "(tools/bench_roofline.py docstring).", "",
             "| type | MB | ggml matvec GB/s | repacked GB/s | streaming read GB/s | matvec ÷ roofline "
             "| repacked ÷ roofline |", "|---|---|---|---|---|---|---|"]
    for name, s in samples.items():
        mv, rd, rp = s["ggml matvec"], s["streaming read"], s.get("repacked")
        ratio = statistics.median(mv) / statistics.median(rd)
        receipt["summary"][name]["fraction"] = ratio
        packed = "—", "—"
        if rp:
            receipt["summary"][name]["repacked_fraction"] = statistics.median(rp) / statistics.median(rd)
            packed = (f"{statistics.median(rp):.2f} [{min(rp):.2f}–{max(rp):.2f}]",
                      f"**{statistics.median(rp) / statistics.median(rd):.2f}**")
        mb = QTensor.nbytes_for(GGMLQuantizationType[name], (rows, cols)) / 1e6
        lines.append(f"| {name} | {mb:.0f} | {statistics.median(mv):.2f} [{min(mv):.2f}–{max(mv):.2f}] | {packed[0]} | "
                     f"{statistics.median(rd):.2f} [{min(rd):.2f}–{max(rd):.2f}] | **{ratio:.2f}** | {packed[1]} |")
    lines += ["", f"Target: matvec >= {TARGET:.0%} of the roofline."]
    write(args.out, f"roofline_{stamp}", receipt, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
