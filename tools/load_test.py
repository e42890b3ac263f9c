"""Load test of ``serve`` on loopback: more concurrent clients than the queue holds, bounded in count and time.

Starts ``python -m colibri_aio serve`` on 127.0.0.1 (a free port). Each run
sends ``--clients`` concurrent clients at it, each with ``--requests`` chat or
text completions in turn, half of them streamed. Meanwhile a prober asks
``/health`` every ``--probe-interval`` seconds on its own connection and
notes whether a generation was running. Checks, per run: every request ends
in a full answer (finish_reason, and ``[DONE]`` for a stream) or a 429 with
Retry-After; nothing else, nothing hangs (a per-request timeout and a
deadline for the run); the server's own request counters agree with what the
clients got (nothing lost or answered twice); the engine is idle at the end.
The receipt has latency percentiles (whole answers, 429s, time to first
token of streams) and ``/health`` latency while generating beside the same
probe while idle (the reference). Exit status 1 if a check fails.

    python tools/load_test.py --runs 5
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from colibri_aio.bench.receipt import header as receipt_header, markdown_head, spread, write as write_receipt
from colibri_aio.serve.launch import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
NO_END = {"0": -100, "2": -100}  # the shipped model's end tokens: every answer runs to max_tokens
TOPICS = ["the list type", "dictionaries", "the with statement", "generators", "string formatting", "sockets",
          "the import system", "exceptions", "decorators", "the os module"]


@dataclass
class Outcome:
    client: int
    kind: str           # chat | completion, + " stream"
    status: int         # HTTP status; 0: no answer (timeout or connection error)
    seconds: float      # send to last byte
    ttft: float | None  # send to first content (streams)
    complete: bool      # a full answer, or a 429 with Retry-After
    detail: str = ""


@dataclass
class Probe:
    t: float
    seconds: float
    busy: bool
    ok: bool


def percentiles(xs: list[float]) -> dict[str, float | int]:
    if not xs:
        return {"n": 0}
    s = sorted(xs)

    def q(p: float) -> float:
        return s[min(len(s) - 1, int(round(p * (len(s) - 1))))]

    return {"n": len(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": s[-1]}


async def one_request(http: httpx.AsyncClient, client: int, i: int, max_tokens: int, timeout: float) -> Outcome:
    stream = (client + i) % 2 == 1
    chat = (client + i) % 3 != 2
    topic = TOPICS[(client * 7 + i) % len(TOPICS)]
    common = {"max_tokens": max_tokens, "temperature": 0.7, "seed": client * 100 + i, "stream": stream,
              "logit_bias": NO_END}
    # Streams ask for logprobs: then every token makes a chunk, also one whose text is held back, and the
    # first chunk with a token times the first token.
    if chat:
        path, body = "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": f"Explain {topic}."}],
                                              **({"logprobs": True} if stream else {})}
    else:
        path, body = "/v1/completions", {**common, "prompt": f"The documentation of {topic}",
                                         **({"logprobs": 0} if stream else {})}
    kind = ("chat" if chat else "completion") + (" stream" if stream else "")
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            if not stream:
                r = await http.post(path, json=body)
                return _judge_whole(client, kind, r, time.perf_counter() - t0)
            async with http.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return _judge_whole(client, kind, r, time.perf_counter() - t0)
                ttft, finish, done, data = None, None, False, 0
                async for chunk in sse_chunks(r):
                    if chunk is None:
                        done = True
                        continue
                    if "error" in chunk:
                        return Outcome(client, kind, r.status_code, time.perf_counter() - t0, ttft, False,
                                       f"error in stream: {chunk['error']}")
                    for choice in chunk["choices"]:
                        data += 1
                        lp = choice.get("logprobs") or {}
                        if ttft is None and (lp.get("content") or lp.get("tokens")):
                            ttft = time.perf_counter() - t0
                        finish = choice.get("finish_reason") or finish
                ok = done and finish == "length"
                return Outcome(client, kind, 200, time.perf_counter() - t0, ttft, ok,
                               "" if ok else f"stream ended: done={done} finish={finish} chunks={data}")
    except (TimeoutError, httpx.HTTPError) as exc:
        return Outcome(client, kind, 0, time.perf_counter() - t0, None, False, f"{exc.__class__.__name__}: {exc}")


async def sse_chunks(r: httpx.Response) -> AsyncIterator[dict | None]:
    """The JSON chunks of an SSE stream of the OpenAI API, then None for its ``[DONE]``."""
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        yield None if payload == "[DONE]" else json.loads(payload)


def _judge_whole(client: int, kind: str, r: httpx.Response, seconds: float) -> Outcome:
    if r.status_code == 429:
        ok = r.headers.get("retry-after", "").isdigit() and r.json()["error"]["code"] == "queue_full"
        return Outcome(client, kind, 429, seconds, None, ok, "" if ok else "429 without Retry-After")
    if r.status_code != 200:
        return Outcome(client, kind, r.status_code, seconds, None, False, r.text[:200])
    choice = r.json()["choices"][0]
    ok = choice["finish_reason"] == "length"
    return Outcome(client, kind, 200, seconds, None, ok, "" if ok else f"finish_reason {choice['finish_reason']}")


async def probe_health(url: str, interval: float, stop: asyncio.Event) -> list[Probe]:
    probes: list[Probe] = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        t_start = time.perf_counter()
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                r = await http.get("/health")
                probes.append(Probe(t0 - t_start, time.perf_counter() - t0, r.json()["busy"], r.status_code == 200))
            except httpx.HTTPError:
                probes.append(Probe(t0 - t_start, time.perf_counter() - t0, False, False))
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except TimeoutError:
                pass
    return probes


async def server_counts(url: str) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        text = (await http.get("/metrics")).text
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            # The front door's series: behind serve --ray, the replicas' own carry a replica label.
            if s.name == "colibri_requests_total" and "replica" not in s.labels and \
                    s.labels["endpoint"] in ("/v1/chat/completions", "/v1/completions"):
                counts[s.labels["status"]] = counts.get(s.labels["status"], 0) + s.value
    return counts


async def one_run(url: str, args: argparse.Namespace) -> dict:
    before = await server_counts(url)
    stop = asyncio.Event()
    idle_probes = await _idle_reference(url, args)
    prober = asyncio.create_task(probe_health(url, args.probe_interval, stop))
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout, limits=limits) as http:

        async def client(c: int) -> list[Outcome]:
            return [await one_request(http, c, i, args.max_tokens, args.request_timeout) for i in range(args.requests)]

        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(args.run_deadline):
                per_client = await asyncio.gather(*(client(c) for c in range(args.clients)))
            hung = False
        except TimeoutError:
            per_client, hung = [], True
        wall = time.perf_counter() - t0
    stop.set()
    probes = await prober
    outcomes = [o for os_ in per_client for o in os_]
    after = await server_counts(url)
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        health = (await http.get("/health")).json()
    served = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    got = {str(s): sum(1 for o in outcomes if o.status == s) for s in {o.status for o in outcomes}}
    busy = [p.seconds for p in probes if p.busy and p.ok]
    checks = {
        "no run hung": not hung,
        "every request answered": len(outcomes) == args.clients * args.requests,
        "each answer full or 429 with Retry-After": all(o.complete and o.status in (200, 429) for o in outcomes),
        "server counts equal client counts": {k: v for k, v in served.items() if v} == {k: float(v) for k, v in
                                                                                     got.items()},
        "engine idle at the end": {k: health.get(k) for k in ("status", "busy", "waiting")} == {
            "status": "ok", "busy": False, "waiting": 0},
        "every health probe answered": all(p.ok for p in probes) and bool(probes),
        "probes during generation": bool(busy),
    }
    return {
        "wall_s": wall, "outcomes": [asdict(o) for o in outcomes], "server_counts": served,
        "health_probes": [asdict(p) for p in probes], "idle_reference_probes": idle_probes,
        "answered_200": sum(o.status == 200 for o in outcomes), "answered_429": sum(o.status == 429 for o in outcomes),
        "latency_200": percentiles([o.seconds for o in outcomes if o.status == 200]),
        "latency_429": percentiles([o.seconds for o in outcomes if o.status == 429]),
        "ttft_stream": percentiles([o.ttft for o in outcomes if o.ttft is not None]),
        "health_busy": percentiles(busy), "health_idle": percentiles(idle_probes),
        "checks": checks, "failures": [asdict(o) for o in outcomes if not o.complete],
    }


async def _idle_reference(url: str, args: argparse.Namespace, n: int = 50) -> list[float]:
    """The same /health probe on an idle engine: what the probe costs without a generation."""
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        for _ in range(n):
            t0 = time.perf_counter()
            await http.get("/health")
            out.append(time.perf_counter() - t0)
            await asyncio.sleep(args.probe_interval)
    return out


def markdown(receipt: dict) -> str:
    a, runs = receipt["args"], receipt["runs"]
    lines = [*markdown_head("Load test of `serve`", receipt, f"model {a['model'] or 'shipped'}"),
             f"{a['clients']} concurrent clients x {a['requests']} requests each per run ({a['max_tokens']} tokens, "
             f"half streamed, chat and text completions), `--max-queue {a['max_queue']}`; /health probed every "
             f"{a['probe_interval'] * 1000:.0f} ms on its own connection. Runs: {len(runs)}.", "",
             "| run | wall s | 200 | 429 | answer p50 / p99 s | 429 p50 / p99 ms | stream TTFT p50 / p99 s "
             "| /health while generating p50 / p99 / max ms (n) | /health idle p50 / p99 ms | checks |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(runs):
        l2, l4, tt, hb, hi = r["latency_200"], r["latency_429"], r["ttft_stream"], r["health_busy"], r["health_idle"]
        ok = all(r["checks"].values())
        lines.append(
            f"| {i} | {r['wall_s']:.1f} | {r['answered_200']} | {r['answered_429']} | "
            f"{_f(l2, 'p50')} / {_f(l2, 'p99')} | {_f(l4, 'p50', 1e3)} / {_f(l4, 'p99', 1e3)} | "
            f"{_f(tt, 'p50')} / {_f(tt, 'p99')} | {_f(hb, 'p50', 1e3)} / {_f(hb, 'p99', 1e3)} / "
            f"{_f(hb, 'max', 1e3)} ({hb['n']}) | {_f(hi, 'p50', 1e3)} / {_f(hi, 'p99', 1e3)} | "
            f"{'all passed' if ok else 'FAILED: ' + ', '.join(k for k, v in r['checks'].items() if not v)} |")
    s = receipt["summary"]
    lines += ["", f"/health p99 while generating, per run: median {s['health_busy_p99_ms']['median']:.1f} ms "
                  f"[{s['health_busy_p99_ms']['min']:.1f}–{s['health_busy_p99_ms']['max']:.1f}] (target < 100 ms); "
                  f"idle reference p99 median {s['health_idle_p99_ms']['median']:.1f} ms; all probes pooled: "
                  f"p99 {s['health_busy_pooled']['p99'] * 1e3:.1f} ms of {s['health_busy_pooled']['n']}.",
              f"Checks: {'every run passed every check' if s['passed'] else 'FAILED'} (every request a full answer "
              f"or a 429 with Retry-After, none hung, server counts = client counts, idle at the end)."]
    return "\n".join(lines) + "\n"


def _f(d: dict, key: str, scale: float = 1.0) -> str:
    return f"{d[key] * scale:.2f}" if key in d else "-"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF (default: the shipped model)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--clients", type=int, default=16, help="concurrent clients per run (default: %(default)s)")
    p.add_argument("--requests", type=int, default=3, help="requests per client per run (default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=4, help="the server's --max-queue (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per answer (default: %(default)s)")
    p.add_argument("--probe-interval", type=float, default=0.02, help="seconds between /health probes")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds before a request counts as hung")
    p.add_argument("--run-deadline", type=float, default=900.0, help="seconds before a run counts as hung")
    p.add_argument("--server-args", default="", help="more `serve` options, e.g. '--ctx 2048'")
    p.add_argument("--out", type=Path, default=ROOT / "evidence")
    args = p.parse_args()
    if args.clients * args.requests > 2000:
        p.error("at most 2000 requests per run")
    serve_args = ["--max-queue", str(args.max_queue), *args.server_args.split()]
    if args.model:
        serve_args += ["--model", args.model]
    runs = []
    with ServerProcess(*serve_args, host="127.0.0.1") as server:  # loopback only
        for i in range(args.runs):
            runs.append(asyncio.run(one_run(server.url, args)))
            r = runs[-1]
            print(f"run {i}: {r['answered_200']} x 200, {r['answered_429']} x 429, /health while generating p99 "
                  f"{r['health_busy'].get('p99', float('nan')) * 1e3:.1f} ms, checks "
                  f"{'passed' if all(r['checks'].values()) else 'FAILED'}", file=sys.stderr)
    pooled = percentiles([p_["seconds"] for r in runs for p_ in r["health_probes"] if p_["busy"] and p_["ok"]])
    summary = {
        "health_busy_p99_ms": spread([r["health_busy"]["p99"] * 1e3 for r in runs if r["health_busy"]["n"]]),
        "health_idle_p99_ms": spread([r["health_idle"]["p99"] * 1e3 for r in runs]),
        "health_busy_pooled": pooled,
        "latency_200_p50_s": spread([r["latency_200"]["p50"] for r in runs if r["latency_200"]["n"]]),
        "passed": all(all(r["checks"].values()) for r in runs),
    }
    receipt = {**receipt_header("tools/load_test.py"), "args": vars(args) | {"out": str(args.out)},
               "summary": summary, "runs": runs}
    md = markdown(receipt)
    write_receipt(args.out, f"load_{receipt['date']}", receipt, md)
    print(md)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
