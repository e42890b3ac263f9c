"""Expert parallelism on paper: what each host would send per token if a layer's experts were spread over hosts.

The model (one decode stream; the same for every layer): the *home* host
(host 0) runs the trunk and holds the hidden state after attention. For each
other host that holds at least one of the layer's routed experts it sends
that state once (``d`` activations) with the ids and weights of the experts
there (8 bytes each); that host runs them and sends back one ``d``-vector,
their weighted sum. Home's experts run at home. A layer therefore costs one
round trip when any routed expert is away, its remote hosts working in
parallel, and home's link carries every message of the layer:

    time(layer) = rtt + (bytes home sends + bytes home receives) / bandwidth

(no overlap of sending and receiving, no compression: an upper bound for
one stream). Sans-I/O: steps in, counts out; the tool
``tools/sim_expert_parallel.py`` reads route traces and prints the table.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from colibri_aio.policy.replay import Step

ID_WEIGHT_BYTES = 8  # an expert id (int32) and its weight (float32) in a request


def round_robin(block_count: int, expert_count: int, hosts: int) -> list[list[int]]:
    """Expert e of every layer on host e mod hosts (``[layer][expert] -> host``)."""
    return [[e % hosts for e in range(expert_count)] for _ in range(block_count)]


def balanced(counts: Sequence[Sequence[int]], hosts: int) -> list[list[int]]:
    """Per layer, experts placed on hosts so that each host gets about the same share of the routings:
    the most used first, each on the host with the least use so far (``counts[layer][expert]``: uses)."""
    placement = []
    for layer in counts:
        load = [0] * hosts
        where = [0] * len(layer)
        for e in sorted(range(len(layer)), key=lambda e: (-layer[e], e)):
            h = min(range(hosts), key=lambda h: (load[h], h))
            where[e], load[h] = h, load[h] + layer[e]
        placement.append(where)
    return placement


@dataclass(frozen=True)
class Link:
    """The network between home and the other hosts."""

    bandwidth_bytes_s: float
    rtt_s: float
    activation_bytes: int = 2  # bf16 / f16 hidden states


@dataclass
class Traffic:
    """What a trace's positions cost over the network, summed (divide by ``positions`` for per token)."""

    hosts: int
    positions: int = 0
    layers: int = 0                   # (position, layer) pairs
    round_trips: int = 0              # layers with at least one remote expert
    remote_messages: int = 0          # requests home sent (= replies it got)
    home_sent: int = 0                # bytes
    home_received: int = 0
    busiest_remote_sent: int = 0      # bytes sent by the remote host that sent most
    seconds: float = 0.0              # network time of all positions at the link's bandwidth and rtt
    remote_experts: int = 0           # routed experts computed away from home

    def per_token(self, value: float) -> float:
        return value / self.positions if self.positions else 0.0


def traffic(steps: Iterable[Step], placement: Sequence[Sequence[int]], hosts: int, hidden: int,
            link: Link) -> Traffic:
    """Bytes and time on the network for every position of ``steps`` (decode steps: one position each, or
    batches whose positions each count as a token), with ``placement[layer][expert]`` the host of an expert."""
    out = Traffic(hosts=hosts)
    remote_sent = [0] * hosts
    payload = hidden * link.activation_bytes
    for step in steps:
        where = placement[step.layer]
        for route in step.routes:
            if step.layer == 0:
                out.positions += 1
            out.layers += 1
            per_host: dict[int, int] = {}
            for e in route:
                per_host[where[e]] = per_host.get(where[e], 0) + 1
            away = {h: n for h, n in per_host.items() if h != 0}
            if not away:
                continue
            sent = sum(payload + n * ID_WEIGHT_BYTES for n in away.values())
            received = len(away) * payload
            out.round_trips += 1
            out.remote_messages += len(away)
            out.remote_experts += sum(away.values())
            out.home_sent += sent
            out.home_received += received
            for h in away:
                remote_sent[h] += payload
            out.seconds += link.rtt_s + (sent + received) / link.bandwidth_bytes_s
    out.busiest_remote_sent = max(remote_sent[1:], default=0)
    return out


def expert_counts(steps: Iterable[Step], block_count: int, expert_count: int) -> list[list[int]]:
    """How often each (layer, expert) was routed to in ``steps``."""
    counts = [[0] * expert_count for _ in range(block_count)]
    for step in steps:
        for route in step.routes:
            for e in route:
                counts[step.layer][e] += 1
    return counts


def host_loads(counts: Sequence[Sequence[int]], placement: Sequence[Sequence[int]], hosts: int) -> list[int]:
    """Routed experts each host computes over the trace (``counts[layer][expert]``: uses): its share of the work."""
    load = [0] * hosts
    for layer, where in zip(counts, placement):
        for e, n in enumerate(layer):
            load[where[e]] += n
    return load
