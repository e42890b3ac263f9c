"""Replay a route trace through the expert cache: hit rate and bytes read, no model needed.

This is the pure simulation: it takes records, not files (reading trace files
and the ``replay`` command are :mod:`colibri_aio.cli.replay`'s). A trace (see
:mod:`colibri_aio.cli.route_trace`) records, in execution order, which
experts every layer chose at every position. The replay turns it into
*steps* — one per (run, layer, prefill chunk or decode position) — and runs
each step through an :class:`~colibri_aio.policy.cache.ExpertCache` as the
engine would: look up every unique expert of the step (batch-union: a
prefill chunk reads each expert once per layer), then reserve a slot for each
miss. A miss is one demand read of ``expert_nbytes`` (the trace header).

Simplifications, each in the cache's favour or neutral: reads complete
instantly, compute never holds a slot across steps (so every entry is
evictable between steps), and a prefetch always lands before its layer runs.
Hit rates are therefore upper bounds for a given policy; relative order
between policies is what the replay is for.

Scoring: the first ``warmup`` share of the positions warms every policy's
cache but is not scored, so every policy is compared on the same tail.
``pinned+lru`` learns its pins from usage counts of that warm-up part, or
from separate traces (``pin_from``) — never from the part being scored,
which would let it see the future. ``belady`` evicts the key whose next use
is furthest away: the offline optimum, an upper bound no online policy
reaches.

Lookahead prefetch replays a predictor's rankings (the trace's ``predicted``
lists): after each step of layer L, the predicted experts of L+1 that are not
cached are read into the cache as prefetches. Its recall and precision are
scored per position; wasted bytes are prefetched entries evicted before any
demand use.
"""
from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from colibri_aio.errors import UserError
from colibri_aio.policy.cache import CacheStats, ExpertCache, Key
from colibri_aio.policy.predictor import LookaheadPredictor
from colibri_aio.policy.usage import UsageHistory

REPLAY_POLICIES = ("lru", "lfu", "lfru", "pinned+lru", "belady")


@dataclass(frozen=True, slots=True)
class Step:
    """One layer's routing for one batch of positions of one run."""

    run: int
    layer: int
    positions: tuple[int, ...]
    routes: tuple[tuple[int, ...], ...]                 # experts per position
    predicted: dict[str, tuple[tuple[int, ...], ...]]   # predictor -> ranking per position (for layer + 1)

    @property
    def experts(self) -> list[int]:
        """Unique experts of the step in first-use order (what batch-union reads)."""
        return list(dict.fromkeys(e for route in self.routes for e in route))


@dataclass(frozen=True, slots=True)
class Trace:
    block_count: int
    expert_count: int
    expert_used_count: int
    expert_nbytes: int
    predictors: tuple[str, ...]
    steps: list[Step]
    leading_dense_block_count: int = 0  # blocks without experts: their steps route nothing

    @property
    def moe_block_count(self) -> int:
        """Blocks with experts: the per-layer cache keeps a quota for each."""
        return self.block_count - self.leading_dense_block_count

    @property
    def positions(self) -> int:
        return sum(len(s.positions) for s in self.steps if s.layer == 0)


def steps_from_records(records: Iterable[dict[str, Any]], run_offset: int = 0,
                       split_prefill: bool = False) -> list[Step]:
    """Group consecutive route records of the same (run, phase, layer) into steps.

    With ``split_prefill``, prefill positions become one step per (position,
    layer) in position order, as teacher-forced decode of the same tokens
    would read them: a position's routing does not depend on how the prompt
    was chunked, so a trace of a long prompt doubles as a decode workload.
    """
    steps: list[Step] = []
    group: list[dict[str, Any]] = []
    prefill: list[dict[str, Any]] = []

    def flush_prefill() -> None:
        for r in sorted(prefill, key=lambda r: (r["pos"], r["layer"])):
            group.append(r)
            flush()
        prefill.clear()

    def flush() -> None:
        if group:
            names = group[0].get("predicted", {}).keys()
            steps.append(Step(
                run=group[0]["run"] + run_offset, layer=group[0]["layer"],
                positions=tuple(r["pos"] for r in group),
                routes=tuple(tuple(r["experts"]) for r in group),
                predicted={n: tuple(tuple(r["predicted"][n]) for r in group) for n in names}))
            group.clear()

    for rec in records:
        if rec.get("kind") != "route":
            continue
        if split_prefill:
            if prefill and (rec["phase"] != "prefill" or rec["run"] != prefill[0]["run"]):
                flush_prefill()
            if rec["phase"] == "prefill":
                prefill.append(rec)
                continue
        if group and any(rec[k] != group[0][k] for k in ("run", "phase", "layer")):
            flush()
        # A decode position is its own step; prefill positions of one layer form a batch.
        group.append(rec)
        if rec["phase"] == "decode":
            flush()
    flush_prefill()
    flush()
    return steps


# --- configuration and result ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    policy: str = "lru"               # one of REPLAY_POLICIES
    cache_per_layer: int = 2          # slots = cache_per_layer x block_count
    scope: str = "layer"              # "layer" (quota per layer) or "global"
    warmup: float = 0.25              # share of positions that warms but is not scored
    pin_fraction: float = 0.5         # pinned+lru: share of the slots given to pins
    prefetch: str | None = None       # predictor name, or None for no prefetch
    prefetch_count: int | None = None  # ids per position; None: the predictor decides
    demote: bool = True               # demote prefetches their layer did not use
    half_life: float | None = None    # lfru: half-life in cache uses (default: the slot count)


@dataclass(slots=True)
class ReplayResult:
    config: ReplayConfig
    slots: int
    pinned: int
    positions_scored: int
    stats: CacheStats
    expert_nbytes: int
    prefetch: dict[str, float] = field(default_factory=dict)

    @property
    def demand_bytes(self) -> int:
        return self.stats.misses * self.expert_nbytes

    @property
    def prefetch_bytes(self) -> int:
        return self.stats.prefetch_reads * self.expert_nbytes

    @property
    def wasted_bytes(self) -> int:
        return self.stats.prefetch_wasted * self.expert_nbytes

    def as_dict(self) -> dict[str, Any]:
        c = self.config
        per_token = self.positions_scored or 1
        return {
            "policy": c.policy, "scope": c.scope, "cache_per_layer": c.cache_per_layer, "slots": self.slots,
            "pinned": self.pinned, "warmup": c.warmup, "prefetch": c.prefetch, "demote": c.demote,
            "half_life": c.half_life,
            "positions_scored": self.positions_scored, **self.stats.as_dict(),
            "demand_bytes": self.demand_bytes, "prefetch_bytes": self.prefetch_bytes,
            "wasted_bytes": self.wasted_bytes,
            "bytes_per_token": (self.demand_bytes + self.prefetch_bytes) / per_token,
            **({"lookahead": self.prefetch} if self.prefetch else {}),
        }


# --- the replay ---------------------------------------------------------------------------


def warmup_boundary(steps: Sequence[Step], warmup: float) -> int:
    """Index of the first scored step: the warm-up share is counted in positions of layer 0."""
    if not 0.0 <= warmup < 1.0:
        raise UserError(f"--warmup must be in [0, 1), got {warmup}")
    total = sum(len(s.positions) for s in steps if s.layer == 0)
    need, seen = warmup * total, 0
    for i, s in enumerate(steps):
        if s.layer == 0:
            if seen >= need:
                return i
            seen += len(s.positions)
    return len(steps)


def usage_of(steps: Iterable[Step], block_count: int, expert_count: int) -> UsageHistory:
    """Selection counts of the given steps (one run's worth of decay: none)."""
    usage = UsageHistory("replay", block_count, expert_count, decay=1.0)
    for s in steps:
        for route in s.routes:
            usage.record(s.layer, route)
    return usage


def choose_pins(usage: UsageHistory, cfg: ReplayConfig, moe_block_count: int) -> list[Key]:
    """The hottest keys within ``pin_fraction`` of the slots (per layer with a per-layer scope)."""
    per_layer = math.floor(cfg.pin_fraction * cfg.cache_per_layer)
    if cfg.scope == "layer":
        return usage.hottest(per_layer * moe_block_count, per_layer=per_layer)
    return usage.hottest(math.floor(cfg.pin_fraction * cfg.cache_per_layer * moe_block_count))


def next_use_oracle(steps: Sequence[Step], clock: list[int]):
    """``next_use(key)``: index of the key's next step after ``clock[0]`` (inf if none)."""
    uses: dict[Key, list[int]] = defaultdict(list)
    for i, s in enumerate(steps):
        for e in s.experts:
            uses[(s.layer, e)].append(i)

    def next_use(key: Key) -> float:
        lst = uses.get(key, ())
        j = bisect.bisect_right(lst, clock[0])
        return lst[j] if j < len(lst) else math.inf

    return next_use


def replay(trace: Trace, cfg: ReplayConfig, pin_from: Trace | None = None) -> ReplayResult:
    """Run the trace's steps through a cache configured by ``cfg``; score the steps after warm-up."""
    if cfg.policy not in REPLAY_POLICIES:
        raise UserError(f"unknown policy {cfg.policy!r}; choose from {', '.join(REPLAY_POLICIES)}")
    if cfg.cache_per_layer < 1:
        raise UserError("--cache-per-layer must be at least 1")
    if cfg.prefetch is not None and cfg.prefetch not in trace.predictors:
        raise UserError(f"unknown predictor {cfg.prefetch!r}; the trace has {', '.join(trace.predictors)}")
    steps, n_layers = trace.steps, trace.moe_block_count
    first_scored = warmup_boundary(steps, cfg.warmup)
    pins: list[Key] = []
    if cfg.policy == "pinned+lru":
        learn = pin_from.steps if pin_from is not None else steps[:first_scored]
        pins = choose_pins(usage_of(learn, trace.block_count, trace.expert_count), cfg, n_layers)
    clock = [0]
    policy = "lru" if cfg.policy == "pinned+lru" else cfg.policy
    cache = ExpertCache(
        cfg.cache_per_layer * n_layers, policy=policy, scope=cfg.scope,  # type: ignore[arg-type]
        n_layers=n_layers, pinned=pins, half_life=cfg.half_life,
        next_use=next_use_oracle(steps, clock) if policy == "belady" else None)
    for slot in cache.pinned.values():
        cache.mark_filled(slot)
    predictor = LookaheadPredictor(trace.expert_used_count, trace.expert_count) if cfg.prefetch else None
    scored_from = CacheStats()
    prefetched: list[Key] = []
    for i, step in enumerate(steps):
        clock[0] = i
        if i == first_scored:
            scored_from = replace(cache.stats)
            if predictor is not None:
                predictor.reset_counters()
        _demand(cache, step)
        if cfg.demote:
            for key in prefetched:
                cache.demote(key)
        prefetched = []
        if predictor is not None:
            _score_predictions(predictor, step)
            nxt = steps[i + 1] if i + 1 < len(steps) else None
            if nxt is not None and (nxt.run, nxt.layer) == (step.run, step.layer + 1):
                prefetched = _prefetch(cache, predictor, step, cfg)
    result = ReplayResult(cfg, cache.n_slots, len(pins),
                          sum(len(s.positions) for s in steps[first_scored:] if s.layer == 0),
                          _delta(cache.stats, scored_from), trace.expert_nbytes)
    if predictor is not None:
        sc = predictor.score
        result.prefetch = {"predictor": cfg.prefetch, "recall": sc.recall, "precision": sc.precision,
                           "recall_at_k": sc.recall_at_k, "predictions": sc.predictions}
    return result


def _demand(cache: ExpertCache, step: Step) -> None:
    """Look up every expert of the step first (hits are used now), then read the misses."""
    experts = step.experts
    missed = [e for e in experts if cache.lookup((step.layer, e)) is None]
    for e in missed:
        res = cache.reserve((step.layer, e))
        if res is None:  # cannot happen here: nothing holds a slot between steps
            raise RuntimeError("replay cache refused a reservation")
        cache.mark_filled(res.slot)


def _score_predictions(predictor: LookaheadPredictor, step: Step) -> None:
    for pos, route in zip(step.positions, step.routes):
        predictor.observed((step.run, pos, step.layer), route)


def _prefetch(cache: ExpertCache, predictor: LookaheadPredictor, step: Step, cfg: ReplayConfig) -> list[Key]:
    """Prefetch the union over positions of each position's chosen candidates for layer + 1; returns the keys read."""
    assert cfg.prefetch is not None
    target = step.layer + 1
    wanted: dict[int, None] = {}
    for pos, ranked in zip(step.positions, step.predicted.get(cfg.prefetch, ())):
        # The replay assumes reads are instant, i.e. an idle disk: the predictor may widen the set.
        chosen = predictor.predicted((step.run, pos, target), ranked, headroom=True, count=cfg.prefetch_count)
        wanted.update(dict.fromkeys(chosen))
    read = []
    for e in wanted:
        if (target, e) not in cache:
            res = cache.reserve((target, e), prefetch=True)
            if res is not None:
                cache.mark_filled(res.slot)
                read.append((target, e))
    return read


def _delta(after: CacheStats, before: CacheStats) -> CacheStats:
    return CacheStats(**{k: getattr(after, k) - getattr(before, k) for k in CacheStats.__dataclass_fields__})


# --- many configurations at once ---------------------------------------------------------------


def run_grid(trace: Trace, *, policies: Sequence[str], sizes: Sequence[int], scopes: Sequence[str],
             prefetch: Sequence[str | None], warmup: float, pin_fraction: float,
             prefetch_count: int | None = None, pin_from: Trace | None = None,
             half_life: float | None = None, demote: bool = True) -> list[ReplayResult]:
    """Replay every combination; sizes above the expert count are clipped to it (all cached)."""
    out = []
    for n in dict.fromkeys(min(s, trace.expert_count) for s in sizes):
        for scope in scopes:
            for pf in prefetch:
                for policy in policies:
                    cfg = ReplayConfig(policy=policy, cache_per_layer=n, scope=scope, warmup=warmup,
                                       pin_fraction=pin_fraction, prefetch=pf, prefetch_count=prefetch_count,
                                       demote=demote, half_life=half_life)
                    out.append(replay(trace, cfg, pin_from))
    return out
