"""``serve --parallel N`` under N concurrent streaming clients, beside one client alone on the same server.

Starts ``python -m colibri_aio serve --parallel N`` on 127.0.0.1. Each run has
two phases, their order flipped every run: one client alone, then (or
before) N clients at once, each streaming one text completion of
``--max-tokens`` tokens (end-of-generation tokens biased away, so every
answer runs to its length; different prompts, greedy). Aggregate tok/s of a
phase = completion tokens of its answers / the phase's wall time (first
request sent to last byte). Per stream, the time per output token (the gaps
between its token chunks): p50 and p99. A prober asks ``/health`` every
``--probe-interval`` seconds throughout, on its own connection. Checks:
every request a full answer (finish_reason "length", ``[DONE]``), the first
client's answer together equals its answer alone (greedy, whole prompts
prefilled: ``cache_prompt`` off; batching changes no token), /health answered
every time. Run 0 is a warm-up (graphs
traced, experts read) and not counted.

    python tools/bench_serve_batch.py --model /work/models/qwen3_30b_l8_q8_0.gguf --runs 5 --clients 8
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import httpx

from colibri_aio.bench.receipt import header as receipt_header, host_line, spread, write as write_receipt
from colibri_aio.serve.launch import ServerProcess
from load_test import percentiles, probe_health, sse_chunks

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["the list type", "dictionaries", "the with statement", "generators", "string formatting", "sockets",
          "the import system", "exceptions", "decorators", "the os module", "threads", "coroutines"]


async def stream_one(http: httpx.AsyncClient, prompt: str, max_tokens: int, bias: dict[str, float]) -> dict:
    """One streamed completion: its token chunk times (from sending), text, finish reason and whether [DONE]."""
    # cache_prompt off: every request prefills its whole prompt, alone or together, so that the two compute the
    # same thing (a prompt found in the KV cache prefills only its last token, which rounds differently).
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "logprobs": 0,
            "logit_bias": bias, "cache_prompt": False}
    t0 = time.perf_counter()
    times, text, finish, done = [], [], None, False
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "error": r.text[:200], "times": [], "text": "", "finish": None,
                    "done": False}
        async for chunk in sse_chunks(r):
            if chunk is None:
                done = True
                continue
            if "error" in chunk:
                return {"status": 200, "error": str(chunk["error"]), "times": times, "text": "".join(text),
                        "finish": None, "done": False}
            for choice in chunk["choices"]:
                tokens = (choice.get("logprobs") or {}).get("tokens") or []
                times += [time.perf_counter() - t0] * len(tokens)
                text.append(choice.get("text") or "")
                finish = choice.get("finish_reason") or finish
    return {"status": 200, "times": times, "text": "".join(text), "finish": finish, "done": done}


async def phase(url: str, prompts: list[str], max_tokens: int, bias: dict[str, float]) -> dict:
    limits = httpx.Limits(max_connections=len(prompts) + 2, max_keepalive_connections=len(prompts) + 2)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as http:
        t0 = time.perf_counter()
        answers = await asyncio.gather(*(stream_one(http, p, max_tokens, bias) for p in prompts))
        wall = time.perf_counter() - t0
    tokens = sum(len(a["times"]) for a in answers)
    gaps = [b - a for ans in answers for a, b in zip(ans["times"], ans["times"][1:])]
    return {"wall_s": wall, "tokens": tokens, "agg_tok_s": tokens / wall, "answers": answers,
            "ttft_s": [a["times"][0] if a["times"] else None for a in answers],
            "tpot": percentiles(gaps),
            "full": all(a["status"] == 200 and a["finish"] == "length" and a["done"] and len(a["times"]) == max_tokens
                        for a in answers)}


async def one_run(url: str, args: argparse.Namespace, bias: dict[str, float], index: int) -> dict:
    prompts = [f"The documentation of {TOPICS[i % len(TOPICS)]}" for i in range(args.clients)]
    stop = asyncio.Event()
    prober = asyncio.create_task(probe_health(url, args.probe_interval, stop))
    order = ["alone", "together"] if index % 2 == 0 else ["together", "alone"]
    out: dict = {"order": order}
    for name in order:
        out[name] = await phase(url, prompts[:1] if name == "alone" else prompts, args.max_tokens, bias)
    stop.set()
    probes = await prober
    out["health"] = percentiles([p.seconds for p in probes if p.ok])
    out["health_failures"] = sum(1 for p in probes if not p.ok)
    out["ratio"] = out["together"]["agg_tok_s"] / out["alone"]["agg_tok_s"]
    out["same_answer_as_alone"] = out["together"]["answers"][0]["text"] == out["alone"]["answers"][0]["text"]
    return out


def eog_bias(model: str | None) -> dict[str, float]:
    """The model's end-of-generation ids biased away (every answer runs to --max-tokens)."""
    from colibri_aio.gguf.model import load
    from colibri_aio.models import default_model_path
    from colibri_aio.text.cache import load_tokenizer

    tokenizer, _ = load_tokenizer(load(model or default_model_path(), resident=False), True)
    return {str(t): -100.0 for t in tokenizer.eog_ids}


def markdown(receipt: dict) -> str:
    a, runs, s = receipt["args"], receipt["runs"], receipt["summary"]
    lines = [f"# serve --parallel {a['clients']}: {a['clients']} streaming clients beside one — {receipt['date']}", "",
             f"{host_line(receipt)}, commit `{receipt['commit']}`, model `{a['model'] or 'shipped'}`", "",
             f"Command: `{receipt['command']}`", "",
             f"Per run: one client alone and {a['clients']} at once (order flipped every run), each one streamed "
             f"completion of {a['max_tokens']} tokens, greedy, EOG biased away; /health probed every "
             f"{a['probe_interval'] * 1e3:.0f} ms throughout. Run 0 is a warm-up, not counted.", "",
             "| run | order | alone tok/s | together tok/s | ratio | TPOT together p50 / p99 ms | TTFT together max s "
             "| /health p99 / max ms | full answers | same tokens |", "|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(runs):
        t = r["together"]
        lines.append(f"| {i}{' (warm-up)' if i == 0 else ''} | {', '.join(r['order'])} | {r['alone']['agg_tok_s']:.2f} "
                     f"| {t['agg_tok_s']:.2f} | {r['ratio']:.2f} | {t['tpot']['p50'] * 1e3:.0f} / "
                     f"{t['tpot']['p99'] * 1e3:.0f} | {max(x for x in t['ttft_s'] if x is not None):.2f} | "
                     f"{r['health']['p99'] * 1e3:.1f} / {r['health']['max'] * 1e3:.1f} | "
                     f"{r['alone']['full'] and t['full']} | {r['same_answer_as_alone']} |")
    lines += ["", f"Aggregate tok/s, {a['clients']} clients / one client, per counted run: median "
                  f"{s['ratio']['median']:.2f} [{s['ratio']['min']:.2f}–{s['ratio']['max']:.2f}] (target >= 1.8); "
                  f"one client {s['alone']['median']:.2f} [{s['alone']['min']:.2f}–{s['alone']['max']:.2f}] tok/s, "
                  f"{a['clients']} clients {s['together']['median']:.2f} [{s['together']['min']:.2f}–"
                  f"{s['together']['max']:.2f}] tok/s.",
              f"/health p99 per counted run: median {s['health_p99_ms']['median']:.1f} ms "
              f"[{s['health_p99_ms']['min']:.1f}–{s['health_p99_ms']['max']:.1f}] (target < 100 ms).",
              f"Checks: {'passed' if s['passed'] else 'FAILED'} (every answer full, the first client's tokens "
              f"equal alone and together, every /health answered)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF (default: the shipped model)")
    p.add_argument("--runs", type=int, default=5, help="counted runs, after one warm-up")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients, and the server's --parallel")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--probe-interval", type=float, default=0.05)
    p.add_argument("--server-args", default="", help="more `serve` options")
    p.add_argument("--out", type=Path, default=ROOT / "evidence")
    p.add_argument("--no-receipt", action="store_true")
    args = p.parse_args()
    serve_args = ["--parallel", str(args.clients), "--max-queue", str(args.clients), "--no-history",
                  *args.server_args.split()]
    if args.model:
        serve_args += ["--model", args.model]
    bias = eog_bias(args.model)
    runs = []
    with ServerProcess(*serve_args, host="127.0.0.1", start_timeout=900) as server:
        for i in range(args.runs + 1):
            runs.append(asyncio.run(one_run(server.url, args, bias, i)))
            r = runs[-1]
            print(f"run {i}: alone {r['alone']['agg_tok_s']:.2f} tok/s, {args.clients} together "
                  f"{r['together']['agg_tok_s']:.2f} tok/s (x{r['ratio']:.2f}), /health p99 "
                  f"{r['health']['p99'] * 1e3:.1f} ms", file=sys.stderr)
    counted = runs[1:]
    summary = {
        "ratio": spread([r["ratio"] for r in counted]),
        "alone": spread([r["alone"]["agg_tok_s"] for r in counted]),
        "together": spread([r["together"]["agg_tok_s"] for r in counted]),
        "health_p99_ms": spread([r["health"]["p99"] * 1e3 for r in counted]),
        "passed": all(r["alone"]["full"] and r["together"]["full"] and r["same_answer_as_alone"]
                      and not r["health_failures"] for r in runs),
    }
    receipt = {**receipt_header("tools/bench_serve_batch.py"), "args": vars(args) | {"out": str(args.out)},
               "summary": summary, "runs": runs}
    md = markdown(receipt)
    if not args.no_receipt:
        write_receipt(args.out, f"serve_batch_{receipt['date']}", receipt, md)
    print(md)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
