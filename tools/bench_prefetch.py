"""Decode speed with prefetch off / on / auto, on an idle disk and on a saturated one.

The model is larger than the expert cache, so every token reads experts. Runs
are teacher-forced (a fixed sequence of ids fed one at a time, the same for
every arm) so greedy decoding cannot fall into a loop whose experts are all
cached. Arms are interleaved (off, on, auto, off, on, auto, ...) and each run
starts from an empty cache. "saturated" runs fio (random 1 MiB O_DIRECT reads,
QD 32) on another file of the same disk for the whole condition.

Per run it records decode tok/s, expert hit rate, bytes read, how often the
backpressure controller switched prefetch and why, its trials of prefetch off
against on and their verdicts, lookahead precision and recall, and the overlap
figure (compute busy + read busy) / wall, where compute busy is wall time minus
the time the decode loop waited for demand reads.

    python tools/bench_prefetch.py --runs 5                  # makes and removes an 8-layer model
    python tools/bench_prefetch.py --model M.gguf --runs 5   # an existing model
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from colibri_aio.gguf.model import Model, load
from colibri_aio.engine.memory import peak_rss_bytes
from colibri_aio.arch.qwen3moe import Qwen3MoE
from colibri_aio.policy.backpressure import BackpressureConfig
from colibri_aio.engine.placement import Placement, open_source
from colibri_aio.bench.receipt import header as receipt_header, host_line, write as write_receipt

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ARMS = "off,on,auto"


def arm_placement(arm: str) -> tuple[str, BackpressureConfig | None]:
    """An arm is a prefetch mode, optionally with a backpressure window ("auto@1.0"), optionally
    "+notrial": saturation turns prefetch off without a trial of off against on (auto before
    trials), for an A/B of that change."""
    arm, _, flag = arm.partition("+")
    mode, _, window = arm.partition("@")
    settings: dict = {}
    if window:
        settings["window"] = float(window)
    if flag == "notrial":
        settings["trial_steps"] = 0
    elif flag:
        raise SystemExit(f"unknown arm flag +{flag} (known: +notrial)")
    return mode, BackpressureConfig(**settings) if settings else None


async def one_run(model: Model, args: argparse.Namespace, arm: str, ids: list[int]) -> dict:
    """One teacher-forced decode from an empty cache; figures over the decode part only."""
    prefetch, config = arm_placement(arm)
    placement = Placement(io=args.io, cache_per_layer=args.cache_per_layer, prefetch=prefetch,
                          context=len(ids) + 1, backpressure=config)
    source, _plan = await open_source(model, placement)
    try:
        net = Qwen3MoE(model, source, len(ids) + 1)
        net.lookahead = placement.lookahead
        await net.forward(ids[: args.prefill])
        c0, r0, w0 = _cache(source), source.reader.stats.io_bytes, source.demand_wait_s
        busy0 = source.reader.stats.busy_s
        t0 = time.perf_counter()
        for token in ids[args.prefill:]:
            await net.forward([token])
        wall = time.perf_counter() - t0
        c1 = _cache(source)
        lookups = sum(c1[k] - c0[k] for k in ("pinned_hits", "cached_hits", "prefetch_hits", "misses"))
        hits = lookups - (c1["misses"] - c0["misses"])
        read_busy = source.reader.stats.busy_s - busy0
        compute_busy = wall - (source.demand_wait_s - w0)
        bp = source.policy.backpressure
        score = source.policy.predictor.score
        return {
            "prefetch": arm, "tokens": len(ids) - args.prefill, "seconds": wall,
            "tok_s": (len(ids) - args.prefill) / wall, "hit_rate": hits / lookups if lookups else 0.0,
            "prefetch_hits": c1["prefetch_hits"] - c0["prefetch_hits"],
            "prefetch_reads": c1["prefetch_reads"] - c0["prefetch_reads"],
            "prefetch_wasted": c1["prefetch_wasted"] - c0["prefetch_wasted"],
            "gb_read": (source.reader.stats.io_bytes - r0) / 1e9,
            "overlap": (compute_busy + read_busy) / wall, "compute_busy_s": compute_busy, "read_busy_s": read_busy,
            "lookahead_precision": score.precision, "lookahead_recall": score.recall,
            "switched_off": bp.counters.turned_off, "switched_on": bp.counters.turned_on,
            "trials": bp.counters.trials, "trial_verdict_on": bp.counters.trial_verdict_on,
            "trial_verdict_off": bp.counters.trial_verdict_off,
            "reasons": dict(bp.counters.reasons), "final_state": "on" if bp.prefetch_on else "off",
            "final_reason": bp.reason,
        }
    finally:
        await source.aclose()


def _cache(source) -> dict:
    s = source.policy.cache.stats
    return {k: getattr(s, k) for k in ("pinned_hits", "cached_hits", "prefetch_hits", "misses",
                                       "prefetch_reads", "prefetch_wasted")}


def start_saturation(path: Path, size_gb: int) -> subprocess.Popen:
    """fio reading another file of the same disk, O_DIRECT, QD 32, until stopped."""
    if shutil.which("fio") is None:
        raise SystemExit("fio is needed for the saturated condition (apt-get install fio)")
    return subprocess.Popen(
        ["fio", "--name=saturate", f"--filename={path}", f"--size={size_gb}G", "--rw=randread", "--bs=1M",
         "--iodepth=32", "--direct=1", "--ioengine=io_uring", "--time_based", "--runtime=86400",
         "--output=/dev/null"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def make_model(out: Path, layers: int | None, shape: str = "qwen3-30b-a3b", qtype: str = "q8_0") -> None:
    """A synthetic GGUF of ``shape`` (default Qwen3-30B-A3B, Q8_0) with realistic routing: its first
    ``layers`` blocks (None: all)."""
    cut = ["--layers", str(layers)] if layers else []
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_synthetic_gguf.py"), "--shape", shape,
                    *cut, "--type", qtype, "--routing", "realistic", "--out", str(out), "--force", "--quiet"],
                   check=True)


def summarise(runs: list[dict], arms: list[str]) -> dict:
    out: dict = {}
    for cond in sorted({r["condition"] for r in runs}):
        out[cond] = {}
        for arm in arms:
            xs = [r for r in runs if r["condition"] == cond and r["prefetch"] == arm]
            if not xs:
                continue
            tps = [r["tok_s"] for r in xs]
            out[cond][arm] = {
                "n": len(xs), "tok_s_median": statistics.median(tps), "tok_s_min": min(tps), "tok_s_max": max(tps),
                "hit_rate_median": statistics.median(r["hit_rate"] for r in xs),
                "gb_read_median": statistics.median(r["gb_read"] for r in xs),
                "overlap_median": statistics.median(r["overlap"] for r in xs),
                "switched_off_total": sum(r["switched_off"] for r in xs),
                "switched_on_total": sum(r["switched_on"] for r in xs),
                "trials_total": sum(r["trials"] for r in xs),
                "trial_verdict_on_total": sum(r["trial_verdict_on"] for r in xs),
                "trial_verdict_off_total": sum(r["trial_verdict_off"] for r in xs),
                "lookahead_precision_median": statistics.median(r["lookahead_precision"] for r in xs),
                "lookahead_recall_median": statistics.median(r["lookahead_recall"] for r in xs),
            }
        got = out[cond]
        if {"off", "on"} <= got.keys():
            best = max(got["off"]["tok_s_median"], got["on"]["tok_s_median"])
            got["vs_best"] = {a: got[a]["tok_s_median"] / best for a in arms if a.startswith("auto") and a in got}
    return out


def markdown(receipt: dict) -> str:
    lines = [f"# Prefetch off / on / auto — {receipt['date']}", "",
             f"{host_line(receipt)}, commit `{receipt['commit']}`, model `{receipt['model']}` "
             f"({receipt['model_note']}), cache {receipt['cache_per_layer']} experts per layer of "
             f"{receipt['expert_count']}, {receipt['tokens']} teacher-forced decode tokens per run, io "
             f"`{receipt['io']}`.", "", f"Command: `{receipt['command']}`", "",
             "| condition | prefetch | n | decode tok/s median [min–max] | hit rate | GB read | overlap | "
             "switched off/on | trials (verdicts on/off) | lookahead precision / recall |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for cond, arms in receipt["summary"].items():
        for arm in receipt["arms"]:
            a = arms.get(arm)
            if a is None:
                continue
            lines.append(f"| {cond} | {arm} | {a['n']} | {a['tok_s_median']:.3f} [{a['tok_s_min']:.3f}–"
                         f"{a['tok_s_max']:.3f}] | {a['hit_rate_median']:.1%} | {a['gb_read_median']:.2f} | "
                         f"{a['overlap_median']:.2f} | {a['switched_off_total']}/{a['switched_on_total']} | "
                         f"{a['trials_total']} ({a['trial_verdict_on_total']}/{a['trial_verdict_off_total']}) | "
                         f"{a['lookahead_precision_median']:.2f} / {a['lookahead_recall_median']:.2f} |")
        for arm, ratio in arms.get("vs_best", {}).items():
            lines.append(f"| {cond} | {arm} ÷ best of off, on | | **{ratio:.3f}** | | | | | | |")
    lines += ["", "Overlap = (compute busy + read busy) / wall: 1.0 means reads and compute never ran at the "
              "same time; 2.0 would be perfect overlap of equal halves.",
              "Every sample is in the JSON receipt beside this file, including the backpressure controller's "
              "reasons for each switch."]
    return "\n".join(lines) + "\n"


async def main_async(args: argparse.Namespace, model: Model) -> list[dict]:
    rng = np.random.default_rng(args.seed)
    ids = rng.integers(3, min(2048, model.args.vocab_size), args.prefill + args.tokens).tolist()
    runs = []
    for cond in args.conditions.split(","):
        fio = start_saturation(Path(args.saturate_file), args.saturate_gb) if cond == "saturated" else None
        try:
            if fio is not None:
                time.sleep(2.0)  # let fio reach its steady queue
            for i in range(args.runs):
                for arm in args.arms.split(","):
                    r = await one_run(model, args, arm, ids)
                    r.update(condition=cond, run=i)
                    print(json.dumps({k: r[k] for k in ("condition", "prefetch", "run", "tok_s", "hit_rate",
                                                        "gb_read", "overlap", "final_state")}), flush=True)
                    runs.append(r)
        finally:
            if fio is not None:
                os.killpg(fio.pid, signal.SIGTERM)
                fio.wait()
    return runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: make an 8-layer synthetic one)")
    p.add_argument("--layers", type=int, default=8, help="layers of the synthetic model (default: %(default)s)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--tokens", type=int, default=24, help="teacher-forced decode tokens per run")
    p.add_argument("--prefill", type=int, default=8, help="prompt tokens before the timed decode")
    p.add_argument("--cache-per-layer", type=int, default=32)
    p.add_argument("--io", default="uring")
    p.add_argument("--conditions", default="idle,saturated")
    p.add_argument("--saturate-file", default="/work/artifacts/bench/saturate.bin")
    p.add_argument("--saturate-gb", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", default=DEFAULT_ARMS,
                   help="prefetch modes to interleave; auto@W sets the backpressure window to W s, "
                        "+notrial an A/B flag (see arm_placement) (default: %(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / "evidence")
    args = p.parse_args()
    os.environ.setdefault("XDG_CACHE_HOME", tempfile.mkdtemp(prefix="bench-cache-"))  # no pins from old runs
    made = args.model is None
    model_path = args.model or Path(tempfile.mkdtemp(dir="/work/artifacts")) / f"q30b_l{args.layers}_q8_real.gguf"
    if made:
        make_model(model_path, args.layers)
    try:
        model = load(model_path)
        runs = asyncio.run(main_async(args, model))
        desc = model.reader.fields.get("general.description")
        note = desc.contents() if desc is not None else "no description"
        receipt = {
            **receipt_header("bench_prefetch.py"), "model": model_path.name,
            "model_note": note, "model_bytes": model.file_nbytes, "expert_count": model.args.expert_count,
            "cache_per_layer": args.cache_per_layer, "tokens": args.tokens, "io": args.io,
            "peak_rss_bytes": peak_rss_bytes(), "arms": args.arms.split(","),
            "summary": summarise(runs, args.arms.split(",")), "runs": runs,
            "note": "shared 2-vCPU machine: other jobs may have run during the measurement",
        }
        write_receipt(args.out, f"prefetch_{receipt['date']}", receipt, markdown(receipt))
        print(markdown(receipt))
    finally:
        if made:
            model_path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
