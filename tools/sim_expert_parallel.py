"""When would spreading one model's experts over hosts pay? A simulation from route traces.

For H hosts (host 0 runs the trunk), each placement of the experts, and each
network (bandwidth, round-trip time), it prints per token: the round trips,
the bytes host 0 sends and receives, the network time, and the busiest host's
share of the expert work (:mod:`colibri_aio.policy.expert_parallel` has the
model). Beside it, the alternative on one host whose RAM holds the same share
of the experts (1/H of each layer's) and that streams the rest from disk: the
bytes it reads per token in a replay of the same trace through the engine's
cache policy (``lfru``, a quota per layer), and their time at ``--disk-gbs``.

Traces are ``python -m colibri_aio trace`` files; prompt positions are replayed
one at a time, as decode (``split_prefill``). ``--layers`` scales the per-token
numbers to a model of that depth with layers like the traced ones (a cut of a
deeper model). ``--out`` writes a receipt (JSON + markdown) through
``colibri_aio.bench.receipt``.

    python tools/sim_expert_parallel.py /tmp/q30b.jsonl --hidden 2048 --layers 48 --out evidence
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from colibri_aio.bench.receipt import header as receipt_header, host_line, write as write_receipt
from colibri_aio.cli.replay import load_traces
from colibri_aio.policy.expert_parallel import Link, balanced, expert_counts, host_loads, round_robin, traffic
from colibri_aio.policy.replay import ReplayConfig, Trace, replay

PLACEMENTS = ("round_robin", "balanced")


def placement_of(name: str, trace: Trace, hosts: int) -> list[list[int]]:
    """``round_robin``, or ``balanced`` on the trace's own use counts (it has seen the future: optimistic)."""
    if name == "round_robin":
        return round_robin(trace.block_count, trace.expert_count, hosts)
    return balanced(expert_counts(trace.steps, trace.block_count, trace.expert_count), hosts)


def disk_bytes_per_token(trace: Trace, hosts: int) -> float:
    """Expert bytes one host reads per token when its cache holds 1/hosts of each layer's experts."""
    result = replay(trace, ReplayConfig(policy="lfru", cache_per_layer=max(1, trace.expert_count // hosts)))
    return result.as_dict()["bytes_per_token"]


def simulate(trace: Trace, args: argparse.Namespace) -> list[dict[str, Any]]:
    scale = (args.layers or trace.block_count) / trace.block_count
    counts = expert_counts(trace.steps, trace.block_count, trace.expert_count)
    rows = []
    for hosts in args.hosts:
        disk = disk_bytes_per_token(trace, hosts) * scale
        for name in args.placements:
            placement = placement_of(name, trace, hosts)
            loads = host_loads(counts, placement, hosts)
            for gbit in args.bandwidth_gbit:
                for rtt_ms in args.rtt_ms:
                    link = Link(gbit * 1e9 / 8, rtt_ms / 1e3, args.activation_bytes)
                    t = traffic(trace.steps, placement, hosts, args.hidden, link)
                    rows.append({
                        "hosts": hosts, "placement": name, "bandwidth_gbit": gbit, "rtt_ms": rtt_ms,
                        "positions": t.positions,
                        "round_trips_per_token": t.per_token(t.round_trips) * scale,
                        "remote_expert_share": t.remote_experts / max(1, sum(loads)),
                        "home_kb_per_token": t.per_token(t.home_sent + t.home_received) * scale / 1e3,
                        "busiest_remote_kb_per_token": t.per_token(t.busiest_remote_sent) * scale / 1e3,
                        "network_ms_per_token": t.per_token(t.seconds) * scale * 1e3,
                        "busiest_host_work_share": max(loads) / max(1, sum(loads)),
                        "one_host_disk_mb_per_token": disk / 1e6,
                        "one_host_disk_ms_per_token": disk / (args.disk_gbs * 1e9) * 1e3,
                    })
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| hosts | placement | Gbit/s | RTT ms | round trips/token | experts away | host 0 KB/token "
             "| network ms/token | busiest host's work | one host, 1/H in RAM: disk MB/token | its disk ms/token |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['hosts']} | {r['placement']} | {r['bandwidth_gbit']:g} | {r['rtt_ms']:g} | "
            f"{r['round_trips_per_token']:.1f} | {r['remote_expert_share']:.0%} | {r['home_kb_per_token']:.1f} | "
            f"{r['network_ms_per_token']:.2f} | {r['busiest_host_work_share']:.0%} | "
            f"{r['one_host_disk_mb_per_token']:.1f} | {r['one_host_disk_ms_per_token']:.1f} |")
    return "\n".join(lines)


def markdown(receipt: dict[str, Any]) -> str:
    a, t = receipt["args"], receipt["trace"]
    return "\n".join([
        f"# Expert parallelism from route traces — {receipt['date']}", "",
        f"{host_line(receipt)}, commit `{receipt['commit']}`", "", f"Command: `{receipt['command']}`", "",
        f"Traces: {', '.join(a['traces'])} ({t['block_count']} layers, {t['expert_count']} experts, top-"
        f"{t['expert_used_count']}, {t['expert_nbytes']} bytes per expert, {t['positions']} positions replayed as "
        f"decode; made by: {a['about'] or 'not said'}). Hidden size {a['hidden']}, {a['activation_bytes']} bytes per activation; per-token numbers "
        f"scaled to {a['layers'] or t['block_count']} layers; disk at {a['disk_gbs']:g} GB/s. A simulation: no "
        "host, network or disk was timed.", "", table(receipt["rows"]), ""])


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="route trace files (.jsonl) of one model")
    p.add_argument("--hidden", type=int, required=True, help="the model's hidden size (embedding_length)")
    p.add_argument("--hosts", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8])
    p.add_argument("--placements", type=lambda s: s.split(","), default=list(PLACEMENTS))
    p.add_argument("--bandwidth-gbit", type=_floats, default=[1.0, 10.0, 100.0])
    p.add_argument("--rtt-ms", type=_floats, default=[0.05, 0.5])
    p.add_argument("--activation-bytes", type=int, default=2, help="bytes per hidden value sent (default: bf16)")
    p.add_argument("--layers", type=int, default=None, help="scale per-token numbers to this many layers")
    p.add_argument("--disk-gbs", type=float, default=2.0, help="disk read rate of the one-host alternative, GB/s")
    p.add_argument("--about", default=None, help="how the traces were made (quoted in the receipt)")
    p.add_argument("--out", type=Path, default=None, help="write a receipt to this folder")
    args = p.parse_args()
    if set(args.placements) - set(PLACEMENTS) or min(args.hosts) < 1 or args.hidden < 1:
        p.error(f"placements are {', '.join(PLACEMENTS)}; hosts and hidden must be >= 1")
    trace = load_traces(args.traces, split_prefill=True)
    rows = simulate(trace, args)
    receipt = {**receipt_header("tools/sim_expert_parallel.py"),
               "args": vars(args) | {"out": str(args.out) if args.out else None},
               "trace": {k: getattr(trace, k) for k in ("block_count", "expert_count", "expert_used_count",
                                                      "expert_nbytes", "positions")},
               "rows": rows}
    md = markdown(receipt)
    if args.out:
        write_receipt(args.out, f"expert_parallel_{receipt['date']}", receipt, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
