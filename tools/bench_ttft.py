"""Time to first token of ``python -m colibri_aio run``, cold and warm, per kernel backend.

Each sample is a fresh process, timed from launch to the first byte of
generated text on stdout. "cold" gives the compiled kernels an empty cache
directory (NUMBA_CACHE_DIR), so they compile; "warm" reuses a directory a
previous run filled. The NumPy kernels compile nothing: their cold and warm
differ only by what the OS already caches. Arms are interleaved.

    python tools/bench_ttft.py --runs 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from colibri_aio.bench.receipt import header as receipt_header, write as write_receipt

ROOT = Path(__file__).resolve().parents[1]


def first_token_seconds(kernels: str, cache_dir: str, model: str | None) -> float:
    env = {**os.environ, "NUMBA_CACHE_DIR": cache_dir, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "colibri_aio", "run", "--max-tokens", "4", "--no-stats", "--kernels", kernels]
    if model:
        cmd += ["--model", model]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert proc.stdout is not None
    proc.stdout.read(1)
    t = time.perf_counter() - t0
    proc.stdout.read()
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(cmd)} failed")
    return t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--model", default=None, help="GGUF (default: the shipped model)")
    p.add_argument("--out", type=Path, default=ROOT / "evidence")
    args = p.parse_args()
    warm = {k: tempfile.mkdtemp(prefix=f"numba-warm-{k}-") for k in ("numpy", "auto")}
    for k, d in warm.items():
        first_token_seconds(k, d, args.model)  # fills the warm cache
    samples: dict[str, list[float]] = {f"{k} {c}": [] for k in ("numpy", "auto") for c in ("cold", "warm")}
    for _ in range(args.runs):
        for k in ("numpy", "auto"):
            with tempfile.TemporaryDirectory(prefix="numba-cold-") as cold:
                samples[f"{k} cold"].append(first_token_seconds(k, cold, args.model))
            samples[f"{k} warm"].append(first_token_seconds(k, warm[k], args.model))
    summary = {a: {"median": statistics.median(x), "min": min(x), "max": max(x), "samples": x}
               for a, x in samples.items()}
    receipt = {**receipt_header("tools/bench_ttft.py"), "model": args.model or "shipped", "summary": summary}
    stamp = receipt["date"]
    lines = [f"# Time to first token of `run` — {stamp}", "",
             f"host `{receipt['host']}`, commit `{receipt['commit']}`, model {receipt['model']}, load average at end "
             f"{receipt['load_average']}", "", f"Command: `{receipt['command']}`", "",
             "Fresh process per sample, launch to first byte of generated text; cold = empty NUMBA_CACHE_DIR.", "",
             "| kernels | cache | seconds median [min–max] |", "|---|---|---|"]
    for a, s in summary.items():
        k, c = a.split()
        lines.append(f"| {k} | {c} | {s['median']:.2f} [{s['min']:.2f}–{s['max']:.2f}] |")
    write_receipt(args.out, f"ttft_{stamp}", receipt, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
