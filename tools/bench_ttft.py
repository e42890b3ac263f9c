"""Time to first token of ``python -m colibri_aio run``, with a cold and a warm cache directory, per kernel backend.

Each sample is a fresh process, timed from launch to the first byte of
generated text on stdout. "cold" gives the run an empty ``XDG_CACHE_HOME``
(the tokenizer is built from the GGUF and cached, no usage history); "warm"
reuses a directory a previous run filled (the tokenizer comes from its
cache). Arms are interleaved. ``--lock PATH`` holds an exclusive flock on
PATH around each run only; ``--drop-caches`` drops the page cache before
each run (inside the hold), so the model is read from disk every time.

    python tools/bench_ttft.py --model /work/models/q30b_l8_q8_real.gguf --runs 5 --lock /work/cpu.lock --drop-caches
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_scale import drop_page_cache  # noqa: E402
from colibri_aio.bench.lock import exclusive  # noqa: E402
from colibri_aio.bench.receipt import header as receipt_header, host_line, write as write_receipt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ("numpy", "ggml")


def first_token_seconds(kernels: str, cache_dir: str, model: str | None, lock: Path | None, drop: bool) -> float:
    env = {**os.environ, "XDG_CACHE_HOME": cache_dir, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "colibri_aio", "run", "--max-tokens", "4", "--no-stats", "--kernels", kernels]
    if model:
        cmd += ["--model", model]
    with exclusive(lock):
        if drop and not drop_page_cache():
            raise SystemExit("--drop-caches: cannot write /proc/sys/vm/drop_caches here")
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
    p.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated backends (default: %(default)s)")
    p.add_argument("--lock", type=Path, help="hold an exclusive flock on this file around each run")
    p.add_argument("--drop-caches", action="store_true", help="drop the page cache before each run")
    p.add_argument("--out", type=Path, default=ROOT / "evidence")
    args = p.parse_args()
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    warm = {k: tempfile.mkdtemp(prefix=f"colibri-warm-{k}-") for k in kernels}
    for k, d in warm.items():
        first_token_seconds(k, d, args.model, args.lock, False)  # fills the warm cache
    samples: dict[str, list[float]] = {f"{k} {c}": [] for k in kernels for c in ("cold", "warm")}
    for _ in range(args.runs):
        for k in kernels:
            with tempfile.TemporaryDirectory(prefix="colibri-cold-") as cold:
                samples[f"{k} cold"].append(first_token_seconds(k, cold, args.model, args.lock, args.drop_caches))
            samples[f"{k} warm"].append(first_token_seconds(k, warm[k], args.model, args.lock, args.drop_caches))
    summary = {a: {"median": statistics.median(x), "min": min(x), "max": max(x), "samples": x}
               for a, x in samples.items()}
    receipt = {**receipt_header("tools/bench_ttft.py"), "model": args.model or "shipped",
               "page_cache_dropped": args.drop_caches, "summary": summary}
    stamp = receipt["date"]
    lines = [f"# Time to first token of `run` — {stamp}", "",
             f"{host_line(receipt)}, commit `{receipt['commit']}`, model {receipt['model']}, load average at end "
             f"{receipt['load_average']}", "", f"Command: `{receipt['command']}`", "",
             "Fresh process per sample, launch to first byte of generated text; cold = empty XDG_CACHE_HOME "
             f"(tokenizer built); page cache {'dropped' if args.drop_caches else 'kept'} before each run.", "",
             "| kernels | cache | seconds median [min–max] |", "|---|---|---|"]
    for a, s in summary.items():
        k, c = a.split()
        lines.append(f"| {k} | {c} | {s['median']:.2f} [{s['min']:.2f}–{s['max']:.2f}] |")
    write_receipt(args.out, f"ttft_{stamp}", receipt, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
