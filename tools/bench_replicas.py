"""Requests/s and latency of 1 vs 2 engine replicas on Ray Serve under the same bounded load, CPU per replica.

Arms (each a fresh server, started for each run; arms interleaved, their order rotated every round):

- ``serve-1t``: ``python -m colibri_aio serve`` with one kernel thread — one engine on the budget of one replica,
  no Ray (the same-run reference: ``ray-1`` against it is what Ray costs);
- ``serve-2t``: the same with two kernel threads — one engine using the whole machine;
- ``ray-1``: ``serve --ray --replicas 1 --replica-cpus 1``;
- ``ray-2``: ``serve --ray --replicas 2 --replica-cpus 1`` (against ``ray-1``: what a second replica buys; against
  ``serve-2t``: two one-core replicas against one two-thread engine on the same cores).

A run sends ``--clients`` concurrent clients, each ``--requests`` requests in
turn (chat and text completions, half streamed, ``--max-tokens`` tokens each:
``tools/load_test.py``'s requests), after an untimed warm-up. ``--max-queue``
is large enough that no arm refuses a request, so every arm does the same
work. CPU time is read from ``/proc`` for each replica's process (its pid
from ``/health``) and for all the server's processes (Ray's gateway, proxy,
controller, raylet and GCS included), before and after the timed load.
With ``--lock``, the timed load holds an exclusive flock and the server
start a shared one (``--hold round``: one exclusive hold per round of arms); ``--gate`` names the writer-preferring gate a shared
machine puts in front of that lock.

    python tools/bench_replicas.py --runs 5 --lock /work/cpu.lock --gate /work/gate.lock
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench_commits import holding
from load_test import one_request, percentiles

from colibri_aio.bench.receipt import header as receipt_header, markdown_head, spread, write as write_receipt
from colibri_aio.serve.launch import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
# arm -> (serve's arguments, environment)
ARMS: dict[str, tuple[list[str], dict[str, str]]] = {
    "serve-1t": ([], {"COLIBRI_KERNEL_THREADS": "1"}),
    "serve-2t": ([], {"COLIBRI_KERNEL_THREADS": "2"}),
    "ray-1": (["--ray", "--replicas", "1", "--replica-cpus", "1"], {}),
    "ray-2": (["--ray", "--replicas", "2", "--replica-cpus", "1"], {}),
}
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far (0 if it has gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def tree(root: int) -> list[int]:
    """``root`` and every process descended from it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def replica_pids(url: str, server_pid: int) -> dict[str, int]:
    """Replica id -> pid (the plain server is its own one replica)."""
    health = httpx.get(f"{url}/health", timeout=30).json()
    if "replicas" not in health:
        return {"engine": server_pid}
    return {r["replica"]: r["pid"] for r in health["replicas"]}


async def load(url: str, args: argparse.Namespace) -> tuple[float, list[Any]]:
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout, limits=limits) as http:

        async def client(c: int) -> list[Any]:
            return [await one_request(http, c, i, args.max_tokens, args.request_timeout) for i in range(args.requests)]

        t0 = time.perf_counter()
        async with asyncio.timeout(args.run_deadline):
            per_client = await asyncio.gather(*(client(c) for c in range(args.clients)))
        return time.perf_counter() - t0, [o for os_ in per_client for o in os_]


@contextlib.contextmanager
def timing_lock(args: argparse.Namespace) -> Iterator[None]:
    """The exclusive hold of one timed load; with ``--gate``, taken through the gate first, as the shared
    machine's ``flock`` wrapper does, so shared takers queue behind a waiting benchmark instead of starving it."""
    with holding(args.gate, fcntl.LOCK_EX), holding(args.lock, fcntl.LOCK_EX):
        yield


def one_run(arm: str, args: argparse.Namespace, locked: bool = False) -> dict[str, Any]:
    """One arm's run: a fresh server, a warm-up, the timed load; ``locked``: the caller holds the exclusive lock."""
    extra, env = ARMS[arm]
    serve_args = ["--max-queue", str(args.max_queue), *extra, *(["--model", args.model] if args.model else [])]
    if not locked:
        with holding(args.gate, fcntl.LOCK_EX):  # wait behind a benchmark that waits, as every shared taker does
            pass
    with holding(None if locked else args.lock, fcntl.LOCK_SH):  # starting Ray is CPU-heavy: not while others time
        server = ServerProcess(*serve_args, host="127.0.0.1", env=env).start()
    try:
        asyncio.run(load(server.url, argparse.Namespace(**{**vars(args), "clients": 2, "requests": 2})))  # warm-up
        pids = replica_pids(server.url, server.pid)
        with contextlib.nullcontext() if locked else timing_lock(args):
            procs = tree(server.pid)
            before = {p: cpu_seconds(p) for p in procs}
            wall, outcomes = asyncio.run(load(server.url, args))
            used = {p: cpu_seconds(p) - before[p] for p in procs}
    finally:
        server.stop()
    answered = [o for o in outcomes if o.status == 200 and o.complete]
    replica_cpu = {rid: used.get(pid, 0.0) for rid, pid in pids.items()}
    return {
        "arm": arm, "wall_s": wall, "requests": len(outcomes), "answered": len(answered),
        "refused": sum(o.status == 429 for o in outcomes), "failed": [o.detail for o in outcomes if not o.complete],
        "requests_per_s": len(answered) / wall,
        "latency_s": percentiles([o.seconds for o in answered]),
        "ttft_stream_s": percentiles([o.ttft for o in answered if o.ttft is not None]),
        "cpu_s": {"replicas": replica_cpu, "all_processes": sum(used.values()),
                  "other_processes": sum(used.values()) - sum(replica_cpu.values()), "processes": len(procs)},
        "replica_cpu_share": {rid: s / wall for rid, s in replica_cpu.items()},
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        if not mine:
            continue
        out[arm] = {
            "requests_per_s": spread([r["requests_per_s"] for r in mine]),
            **{f"latency_{q}_s": spread([r["latency_s"][q] for r in mine]) for q in ("p50", "p90", "p99")},
            "ttft_p50_s": spread([r["ttft_stream_s"]["p50"] for r in mine]),
            "replica_cpu_share": spread([share for r in mine for share in r["replica_cpu_share"].values()]),
            "other_cpu_s": spread([r["cpu_s"]["other_processes"] for r in mine]),
            "all_cpu_per_request_ms": spread([r["cpu_s"]["all_processes"] / r["answered"] * 1e3 for r in mine]),
            "all_answered": all(r["answered"] == r["requests"] for r in mine),
        }
    med = {arm: s["requests_per_s"]["median"] for arm, s in out.items()}
    pairs = (("ray-2", "ray-1"), ("ray-1", "serve-1t"), ("ray-2", "serve-2t"), ("serve-2t", "serve-1t"))
    out["ratios"] = {f"{a} / {b}": med[a] / med[b] for a, b in pairs if a in med and b in med}
    return out


def markdown(receipt: dict[str, Any]) -> str:
    a, s = receipt["args"], receipt["summary"]
    lines = [*markdown_head("1 vs 2 replicas on Ray Serve", receipt, f"model {a['model'] or 'shipped'}"),
             f"Load per run: {a['clients']} concurrent clients x {a['requests']} requests in turn, {a['max_tokens']} "
             f"tokens each (chat and text completions, half streamed), `--max-queue {a['max_queue']}` (no arm "
             f"refuses). A fresh server per run, arms interleaved; {len(receipt['runs'])} runs. "
             f"{_locking(a)}Median [min–max] of the runs.", "",
             f"This machine has {receipt['cpus']} CPUs: replicas of one CPU each cannot use more than those, the "
             f"cores a single engine on {receipt['cpus']} threads uses too, so what a second replica can show here is "
             "bounded by the machine, not by the serving layer; on more cores (or hosts) each replica brings its own.",
             "",
             "| arm | requests/s | latency p50 s | p90 s | p99 s | stream TTFT p50 s | CPU share of each replica "
             "| other processes' CPU s | CPU ms per request (all) |", "|---|---|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        if arm not in s:
            continue
        x = s[arm]
        lines.append(f"| {arm} | {_m(x['requests_per_s'])} | {_m(x['latency_p50_s'])} | {_m(x['latency_p90_s'])} | "
                     f"{_m(x['latency_p99_s'])} | {_m(x['ttft_p50_s'])} | {_m(x['replica_cpu_share'])} | "
                     f"{_m(x['other_cpu_s'])} | {_m(x['all_cpu_per_request_ms'], 0)} |")
    lines += ["", "Ratios of median requests/s: " + ", ".join(f"{k} {v:.2f}" for k, v in s["ratios"].items()) + ".",
              "", "Every run, in order:", "", "| # | arm | wall s | answered | requests/s | CPU s per replica | "
              "other CPU s |", "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(receipt["runs"]):
        cpu = ", ".join(f"{v:.1f}" for v in r["cpu_s"]["replicas"].values())
        lines.append(f"| {i} | {r['arm']} | {r['wall_s']:.1f} | {r['answered']}/{r['requests']} | "
                     f"{r['requests_per_s']:.2f} | {cpu} | {r['cpu_s']['other_processes']:.1f} |")
    return "\n".join(lines) + "\n"


def _locking(a: dict[str, Any]) -> str:
    if not a["lock"]:
        return ""
    if a.get("hold") == "round":
        return "Each round (its servers' starts and timed loads) under one exclusive lock. "
    return "Timed loads under an exclusive lock, server starts under a shared one. "


def _m(d: dict[str, float], digits: int = 2) -> str:
    return f"{d['median']:.{digits}f} [{d['min']:.{digits}f}–{d['max']:.{digits}f}]"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF (default: the shipped model)")
    p.add_argument("--runs", type=int, default=5, help="runs per arm (default: %(default)s)")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of: " + ", ".join(ARMS))
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=6, help="requests per client per run")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-queue", type=int, default=8, help="each replica's --max-queue (>= clients: none refused)")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--run-deadline", type=float, default=900.0)
    p.add_argument("--lock", type=Path, default=None, help="flock file: exclusive while timing, shared while starting")
    p.add_argument("--hold", choices=("load", "round"), default="load",
                   help="what one exclusive hold covers: each timed load (servers start under a shared hold), or "
                        "a whole round of arms, starts included (one wait per round on a busy machine)")
    p.add_argument("--gate", type=Path, default=None,
                   help="flock file taken exclusively before --lock's exclusive hold (a writer-preferring gate)")
    p.add_argument("--out", type=Path, default=ROOT / "evidence")
    args = p.parse_args()
    arms = args.arms.split(",")
    if set(arms) - set(ARMS) or args.clients * args.requests > 2000:
        p.error("unknown arm, or more than 2000 requests per run")
    runs = []
    for i in range(args.runs):
        with timing_lock(args) if args.hold == "round" else contextlib.nullcontext():
            for arm in arms[i % len(arms):] + arms[:i % len(arms)]:
                runs.append(one_run(arm, args, locked=args.hold == "round"))
                r = runs[-1]
                print(f"round {i} {arm}: {r['requests_per_s']:.2f} req/s, p50 {r['latency_s'].get('p50', 0):.2f} s, "
                      f"replica CPU {[round(v, 1) for v in r['cpu_s']['replicas'].values()]} s, other "
                      f"{r['cpu_s']['other_processes']:.1f} s, answered {r['answered']}/{r['requests']}",
                      file=sys.stderr)
    receipt = {**receipt_header("tools/bench_replicas.py"), "args": vars(args) | {"out": str(args.out),
               "lock": str(args.lock) if args.lock else None,
               "gate": str(args.gate) if args.gate else None}, "summary": summary(runs), "runs": runs}
    md = markdown(receipt)
    write_receipt(args.out, f"replicas_{receipt['date']}", receipt, md)
    print(md)
    return 0 if all(r["answered"] == r["requests"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
