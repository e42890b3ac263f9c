"""Time to first token beside llama.cpp: process start to the first generated token of a 32-id prompt.

Every sample is a fresh process started after the page cache is dropped
(the model comes from disk, as after a reboot), timed from just before the
launch to the moment the first token's logits are known (argmax taken). The
two engines alternate, the order flipped every round. ``--lock PATH`` holds
an exclusive flock on PATH around each run only.

- ours: ``Engine.open(model)`` with its defaults (context min(model, 4096),
  f16 KV cache, budget from RAM, ggml kernels, the warm start, the prefill's read-ahead), ``prefill``
  of the prompt;
- ours-warm (``--arms``): the same with the warm start asked for (receipts from when it was off by default);
- ours-nowarm (``--arms``): the same without the warm start (its A/B since it is on by default);
- ours-noahead (``--arms``): the same without the prefill's read-ahead (its A/B; receipts
  from when it was off by default have ours-ahead, ours with it on);
- ours-uring (``--arms``): the same with ``io="uring"``: the experts in a pool filled by O_DIRECT reads,
  the A/B of ``auto``'s page cache where every expert fits;
- llama.cpp: llama-cpp-python, ``n_threads=2``, ``n_ctx=4096`` (llama-cli's
  default), mmap, ``eval`` of the prompt.

After the first token each engine decodes ``--tg-first`` + ``--tg-steady``
fixed ids one at a time (teacher-forced: no loop on a repeated token). The
receipt compares our first ``--tg-first`` tokens' rate with the steady rate
of the ``--tg-steady`` after them: a warm start that filled the pool in time
makes them equal. ``open`` gives our per-step open times.

    python tools/bench_first_token.py --model /work/models/q30b_l8_q8_real.gguf --runs 5 --lock /work/cpu.lock
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_scale import describe_model, proc_read_bytes, token_ids  # noqa: E402
from colibri_aio.bench.arms import arm_env  # noqa: E402
from colibri_aio.bench.pagecache import drop_page_cache  # noqa: E402
from colibri_aio.bench.lock import exclusive  # noqa: E402
from colibri_aio.bench.receipt import header as receipt_header, host_line, spread, write as write_receipt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# ours-warm: Engine.open(warm_start=True), the warm start's A/B; ours-noahead: read_ahead=False, the read-ahead's A/B;
# ours-uring: io="uring", the A/B of auto's page cache where every expert fits (a pool filled by O_DIRECT reads)
ARMS = ("ours", "ours-warm", "ours-nowarm", "ours-noahead", "ours-uring", "llama.cpp")
OURS = {"ours": {}, "ours-warm": {"warm_start": True}, "ours-nowarm": {"warm_start": False},
        "ours-noahead": {"read_ahead": False}, "ours-uring": {"io": "uring"}}
PROMPT = 32
N_CTX = 4096


def worker_ours(model: Path, seed: int, tg: int, options: dict) -> dict:
    import asyncio

    import numpy as np

    from colibri_aio.engine.engine import Engine
    from colibri_aio.engine.memory import peak_rss_bytes

    async def run() -> dict:
        engine = await Engine.open(model, **options)
        t_open = time.time()
        try:
            ids = token_ids(seed, PROMPT + tg)
            logits = await engine.prefill(ids[:PROMPT])
            first = int(np.argmax(logits))
            t_first = time.time()
            prompt_io = {"prompt_read_busy_s": engine.source.reader.stats.busy_s,
                         "prompt_demand_wait_s": engine.source.demand_wait_s,
                         "prompt_gb_read": engine.source.reader.stats.io_bytes / 1e9}
            policy = engine.source.policy
            warm_left_at_first = policy.warm_pending
            ticks, warm_done_at = [], None
            for i, t in enumerate(ids[PROMPT:]):
                await engine.net.forward([t])
                ticks.append(time.time())
                if warm_done_at is None and policy.warm_pending == 0 and not policy.reads_in_flight:
                    warm_done_at = i + 1
            s = engine.stats()
            return {"open_at": t_open, "first_at": t_first, "first_token": first, "ticks": ticks, **prompt_io,
                    "open": engine.open_timings.as_dict() if engine.open_timings else None,
                    "plan": engine.plan.one_line(), "warm_left_at_first_token": warm_left_at_first,
                    "warm_reads": policy.stats.warm_reads, "warm_done_after_tokens": warm_done_at,
                    "ahead_reads": policy.stats.ahead_reads, "demand_reads": policy.stats.demand_reads,
                    "hit_rate": s.hit_rate, "gb_read": s.io_bytes / 1e9, "io": engine.source.reader.backend,
                    "peak_rss": peak_rss_bytes(), "disk_gb_read": proc_read_bytes() / 1e9}
        finally:
            await engine.aclose()

    return asyncio.run(run())


def worker_llama(model: Path, seed: int, tg: int) -> dict:
    import numpy as np
    from llama_cpp import Llama

    from colibri_aio.engine.memory import peak_rss_bytes

    llm = Llama(model_path=str(model), n_ctx=N_CTX, n_threads=2, n_threads_batch=2, n_batch=512, verbose=False)
    t_open = time.time()
    ids = token_ids(seed, PROMPT + tg)
    llm.eval(ids[:PROMPT])
    first = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t_first = time.time()
    ticks = []
    for t in ids[PROMPT:]:
        llm.eval([t])
        ticks.append(time.time())
    return {"open_at": t_open, "first_at": t_first, "first_token": first, "ticks": ticks,
            "peak_rss": peak_rss_bytes(), "disk_gb_read": proc_read_bytes() / 1e9}


def one_run(engine: str, args: argparse.Namespace) -> dict:
    """One fresh worker process for arm ``engine`` (``NAME`` or ``NAME@VARIABLE=VALUE``: one setting of its
    environment changed, a one-variable A/B of a colibri_aio.settings switch)."""
    base, env = arm_env(engine)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", base, "--model", str(args.model),
           "--seed", str(args.seed), "--tg-first", str(args.tg_first), "--tg-steady", str(args.tg_steady)]
    with exclusive(args.lock):
        dropped = drop_page_cache()
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    result: dict = {"engine": engine, "page_cache_dropped": dropped, "returncode": proc.returncode}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        result["error"] = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return result
    w = json.loads(lines[-1])
    ticks = w.pop("ticks")
    n1 = args.tg_first
    first_span = ticks[n1 - 1] - w["first_at"]
    steady_span = ticks[-1] - ticks[n1 - 1]
    result.update(w, ttft_s=w["first_at"] - t0, load_s=w["open_at"] - t0, prompt_s=w["first_at"] - w["open_at"],
                  first_tok_s=n1 / first_span, steady_tok_s=args.tg_steady / steady_span,
                  per_token_s=[round(b - a, 5) for a, b in zip([w["first_at"], *ticks[:-1]], ticks)])
    result["first_vs_steady"] = result["first_tok_s"] / result["steady_tok_s"]
    return result


# (arm, reference, key of the TTFT ratio; first_/steady_ keys for the rates), compared round by round
PAIRS = (("ours", "llama.cpp", "ttft_ratio"), ("ours-warm", "ours", "ttft_ratio_warm"),
         ("ours", "ours-noahead", "ttft_ratio_default_vs_noahead"),
         ("ours", "ours-nowarm", "ttft_ratio_default_vs_nowarm"),
         ("ours", "ours-uring", "ttft_ratio_default_vs_uring"), ("ours-uring", "llama.cpp", "ttft_ratio_uring"))


def _pairs(arms: list[str]) -> list[tuple[str, str, str]]:
    """:data:`PAIRS`, and each ``NAME@VARIABLE=VALUE`` arm beside its ``NAME`` (its one-variable A/B)."""
    return [*PAIRS, *((a, a.partition("@")[0], f"ttft_ratio_{a}") for a in arms if "@" in a)]


def summarise(runs: list[dict]) -> dict:
    out: dict = {}
    arms = list(dict.fromkeys(r["engine"] for r in runs))
    for e in [*ARMS, *(a for a in arms if a not in ARMS)]:
        ok = [r for r in runs if r["engine"] == e and "error" not in r]
        if not any(r["engine"] == e for r in runs):
            continue
        out[e] = {k: spread([r[k] for r in ok]) for k in ("ttft_s", "load_s", "prompt_s", "first_tok_s",
                                                           "steady_tok_s", "first_vs_steady") if ok}
        out[e]["failed"] = sum(1 for r in runs if r["engine"] == e and "error" in r)
    for arm, ref, key in _pairs(arms):
        pairs = [(a, b) for a, b in zip([r for r in runs if r["engine"] == arm],
                                         [r for r in runs if r["engine"] == ref])
                 if "error" not in a and "error" not in b]
        if pairs:
            out[key] = spread([a["ttft_s"] / b["ttft_s"] for a, b in pairs])
            out[key.replace("ttft_", "first_")] = spread([a["first_tok_s"] / b["first_tok_s"] for a, b in pairs])
            out[key.replace("ttft_", "steady_")] = spread([a["steady_tok_s"] / b["steady_tok_s"] for a, b in pairs])
    return out


def _cell(s: dict | None, fmt: str = "{:.2f}") -> str:
    if not s:
        return "-"
    return f"{fmt.format(s['median'])} [{fmt.format(s['min'])}–{fmt.format(s['max'])}]"


def markdown(receipt: dict) -> str:
    s = receipt["summary"]
    lines = [f"# Time to first token beside llama.cpp — {receipt['date']}", "",
             f"{host_line(receipt)}, commit `{receipt['commit']}`, "
             f"model {receipt['model']} "
             f"({receipt['model_bytes'] / 1e9:.2f} GB; {receipt['model_description']}), "
             f"load average at end {receipt['load_average']}", "",
             f"Command: `{receipt['command']}`", "",
             f"Fresh process per sample after the page cache is dropped; launch to the first token of a "
             f"{PROMPT}-id prompt; engines interleaved, order flipped each round; n = {receipt['runs']} each. "
             f"Then {receipt['tg_first']} + {receipt['tg_steady']} teacher-forced decode tokens.", "",
             "| engine | TTFT s | load s | prompt s | first tok/s | steady tok/s | first / steady |",
             "|---|---|---|---|---|---|---|"]
    for e in [a for a in dict.fromkeys([*ARMS, *receipt["arms"]]) if a in s]:
        x = s[e]
        lines.append(f"| {e} | {_cell(x.get('ttft_s'))} | {_cell(x.get('load_s'))} | {_cell(x.get('prompt_s'))} | "
                     f"{_cell(x.get('first_tok_s'))} | {_cell(x.get('steady_tok_s'))} | "
                     f"{_cell(x.get('first_vs_steady'))} |")
    lines.append("")
    for arm, ref, key in _pairs(receipt["arms"]):
        if key in s:
            lines += [f"{arm} / {ref}, per round: TTFT {_cell(s[key])}, first tokens' rate "
                      f"{_cell(s.get(key.replace('ttft_', 'first_')))}, steady rate "
                      f"{_cell(s.get(key.replace('ttft_', 'steady_')))}", ""]
    lines += ["Every sample (TTFT s; ours: open steps, warm start):", ""]
    for r in receipt["samples"]:
        if "error" in r:
            lines.append(f"- {r['engine']}: failed: {r['error']}")
            continue
        extra = ""
        if r["engine"].startswith("ours") and r.get("open"):
            o = r["open"]
            extra = (f"; io {r.get('io', '-')}; open {o['total_s']:.2f} s (trunk {o['trunk_s']:.2f}, tokenizer {o['tokenizer_s']:.2f} "
                     f"[{o['tokenizer_source']}], kernels {o['kernels_s']:.2f}, source {o['source_s']:.2f}); "
                     f"warm reads {r['warm_reads']}, left at first token {r['warm_left_at_first_token']}, "
                     f"done after token {r['warm_done_after_tokens']}; read-ahead {r.get('ahead_reads', 0)}, "
                     f"demand reads {r.get('demand_reads', '-')}; hit {r['hit_rate']:.1%}, "
                     f"read {r['gb_read']:.2f} GB")
        lines.append(f"- {r['engine']}: TTFT {r['ttft_s']:.2f} (load {r['load_s']:.2f} + prompt {r['prompt_s']:.2f}), "
                     f"first {r['first_tok_s']:.2f} tok/s, steady {r['steady_tok_s']:.2f} tok/s, "
                     f"disk read {r['disk_gb_read']:.2f} GB, peak RSS {r['peak_rss'] / 2**30:.2f} GiB{extra}")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tg-first", type=int, default=64)
    p.add_argument("--tg-steady", type=int, default=128)
    p.add_argument("--lock", type=Path, help="hold an exclusive flock on this file around each run")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", type=Path, default=ROOT / "evidence")
    p.add_argument("--arms", default="ours,llama.cpp",
                   help=f"comma-separated from {', '.join(ARMS)}, each may add @VARIABLE=VALUE (one setting of its "
                        "environment: an A/B beside the arm without it) (default: %(default)s)")
    p.add_argument("--jsonl", action="store_true",
                   help="also print each run's result as a JSON line on stdout (for tools/bench_commits.py)")
    p.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
    args = p.parse_args()
    tg = args.tg_first + args.tg_steady
    if args.worker in OURS:
        print(json.dumps(worker_ours(args.model, args.seed, tg, OURS[args.worker])))
        return 0
    if args.worker == "llama.cpp":
        print(json.dumps(worker_llama(args.model, args.seed, tg)))
        return 0
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or any(a.partition("@")[0] not in ARMS or ("@" in a and "=" not in a) for a in arms):
        p.error(f"--arms: choose from {', '.join(ARMS)} (each may add @VARIABLE=VALUE)")
    runs: list[dict] = []
    for i in range(args.runs):
        for engine in (arms if i % 2 == 0 else arms[::-1]):
            r = one_run(engine, args)
            runs.append(r)
            if args.jsonl:
                print(json.dumps(r), flush=True)
            print(f"round {i} {engine}: " + (r["error"] if "error" in r else
                  f"TTFT {r['ttft_s']:.2f} s, first {r['first_tok_s']:.2f} tok/s, steady {r['steady_tok_s']:.2f}"),
                  file=sys.stderr)
    receipt = {**receipt_header("tools/bench_first_token.py"), "model": str(args.model),
               "model_bytes": args.model.stat().st_size,
               "model_description": describe_model(args.model).get("description"),
               "runs": args.runs, "arms": arms, "prompt": PROMPT, "n_ctx_llama": N_CTX, "tg_first": args.tg_first,
               "tg_steady": args.tg_steady, "summary": summarise(runs), "samples": runs}
    text = markdown(receipt)
    write_receipt(args.out, f"first_token_{receipt['date']}", receipt, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
