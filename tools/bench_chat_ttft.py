"""Time to first token of a chat's second turn through ``serve``, with and without KV-cache reuse.

One ``serve`` process on 127.0.0.1. Each sample is a fresh two-turn
conversation (its own topic): turn 1 (system + user message) streams
``--reply`` tokens; turn 2 sends the whole conversation again plus a new user
message, streamed, and is timed from sending to the chunk of its first token.
The arms differ in one variable, turn 2's ``cache_prompt`` (true: the engine
keeps the earlier turns in its KV cache and prefills only the new tokens;
false: it prefills the whole conversation). Arms alternate, the order
flipping every sample. The usage block of each turn 2 gives the prompt and
cached token counts.

    flock -x /work/cpu.lock python tools/bench_chat_ttft.py --model /work/models/q30b_l8_q8_real.gguf --runs 5
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

from colibri_aio.bench.receipt import header as receipt_header, host_line, spread, write as write_receipt
from colibri_aio.serve.launch import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = ("You are a careful assistant who answers questions about the Python programming language. "
          "Explain with short examples, name the modules and functions involved, and say when behaviour "
          "changed between versions. ")
TOPICS = ["list comprehensions", "the with statement", "asyncio task groups", "dataclasses", "the import system",
          "generators", "context variables", "the struct module", "pathlib", "exception groups", "descriptors",
          "the GIL"]


def stream_chat(http: httpx.Client, messages: list[dict], max_tokens: int, cache_prompt: bool) -> dict:
    """One streamed chat completion: its text, time to the first token, total time and usage.

    With ``logprobs`` every token makes a chunk, even one whose text is held
    back (part of a UTF-8 character): the first token is the first chunk with one.
    """
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.7, "seed": 1, "stream": True,
            "stream_options": {"include_usage": True}, "cache_prompt": cache_prompt, "logprobs": True}
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                if ttft is None and choice["logprobs"] and choice["logprobs"]["content"]:
                    ttft = time.perf_counter() - t0
                text.append(choice["delta"].get("content") or "")
    return {"ttft": ttft, "seconds": time.perf_counter() - t0, "text": "".join(text), "usage": usage}


def two_turns(http: httpx.Client, topic: str, args: argparse.Namespace, reuse: bool) -> dict:
    system = SYSTEM * args.system_repeat
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": f"Tell me about {topic}."}]
    first = stream_chat(http, turn1, args.reply, cache_prompt=True)
    turn2 = turn1 + [{"role": "assistant", "content": first["text"]},
                     {"role": "user", "content": f"Thank you. How does {topic} compare with what older versions "
                                                 f"of Python offered, and when would you avoid it?"}]
    second = stream_chat(http, turn2, 1, cache_prompt=reuse)
    return {"topic": topic, "turn1": {k: first[k] for k in ("ttft", "seconds", "usage")},
            "ttft": second["ttft"], "prompt_tokens": second["usage"]["prompt_tokens"],
            "cached_tokens": second["usage"]["prompt_tokens_details"]["cached_tokens"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF (default: the shipped model)")
    p.add_argument("--runs", type=int, default=5, help="samples per arm")
    p.add_argument("--reply", type=int, default=32, help="tokens of turn 1's reply")
    p.add_argument("--system-repeat", type=int, default=3, help="times the system text is repeated (prompt length)")
    p.add_argument("--ctx", type=int, default=4096, help="the server's --ctx")
    p.add_argument("--out", type=Path, default=ROOT / "evidence")
    args = p.parse_args()
    if args.runs * 2 > len(TOPICS):
        p.error(f"at most {len(TOPICS) // 2} runs (one fresh topic per sample)")
    serve_args = ["--ctx", str(args.ctx)] + (["--model", args.model] if args.model else [])
    samples: dict[str, list[dict]] = {"reuse": [], "no reuse": []}
    with ServerProcess(*serve_args) as server, httpx.Client(base_url=server.url, timeout=1800) as http:
        two_turns(http, "warming up", args, reuse=True)  # kernels, expert cache and page cache warm for both arms
        topics = iter(TOPICS)
        for i in range(args.runs):
            order = ("reuse", "no reuse") if i % 2 == 0 else ("no reuse", "reuse")
            for arm in order:
                s = two_turns(http, next(topics), args, reuse=arm == "reuse")
                samples[arm].append(s)
                print(f"sample {i} {arm}: turn-2 TTFT {s['ttft']:.3f} s, prompt {s['prompt_tokens']} tokens, "
                      f"cached {s['cached_tokens']}", file=sys.stderr)
        log = "".join(server.log)
    summary = {arm: {"ttft_s": spread([s["ttft"] for s in xs]),
                     "prompt_tokens": spread([s["prompt_tokens"] for s in xs]),
                     "cached_tokens": spread([s["cached_tokens"] for s in xs])} for arm, xs in samples.items()}
    ratio = summary["no reuse"]["ttft_s"]["median"] / summary["reuse"]["ttft_s"]["median"]
    receipt = {**receipt_header("tools/bench_chat_ttft.py"), "model": args.model or "shipped", "args": vars(args)
               | {"out": str(args.out)}, "summary": summary, "speedup_median": ratio, "samples": samples,
               "server_log": log}
    lines = [f"# Chat turn-2 time to first token, with and without KV-cache reuse — {receipt['date']}", "",
             f"{host_line(receipt)}, commit `{receipt['commit']}`, model `{receipt['model']}`, load average at "
             f"end {receipt['load_average']}", "", f"Command: `{receipt['command']}`", "",
             f"`serve --ctx {args.ctx}` with its default placement, one process; each sample a fresh two-turn "
             f"conversation (system + question, {args.reply}-token streamed reply, then the conversation + a new "
             "question), turn 2 timed from sending to the chunk of its first token. One variable: turn 2's "
             "`cache_prompt`. Arms alternate, order flipped every sample.", "",
             "| arm | turn-2 TTFT s, median [min–max] | prompt tokens | prefilled (prompt − cached) | n |",
             "|---|---|---|---|---|"]
    for arm, s in summary.items():
        t = s["ttft_s"]
        prefilled = [x["prompt_tokens"] - x["cached_tokens"] for x in samples[arm]]
        lines.append(f"| {arm} | {t['median']:.3f} [{t['min']:.3f}–{t['max']:.3f}] | "
                     f"{s['prompt_tokens']['median']:.0f} | {min(prefilled)}–{max(prefilled)} | {t['n']} |")
    lines += ["", f"No reuse ÷ reuse, medians: **{ratio:.1f}x**. Every sample is in the JSON receipt."]
    md = "\n".join(lines) + "\n"
    write_receipt(args.out, f"chat_ttft_{receipt['date']}", receipt, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
