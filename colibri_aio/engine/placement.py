"""Placement: where routed experts' bytes come from and how many stay in memory.

``--io``, ``--ram-budget``, ``--cache-per-layer``, ``--prefetch`` and ``--pin``
end up here as a :class:`Placement`; :func:`open_source` turns it into an
expert source. Placement changes speed, never tokens (design invariant 1).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colibri_aio.arch.kvcache import DEFAULT_KV_TYPE, check_kv_type
from colibri_aio.errors import UserError
from colibri_aio.gguf.model import Model, Progress
from colibri_aio.io.reader import BACKENDS, ExpertReader
from colibri_aio.engine.memory import MemoryLimits, memory_limits
from colibri_aio.engine.plan import Plan, make_plan
from colibri_aio.engine.speed import MachineSpeed, cached as cached_speed
from colibri_aio.policy.cache import ExpertCache, Key
from colibri_aio.policy.backpressure import BackpressureConfig, BackpressureController
from colibri_aio.policy.predictor import LookaheadPredictor
from colibri_aio.policy.scheduler import SchedulerPolicy
from colibri_aio.policy.usage import MIN_TOKENS, UsageHistory, model_fingerprint
from colibri_aio.engine.history import HistoryFile, read_history
from colibri_aio.engine.scheduler import CachedExpertSource
from colibri_aio.logs import get_logger

log = get_logger("colibri_aio.placement")

IO_CHOICES = BACKENDS
PREFETCH_CHOICES = ("auto", "on", "off")
# The hidden state that predicts the next layer's experts best on the trained
# model (evidence/routing_stats.md: recall@k 0.829 on held-out text, against
# 0.828 for moe_input and 0.770 for layer_input_next_norm; chance is 0.125):
# the post-attention residual normed with the next layer's ffn_norm.
DEFAULT_LOOKAHEAD = "residual_next_norm"


@dataclass(frozen=True, slots=True)
class Placement:
    """How to place a model's experts. Defaults: auto I/O, a budget from usable RAM, auto prefetch."""

    io: str = "auto"
    ram_budget: int | None = None
    cache_per_layer: int | None = None
    prefetch: str = "auto"
    pin: str = "off"
    # LFU-type scoring that still forgets (frequency halving every 4096 uses), per
    # layer: the best online policy in replays of the trained model, which never
    # collapses when a cache is smaller than one token's experts
    # (evidence/replay_colibri_tiny.md: +6.0/+6.6/+8.9 points over LRU at 2/4/8
    # slots per layer; global LRU hits 0% below k slots per layer).
    cache_policy: str = "lfru"
    cache_half_life: float = 4096.0
    context: int | None = None
    kv_type: str = DEFAULT_KV_TYPE  # storage of the KV cache: f16 (llama.cpp's default) or f32
    # Stream experts into the pool in the background (see warm_keys and the scheduler's rules): from when the
    # trunk is read, never during a prefill, behind every read the model waits for. On by default: its A/B
    # (evidence/first_token_20261207T*.md, see README) left the first token where it was and filled the
    # pool during the first decoded tokens instead of miss by miss.
    warm_start: bool = True
    # A prefill reads the next layer's likely experts while this one computes, and reads are handed to
    # io_uring's kernel workers (IOSQE_ASYNC): issued inline, a submit faults in the fresh pool pages it
    # reads into on the event loop, which on the 48-layer file held the loop 43 s of a 47 s prefill
    # (io_uring_submit in a profile), so nothing computed while the disk read. On by default: with the
    # pool in huge pages its A/B (on/off per round, same run, page cache dropped) gave 0.89 [0.75-1.08] of
    # the time to first token on the 8-layer cut and 0.73 [0.48-0.96] on the 48-layer file, and the first
    # 64 decoded tokens ran at 0.93 of the steady rate against 0.69 without it
    # (evidence/first_token_20261202T014924Z.md, ...T014508Z.md). Before huge pages the same A/B gave
    # 0.98 and 0.90 with ranges crossing 1 (...T010043Z.md, ...T012020Z.md).
    read_ahead: bool = True
    backpressure: BackpressureConfig | None = None  # thresholds of --prefetch auto (None: defaults)
    parallel: int = 1               # sequences decoded together, each with its own KV cache (--parallel)

    def __post_init__(self) -> None:
        """Refuse an unknown choice here, once, before any file is opened."""
        if self.io not in IO_CHOICES:
            raise UserError(f"unknown --io {self.io!r} (choose from {', '.join(IO_CHOICES)})")
        if self.prefetch not in PREFETCH_CHOICES:
            raise UserError(f"unknown --prefetch {self.prefetch!r} (choose from {', '.join(PREFETCH_CHOICES)})")
        if self.cache_per_layer is not None and self.cache_per_layer < 1:
            raise UserError(f"--cache-per-layer must be >= 1, got {self.cache_per_layer}")
        if self.parallel < 1:
            raise UserError(f"--parallel must be >= 1 sequence, got {self.parallel}")
        if self.context is not None and self.context < 1:
            raise UserError(f"--ctx must be >= 1 position, got {self.context}")
        check_kv_type(self.kv_type)

    @property
    def lookahead(self) -> str | None:
        """The hidden state the forward pass ranks the next layer's experts from; None: no prefetch hints.

        ``--prefetch off`` asks for no hints at all; ``on`` and ``auto`` hand
        them to the scheduler, whose backpressure controller decides (``auto``)
        whether to read them.
        """
        return None if self.prefetch == "off" else DEFAULT_LOOKAHEAD


# Share of the cache that --pin fills from the usage history; the rest stays LRU
# so the cache can still follow the workload of this run.
PIN_SHARE = 0.5


def cache_for(model: Model, placement: Placement, plan: Plan, pins: list[tuple[int, int]]) -> ExpertCache:
    """The expert cache: a quota per block with experts, from --cache-per-layer or from the planned slots."""
    a = model.args
    if placement.cache_per_layer is not None:
        # Fewer slots than expert_used_count still works (each expert is read, used and
        # evicted in turn); it is a knob for experiments and tests, not a good setting.
        per_layer = min(placement.cache_per_layer, a.expert_count)
    else:
        per_layer = (plan.slots - len(pins)) // a.moe_block_count
    return ExpertCache(per_layer * a.moe_block_count + len(pins), policy=placement.cache_policy, scope="layer",
                       n_layers=a.moe_block_count, pinned=pins, half_life=placement.cache_half_life)


def pin_history(model: Model, pin: str, past: UsageHistory | None) -> UsageHistory | None:
    """The history ``--pin`` chooses from: none (off), this model's cache file (auto), or a named FILE."""
    if pin == "off":
        return None
    if pin == "auto":
        if past is None:
            raise UserError("--pin auto pins from the usage history, which --no-history turns off")
        return past
    return read_history(Path(pin), model_fingerprint(model))


def plan_for(model: Model, placement: Placement, past: UsageHistory | None, limits: MemoryLimits | None = None,
             speed: MachineSpeed | None = None) -> tuple[Plan, UsageHistory | None]:
    """The plan for ``placement`` (its hit rate from the history pins come from, else ``past``), and that history;
    with this machine's memory limits unless ``limits`` are given, and its kernel speed as last measured unless
    ``speed`` is given. ``run``, ``plan`` and the API all go by it."""
    pin_from = pin_history(model, placement.pin, past)
    known = pin_from if pin_from is not None else past
    counts = known.nonzero() if known is not None and known.runs >= 1 else None
    plan = make_plan(model, limits or memory_limits(), budget=placement.ram_budget, context=placement.context,
                     kv_type=placement.kv_type, cache_per_layer=placement.cache_per_layer, usage_counts=counts,
                     pin_share=PIN_SHARE if pin_from is not None else 0.0,
                     history_tokens=known.tokens if counts is not None else None,
                     speed=speed if speed is not None else cached_speed(), parallel=placement.parallel)
    plan = plan.with_page_cache(backend_for(placement, plan)[0] == "mmap")
    return plan.with_warm_start(warm_start_text(placement, plan, past)), pin_from


def pins(model: Model, placement: Placement, plan: Plan, pin_from: UsageHistory | None) -> list[tuple[int, int]]:
    """Pinned experts from ``pin_from`` within the plan's pin budget (per-layer: a share of each layer's quota)."""
    if pin_from is None:
        return []
    if placement.cache_per_layer is not None:
        per_layer = int(min(placement.cache_per_layer, model.args.expert_count) * PIN_SHARE)
        return pin_from.hottest(per_layer * model.args.moe_block_count, per_layer=per_layer)
    return pin_from.hottest(plan.pinned_slots)


# Where every expert fits, ``--io auto`` keeps them in the page cache (a read-only mapping of the file, filled
# by kernel read-ahead) instead of a pool filled by O_DIRECT reads: a pool page is zeroed by the CPU the
# first time a read fills it (perf: clear_page_erms under the reads' get_user_pages took a third of both cores
# through one prompt), where a page-cache fill costs the CPU almost nothing: bringing in 4 GiB took 2.87
# [0.89-4.14] s of CPU by O_DIRECT into fresh memory against 0.07 [0.07-0.08] s by one advice and a populate,
# at rates whose ranges overlap (evidence/fill_20261207T064646Z.md, n = 5).
# A decode step also runs as one graph over the file's stacked expert tensors for every type, where the pool
# offers that only when O_DIRECT leaves every expert at one offset in its slot (not MXFP4's). Beside the pool,
# n = 5, 8-layer Q8_0 cut: first 64 tokens' rate x1.16 [1.02-1.33], steady x1.04, time to first token x1.18
# [0.88-1.25] (later: both holds are disk-bound, and the page cache's prompt reads are no faster;
# evidence/first_token_20261207T052024Z.md). On by default for the first tokens' rate and the steady one
# graph; --io uring keeps the pool.
def backend_for(placement: Placement, plan: Plan) -> tuple[str, str | None]:
    """The reader backend for ``placement`` and why, when ``auto`` chose it for a reason of its own."""
    if placement.io == "auto" and plan.all_experts_fit:
        return "mmap", ("auto: every expert fits, so the page cache holds them (a read-only mapping filled by "
                        "kernel read-ahead, no pool pages to fault in)")
    return placement.io, None


def warm_start_text(placement: Placement, plan: Plan, past: UsageHistory | None) -> str:
    """What :func:`warm_keys` will stream, and why, for the plan's reader."""
    if not placement.warm_start:
        return "off (--no-warm-start)"
    when = "from when the trunk is read, behind every read the model waits for, never during a prompt"
    if plan.page_cache:
        return (f"every expert ({plan.experts_total}: all fit) into the page cache, whole layers in file order "
                "from when the trunk is read, beside the reads the model waits for, never during a prompt")
    if plan.all_experts_fit:
        return f"every expert ({plan.experts_total}: all fit), {when}"
    if past is not None and past.enough:
        return (f"the experts the usage history ({past.tokens:.0f} positions) uses most, as many as each layer's "
                f"share of the {plan.slots} slots holds, {when}")
    why = "--no-history" if past is None else f"its {past.tokens:.0f} positions are fewer than {MIN_TOKENS}"
    return (f"off: the experts do not all fit and no usage history ranks them ({why}); "
            "a run's reads and prefetch fill the pool")


def warm_keys(model: Model, placement: Placement, cache: ExpertCache, past: UsageHistory | None) -> list[Key]:
    """What the warm start streams into the pool: every expert when the cache holds them all, else the
    experts a usage history long enough to stand for the workload uses most (as many as fit each layer's
    quota); nothing without one, or with ``warm_start`` off."""
    a = model.args
    if not placement.warm_start:
        return []
    quota = cache.layer_quota if cache.layer_quota is not None else cache.n_slots // a.moe_block_count
    everything = [(layer, e) for layer in range(a.block_count) if a.is_moe(layer) for e in range(a.expert_count)]
    if quota >= a.expert_count:
        return everything
    if past is None or not past.enough:
        return []
    return past.hottest(quota * a.moe_block_count, per_layer=quota)


async def open_source(model: Model, placement: Placement, progress: Progress | None = None,
                      history: HistoryFile | None = None, fill_after: asyncio.Future[Any] | None = None,
                      expert_paths: Sequence[Path] | None = None) -> tuple[CachedExpertSource, Plan]:
    """Open the reader, size the cache from the plan, fill pinned experts, start the warm start.

    ``history``: this model's usage history file (None: off). The source
    records this run's selections into its ``usage``; saving them is the
    caller's business. ``fill_after``: the warm start waits for this to end
    well (the engine passes its trunk read: the first token needs the whole
    trunk, and warm reads sharing the disk with it made the trunk read 2-3x
    slower on the 8-layer cut; with this, evidence/first_token_20261207T014458Z.md);
    None: at once. ``expert_paths``: where the experts are read instead of the model's files (a repacked
    experts file for each, at the same offsets: :mod:`colibri_aio.engine.repacked_file`).
    """
    past = history.load() if history is not None else None
    plan, pin_from = plan_for(model, placement, past)
    pinned = pins(model, placement, plan, pin_from)
    cache = cache_for(model, placement, plan, pinned)
    plan = plan.with_cache(cache.n_slots, len(pinned))
    if progress is not None:
        progress("allocate pool", 0, 1)
    backend, why = backend_for(placement, plan)
    reader = await ExpertReader.open(expert_paths or model.paths, model.expert_nbytes_max, cache.n_slots,
                                     backend=backend, punt=placement.read_ahead, why=why)
    if progress is not None:
        progress("allocate pool", 1, 1)
    a = model.args
    # A page-cache warm start reads whole layers, two at a time, beside demand reads; it waits out prompts
    # (the policy's rules).
    mapped = reader.pool is None
    layers_nbytes = 2 * model.expert_nbytes_max * a.expert_count
    warm = {"warm_gives_way": False, "warm_run": a.expert_count, "warm_inflight_bytes": layers_nbytes} if mapped else {}
    policy = SchedulerPolicy(
        cache, BackpressureController(placement.backpressure, mode=placement.prefetch,  # type: ignore[arg-type]
                                      start=time.perf_counter()),
        LookaheadPredictor(a.expert_used_count, a.expert_count),
        expert_nbytes=lambda key: model.expert(*key).nbytes, prefetch_count=a.expert_used_count,
        usage=past.empty() if past is not None else None, read_ahead=placement.read_ahead, **warm)
    source = CachedExpertSource(reader, policy, model.expert)
    try:
        await source.fill_pinned(progress)
    except BaseException:
        await source.aclose()
        raise
    warm = warm_keys(model, placement, cache, past)
    if fill_after is None:
        source.start_warm(warm)
    elif warm:
        def start(done: asyncio.Future[Any]) -> None:
            if not done.cancelled() and done.exception() is None:
                source.start_warm(warm)
        fill_after.add_done_callback(start)
    log.info("placement", io=reader.backend, io_reason=reader.backend_reason, slots=cache.n_slots,
             scope=cache.scope, policy=cache.policy, prefetch=placement.prefetch, pinned=len(pinned),
             warm_start=len(warm))
    return source, plan
