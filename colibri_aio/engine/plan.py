"""Placement planning: what stays resident, how many expert slots the budget buys,
and whether the run will be bound by compute or by the disk.

Pure arithmetic over the model's sizes and a budget, so the same plan is
printed by ``plan``, used by ``run`` and checked in tests with fixed inputs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from colibri_aio.errors import UserError
from colibri_aio.gguf.model import Model
from colibri_aio.io.align import slot_nbytes_for
from colibri_aio.engine.memory import MemoryLimits
from colibri_aio.engine.speed import MachineSpeed, decode_weights
from colibri_aio.policy.budget import slots_for_budget
from colibri_aio.policy.usage import MIN_TOKENS
from colibri_aio.arch.kvcache import DEFAULT_CONTEXT, DEFAULT_KV_TYPE, default_context
from colibri_aio.arch.layers import PREFILL_CHUNK

GiB = 1 << 30
# Python, NumPy, BLAS and the tokenizer before any model memory (peak RSS of an
# engine on the shipped tiny model is ~150 MiB; this keeps a margin).
RUNTIME_OVERHEAD = 256 << 20
# Share of usable RAM a plan takes when the user gives no budget: the page
# cache and the rest of the system keep the remainder.
DEFAULT_BUDGET_SHARE = 0.85
# Assumed rates for the bottleneck estimate, from evidence/ receipts on this
# class of machine (2 vCPU, virtio disk): NumPy kernels and O_DIRECT reads.
ASSUMED_WEIGHTS_PER_S = 3.0e9
ASSUMED_DISK_BYTES_PER_S = 1.5e9


@dataclass(frozen=True, slots=True)
class Plan:
    """Where each part of the model lives, in bytes, and what that predicts."""

    budget: int
    budget_source: str
    context: int
    context_source: str        # "--ctx", "default", or why it is not what was asked
    trunk: int
    kv_cache: int              # bytes, from the function the KV cache's allocation uses
    kv_type: str               # "f16" or "f32"
    working: int               # activations, logits and runtime overhead
    expert_nbytes: int         # one expert's three ranges (the largest expert)
    slot_nbytes: int           # one pool slot: the expert's ranges aligned for O_DIRECT
    slots: int
    experts_total: int
    pinned_slots: int
    expected_hit_rate: float | None
    hit_rate_source: str
    bottleneck: str            # "compute" or "disk"
    compute_s_per_token: float
    disk_s_per_token: float
    speed_source: str = "assumed rates"  # where compute_s_per_token's rates come from
    notes: tuple[str, ...] = ()  # where the plan differs from what was asked, said aloud
    parallel: int = 1          # sequences held at once: kv_cache is this many caches of ``context`` positions
    warm_start: str = "off"    # what the warm start streams into the pool, and why (placement.warm_start_text)
    page_cache: bool = False   # the experts stay in the page cache (the mmap reader), not in a pool of slots

    @property
    def pool(self) -> int:
        return self.slots * self.slot_nbytes

    @property
    def experts_nbytes(self) -> int:
        """Every expert at the largest one's size: what holding them all takes at most (the page cache's share)."""
        return self.experts_total * self.expert_nbytes

    @property
    def all_experts_fit(self) -> bool:
        return self.slots >= self.experts_total

    def with_warm_start(self, text: str) -> "Plan":
        return replace(self, warm_start=text)

    def with_page_cache(self, page_cache: bool) -> "Plan":
        return replace(self, page_cache=page_cache)

    def experts_text(self) -> str:
        """Where the experts stay and what that takes: the pool's slots, or the page cache."""
        if self.page_cache:
            return (f"page cache {self.experts_total} experts x {gb(self.expert_nbytes)} = "
                    f"{gb(self.experts_nbytes)} (the file's own pages: no pool)")
        return (f"pool {self.slots} slots x {gb(self.slot_nbytes)} = {gb(self.pool)} ({self.pinned_slots} pinned; "
                f"{self.slots}/{self.experts_total} experts of {gb(self.expert_nbytes)})")

    def with_cache(self, slots: int, pinned_slots: int) -> "Plan":
        """The plan with the slot counts of the cache actually built (pins found may be fewer than planned)."""
        return replace(self, slots=slots, pinned_slots=pinned_slots)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "pool": self.pool, "all_experts_fit": self.all_experts_fit}

    def one_line(self) -> str:
        hit = "n/a" if self.expected_hit_rate is None else f"{self.expected_hit_rate:.0%}"
        return (f"plan: budget {gb(self.budget)} ({self.budget_source}) = trunk {gb(self.trunk)} + "
                f"KV {gb(self.kv_cache)} {self.kv_type} ({self.context} ctx, {self.context_source}"
                f"{f'; {self.parallel} slots' if self.parallel > 1 else ''}) + {self.experts_text()} + working "
                f"{gb(self.working)}; expected hit {hit}; bound by {self.bottleneck}")


def gb(n: int) -> str:
    """A byte count for people: GiB, MiB or KiB, whichever reads best."""
    if n >= GiB / 10:
        return f"{n / GiB:.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"


def kv_cache_nbytes(model: Model, context: int, kv_type: str = DEFAULT_KV_TYPE) -> int:
    """Bytes of the family's KV cache the forward pass allocates for ``context`` positions (MLA's latent
    cache is far smaller than full heads)."""
    return model.args.kv_cache_nbytes(context, kv_type)


def working_nbytes(model: Model, prefill_chunk: int = PREFILL_CHUNK, parallel: int = 1) -> int:
    """Activations of one prefill chunk (a few (T, D) buffers, attention scores) and a row of logits for each
    of ``parallel`` sequences (a batched decode step's buffers hold one row each)."""
    a = model.args
    acts = prefill_chunk * a.embedding_length * 4 * 16
    scores = a.head_count * prefill_chunk * min(a.context_length, 4096) * 4 * 2
    return RUNTIME_OVERHEAD + acts + scores + a.vocab_size * 4 * 2 * parallel


def make_plan(model: Model, limits: MemoryLimits, *, budget: int | None = None, context: int | None = None,
              kv_type: str = DEFAULT_KV_TYPE, cache_per_layer: int | None = None,
              usage_counts: dict[tuple[int, int], float] | None = None, pin_share: float = 0.0,
              history_tokens: float | None = None, speed: MachineSpeed | None = None, parallel: int = 1) -> Plan:
    """The placement for ``model`` within ``budget`` (default: a share of usable RAM).

    Refuses, with a :class:`UserError` that says what is missing, a budget
    above what the machine can give (RAM or the cgroup limit), a context
    below one position, and a budget that cannot hold the trunk, the KV
    cache for ``context`` and the cache: ``cache_per_layer`` slots per layer
    when given, else at least one slot per layer (the cache keeps a quota
    per layer; with one slot a layer's experts are read, used and evicted in
    turn). Whatever differs from what was asked (a context above the
    model's, a budget above the memory available now) is in ``notes``.
    ``usage_counts`` (with the ``history_tokens`` positions behind them)
    size the pins and, from a history long enough to stand for the
    workload, the expected hit rate. ``speed``: this machine's measured
    kernel rates and per-layer overhead (None: assumed rates, no overhead). ``parallel``: sequences held at
    once, each with a KV cache of ``context`` positions (all of them reserved).
    """
    a = model.args
    if parallel < 1:
        raise UserError(f"--parallel must be >= 1 sequence, got {parallel}")
    layers = a.moe_block_count  # blocks with experts: the cache keeps a quota for each
    notes: list[str] = []
    context, context_source = _context(a.context_length, context, notes)
    source = "--ram-budget"
    if budget is None:
        budget = int(limits.usable * DEFAULT_BUDGET_SHARE)
        source = f"{DEFAULT_BUDGET_SHARE:.0%} of usable RAM" + (" (cgroup limit)" if limits.cgroup_limit else "")
    else:
        _check_budget(budget, limits, notes)
    slot = slot_nbytes_for(model.expert_nbytes_max)
    kv, working = parallel * kv_cache_nbytes(model, context, kv_type), working_nbytes(model, parallel=parallel)
    reserved = model.trunk_nbytes + kv + working
    total = layers * a.expert_count
    if cache_per_layer is not None:
        slots, pinned = _slots_per_layer(layers, a.expert_count, cache_per_layer,
                                         pin_share if usage_counts else 0.0)
        minimal, what = slots, f"{cache_per_layer} expert slots per layer as --cache-per-layer asks"
    else:
        slots = min(total, slots_for_budget(budget, slot, reserved))
        pinned = min(int(slots * pin_share), slots - layers) if usage_counts else 0
        pinned = max(0, pinned)
        # The cache gives every layer the same quota besides the pins: what does not divide is not allocated.
        slots = pinned + (slots - pinned) // layers * layers
        minimal, what = layers, f"a minimal cache of {layers} expert slots, one per layer with experts"
    if reserved + minimal * slot > budget or slots < minimal:
        raise UserError(
            f"budget {gb(budget)} is too small: trunk {gb(model.trunk_nbytes)} + {kv_type} KV cache {gb(kv)} for "
            f"{context} positions{f' x {parallel} sequences (--parallel)' if parallel > 1 else ''} + working {gb(working)} + {what} ({gb(minimal * slot)}), need "
            f"{gb(reserved + minimal * slot)}")
    hit, hit_source = expected_hit_rate(usage_counts, slots, total, history_tokens)
    compute_s, disk_s, speed_source = token_times(model, 0.0 if hit is None else hit, speed)
    return Plan(budget, source, context, context_source, model.trunk_nbytes, kv, kv_type, working,
                model.expert_nbytes_max,
                slot, slots, total, pinned, hit, hit_source, "disk" if disk_s > compute_s else "compute",
                compute_s, disk_s, speed_source, tuple(notes), parallel)


def _context(model_context: int, asked: int | None, notes: list[str]) -> tuple[int, str]:
    """KV-cache positions for ``asked`` (None: the default) and where the figure comes from."""
    if asked is None:
        if model_context > DEFAULT_CONTEXT:
            return default_context(model_context), f"default; the model allows {model_context}"
        return model_context, "the model's context_length"
    if asked < 1:
        raise UserError(f"--ctx must be >= 1 position, got {asked}")
    if asked > model_context:
        notes.append(f"--ctx {asked} is more than the model's context_length {model_context}: using {model_context}")
        return model_context, f"the model's context_length; {asked} asked"
    return asked, "--ctx"


def _check_budget(budget: int, limits: MemoryLimits, notes: list[str]) -> None:
    """Refuse a budget above RAM or the cgroup limit; note one above what is available now."""
    if limits.cgroup_limit is not None and budget > limits.cgroup_limit:
        raise UserError(f"--ram-budget {gb(budget)} is more than the cgroup memory limit {gb(limits.cgroup_limit)} "
                        f"({limits.cgroup_source})")
    if limits.total and budget > limits.total:
        raise UserError(f"--ram-budget {gb(budget)} is more than this machine's RAM {gb(limits.total)}")
    if limits.available and budget > limits.available:
        notes.append(f"--ram-budget {gb(budget)} is more than the {gb(limits.available)} available now: "
                     f"other programs and the page cache will be squeezed")


def _slots_per_layer(block_count: int, expert_count: int, cache_per_layer: int,
                     pin_share: float) -> tuple[int, int]:
    """(slots, pinned) of a cache of ``cache_per_layer`` slots per layer; pins come on top of each quota."""
    if cache_per_layer < 1:
        raise UserError(f"--cache-per-layer must be >= 1, got {cache_per_layer}")
    per_layer = min(cache_per_layer, expert_count)
    pinned = int(per_layer * pin_share) * block_count
    return per_layer * block_count + pinned, pinned


def expected_hit_rate(usage_counts: dict[tuple[int, int], float] | None, slots: int, total: int,
                      tokens: float | None = None) -> tuple[float | None, str]:
    """The share of past selections the ``slots`` most used experts would have served.

    This is the steady state of a frequency-ordered cache on the recorded
    workload: an estimate, not a promise (LRU on a shifting workload does
    worse). None, with the reason, without a history of at least
    :data:`~colibri_aio.policy.usage.MIN_TOKENS` positions (``tokens``):
    a short one has seen few experts, and they would all seem to fit.
    """
    if slots >= total:
        return 1.0, "every expert fits"
    if not usage_counts:
        return None, "no usage history"
    if tokens is None or tokens < MIN_TOKENS:
        return None, (f"the usage history has seen {tokens or 0:.0f} positions, too few to stand for the "
                      f"workload ({MIN_TOKENS} needed)")
    counts = sorted(usage_counts.values(), reverse=True)
    return sum(counts[:slots]) / sum(counts), "usage history"


def token_times(model: Model, hit_rate: float, speed: MachineSpeed | None = None) -> tuple[float, float, str]:
    """Seconds per decoded token for compute and for expert reads, and where the compute rates come from.

    Compute: the weights a token multiplies, by type, at ``speed``'s measured
    rates plus its per-layer overhead; without a measurement (or for a type it
    lacks), the active weights of the shared shape at
    :data:`ASSUMED_WEIGHTS_PER_S` and no overhead.
    """
    a = model.args
    routed = a.moe_block_count * a.expert_used_count
    miss_bytes = (1 - hit_rate) * routed * model.expert_nbytes_max
    disk_s = miss_bytes / ASSUMED_DISK_BYTES_PER_S
    weights = None if speed is None else decode_weights(model)
    if speed is None or weights is None or any(speed.rate(t) is None for t in weights):
        # Every resident matrix of the blocks (attention, dense FFNs, shared experts: whatever the
        # family has), k routed experts per MoE block and the output head.
        expert_weights = 3 * a.expert_feed_forward_length * a.embedding_length
        active = model.block_matrix_weights + routed * expert_weights + a.vocab_size * a.embedding_length
        return active / ASSUMED_WEIGHTS_PER_S, disk_s, \
            f"assumed {ASSUMED_WEIGHTS_PER_S / 1e9:.0f} G weights/s, no per-layer overhead"
    compute_s = sum(n / speed.rate(t) for t, n in weights.items()) + a.block_count * speed.layer_overhead_s
    return compute_s, disk_s, (f"{speed.backend} kernels measured on this machine + "
                               f"{speed.layer_overhead_s * 1e3:.2f} ms a layer")
