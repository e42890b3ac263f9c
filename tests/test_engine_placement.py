"""Placement changes speed, never tokens (design invariant 1), and the scheduler keeps its books.

Every combination of I/O backend, cache size and prefetch setting must give
logits bit-identical to the plain mmap forward pass.
"""
from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from colibri_aio.engine.engine import Engine
from colibri_aio.errors import ExpertReadError, UserError
from colibri_aio.gguf.model import load
from colibri_aio.io.reader import ReaderClosedError
from colibri_aio.policy.backpressure import BackpressureConfig
from colibri_aio.arch.qwen3moe import Qwen3MoE
from colibri_aio.engine.placement import DEFAULT_LOOKAHEAD, Placement, open_source

from support import engine_logits, fixture, oracle_ids, reference_logits

FIXTURES = ["tiny_f32", "tiny_q8_0", "tiny_q4_k", "colibri-tiny-q8_0", "quant_types/tiny_mxfp4",
            "quant_types/ktiny_q2_k", "qwen2moe_q8_0", "olmoe_q8_0", "mixtral_q8_0",
            "deepseek2_q8_0", "glm4moe_q8_0", "gptoss_mxfp4"]  # and one of every other family


@pytest.mark.parametrize("kernels", ["numpy", "ggml"])
@pytest.mark.parametrize("name", FIXTURES)
async def test_logits_are_bit_identical_across_placements(name: str, kernels: str) -> None:
    """Every kernel backend: placement (and with it how experts are batched) never changes a bit."""
    a = load(fixture(f"{name}.gguf")).args
    ids = [t % a.vocab_size for t in oracle_ids()[2]]
    want = await reference_logits(fixture(f"{name}.gguf"), ids, kernels=kernels)
    k, e = a.expert_used_count, a.expert_count
    # Every backend with the smallest and the full cache; every prefetch mode; one size in between.
    combos = [(io, per_layer, "on") for io, per_layer in itertools.product(("uring", "pread", "mmap"), (1, k, e))]
    combos += [("uring", k, "off"), ("uring", 1, "auto"), ("pread", k + 1, "auto")]
    for io, per_layer, prefetch in combos:
        got, _ = await engine_logits(fixture(f"{name}.gguf"), ids, kernels=kernels, io=io, cache_per_layer=per_layer,
                                     prefetch=prefetch)
        assert np.array_equal(got, want), (io, per_layer, prefetch)
    for per_layer in (1, e):
        got, _ = await engine_logits(fixture(f"{name}.gguf"), ids, kernels=kernels, io="uring",
                                     cache_per_layer=per_layer, warm_start=True)
        assert np.array_equal(got, want), ("warm start", per_layer)
    for per_layer in (1, e):  # the prefill's read-ahead (on by default in every run above) off
        got, _ = await engine_logits(fixture(f"{name}.gguf"), ids, kernels=kernels, io="uring",
                                     cache_per_layer=per_layer, read_ahead=False)
        assert np.array_equal(got, want), ("no read-ahead", per_layer)
    got, _ = await engine_logits(fixture(f"{name}.gguf"), ids, kernels=kernels, ram_budget="600M")  # plan-sized cache
    assert np.array_equal(got, want)


async def test_cache_that_holds_everything_reads_each_expert_once() -> None:
    ids = oracle_ids()[0]
    model = load(fixture("tiny_q8_0.gguf"))
    got, engine = await engine_logits(fixture("tiny_q8_0.gguf"), ids + ids, io="pread",
                                      cache_per_layer=model.args.expert_count, prefetch="off", warm_start=True)
    stats = engine.source.policy.cache.stats
    reads = engine.source.reader.stats.reads
    assert stats.misses + stats.warm_reads == reads <= model.args.block_count * model.args.expert_count
    assert stats.hit_rate > 0.5 and stats.prefetch_reads == 0
    got, engine = await engine_logits(fixture("tiny_q8_0.gguf"), ids + ids, io="pread",
                                      cache_per_layer=model.args.expert_count, prefetch="off", warm_start=False)
    stats = engine.source.policy.cache.stats
    assert stats.warm_reads == 0 and stats.misses == engine.source.reader.stats.reads


async def test_a_prefill_reads_ahead_what_the_next_layer_routes_and_decode_does_not() -> None:
    ids = oracle_ids()[0]
    model = load(fixture("tiny_q8_0.gguf"))
    every = model.args.expert_count
    # Without the warm start, which would read every expert of this small model before the prompt needs it.
    _, engine = await engine_logits(fixture("tiny_q8_0.gguf"), ids, split=len(ids) - 1, io="uring",
                                    cache_per_layer=every, prefetch="auto",
                                    read_ahead=True, warm_start=False)
    s, c = engine.source.policy.stats, engine.source.policy.cache.stats
    assert s.ahead_reads > 2 * model.args.expert_used_count and c.prefetch_hits > 0
    _, engine = await engine_logits(fixture("tiny_q8_0.gguf"), ids, split=1, io="uring", cache_per_layer=every,
                                    prefetch="on", read_ahead=True, warm_start=False)
    s = engine.source.policy.stats
    assert s.ahead_reads == 0 and s.prefetch_reads > 0   # one position at a time: decode's top-k guesses
    _, engine = await engine_logits(fixture("tiny_q8_0.gguf"), ids, split=len(ids) - 1, io="uring",
                                    cache_per_layer=every, prefetch="off", read_ahead=True, warm_start=False)
    assert engine.source.policy.stats.prefetch_reads == 0   # --prefetch off: no guesses at all
    _, engine = await engine_logits(fixture("tiny_q8_0.gguf"), ids, split=len(ids) - 1, io="uring",
                                    cache_per_layer=every, prefetch="auto", read_ahead=False, warm_start=False)
    assert engine.source.policy.stats.ahead_reads == 0       # --no-read-ahead
    _, engine = await engine_logits(fixture("tiny_q8_0.gguf"), ids, split=len(ids) - 1, io="uring",
                                    cache_per_layer=every, prefetch="auto", warm_start=False)
    assert engine.source.policy.stats.ahead_reads > 0        # on by default


async def test_small_cache_evicts_and_prefetch_is_counted() -> None:
    ids = oracle_ids()[1]
    _, engine = await engine_logits(fixture("tiny_f32.gguf"), ids, io="pread", cache_per_layer=2, prefetch="on")
    s, c = engine.source.policy.stats, engine.source.policy.cache.stats
    assert c.evictions > 0
    assert s.prefetch_reads == c.prefetch_reads > 0
    assert c.prefetch_hits + c.prefetch_wasted <= c.prefetch_reads


async def test_decode_steps_reach_the_backpressure_trial_and_never_change_logits() -> None:
    # busy_high=0: every window counts as saturated, so auto runs trials from the first decode step.
    ids = oracle_ids()[1]
    want = await reference_logits(fixture("tiny_f32.gguf"), ids)
    model = load(fixture("tiny_f32.gguf"))
    config = BackpressureConfig(window=0.001, busy_high=0.0, trial_steps=1, hold_steps=1)
    source, _ = await open_source(model, Placement(io="pread", cache_per_layer=2, prefetch="auto",
                                                   backpressure=config))
    try:
        net = Qwen3MoE(model, source)
        net.lookahead = DEFAULT_LOOKAHEAD
        prefill = await net.forward(ids[:12], logits="all")
        decode = [await net.forward([t]) for t in ids[12:]]
    finally:
        await source.aclose()
    assert np.array_equal(np.concatenate([prefill, np.stack(decode)]), want)
    c = source.policy.backpressure.counters
    assert c.decode_steps == len(ids) - 12 - 1     # the first follows the prefill, the last never ends
    assert c.trials >= 2 and c.trial_verdict_on + c.trial_verdict_off >= 1


async def test_cancelled_generation_drains_reads_and_closes() -> None:
    engine = await Engine.open(fixture("tiny_q8_0.gguf"), io="uring", cache_per_layer=2)

    async def consume() -> None:
        async for _ in engine.generate("The list type", max_tokens=200):
            await asyncio.sleep(0)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await engine.aclose()
    assert engine.source.reader.in_flight == 0
    with pytest.raises(ReaderClosedError):
        engine.source.reader.start(engine.model.expert(0, 0), 0)


async def test_read_error_names_the_expert(monkeypatch) -> None:
    engine = await Engine.open(fixture("tiny_q8_0.gguf"), io="pread", cache_per_layer=2, prefetch="off")
    reader = engine.source.reader
    real = reader.start_many

    def failing(items, urgent=False, background=False):
        futures = real(items, urgent, background)
        for i, ((loc, _), future) in enumerate(zip(items, futures)):
            if (loc.layer, loc.expert) == (1, 3):
                error = ExpertReadError(reader.file.path, loc.gate.offset, loc.nbytes, loc.layer, loc.expert,
                                        "injected")
                broken = asyncio.get_running_loop().create_future()
                future.add_done_callback(lambda _, b=broken, e=error: b.set_exception(e))  # once the kernel is done
                futures[i] = broken
        return futures

    monkeypatch.setattr(reader, "start_many", failing)
    try:
        with pytest.raises(ExpertReadError, match="layer 1 expert 3"):
            for ids in oracle_ids():
                engine.net.reset()
                await engine.net.forward(ids, logits="all")
    finally:
        await engine.aclose()


async def test_budget_too_small_is_refused() -> None:
    with pytest.raises(UserError, match="too small"):
        await Engine.open(fixture("tiny_q8_0.gguf"), ram_budget="1M")


@pytest.mark.parametrize("name", ["tiny_q8_0", "deepseek2_q8_0"])  # deepseek2: a dense block pins nothing
async def test_pinning_from_usage_history_keeps_logits_and_hits(name: str) -> None:
    a = load(fixture(f"{name}.gguf")).args
    ids = [t % a.vocab_size for t in oracle_ids()[0]]
    want = await reference_logits(fixture(f"{name}.gguf"), ids)
    k = a.expert_used_count
    await engine_logits(fixture(f"{name}.gguf"), ids, io="pread", cache_per_layer=k + 2)  # records the usage history
    got, engine = await engine_logits(fixture(f"{name}.gguf"), ids, io="pread", cache_per_layer=k + 2, pin="auto")
    assert np.array_equal(got, want)
    assert engine.source.policy.cache.pinned and engine.source.policy.cache.stats.pinned_hits > 0
    assert all(a.is_moe(layer) for layer, _ in engine.source.policy.cache.pinned)


async def test_usage_history_of_another_model_is_never_used(tmp_path) -> None:
    """At the default place it is set aside (a cache); named with --pin FILE it is refused."""
    from colibri_aio.engine.history import default_usage_path
    from colibri_aio.policy.usage import model_fingerprint

    await engine_logits(fixture("tiny_q8_0.gguf"), oracle_ids()[0][:13], io="pread")
    theirs = default_usage_path(model_fingerprint(load(fixture("tiny_q8_0.gguf"))))
    ours = default_usage_path(model_fingerprint(load(fixture("tiny_f32.gguf"))))
    ours.write_bytes(theirs.read_bytes())
    engine = await Engine.open(fixture("tiny_f32.gguf"), pin="auto")
    await engine.aclose()
    assert not engine.source.policy.cache.pinned and ours.with_name(ours.name + ".bad").exists()
    with pytest.raises(UserError, match="another model"):
        await Engine.open(fixture("tiny_f32.gguf"), pin=str(theirs))


def test_warm_start_streams_all_experts_that_fit_else_a_long_historys_hot_set() -> None:
    from types import SimpleNamespace

    from colibri_aio.engine.placement import warm_keys
    from colibri_aio.policy.cache import ExpertCache
    from colibri_aio.policy.usage import MIN_TOKENS, UsageHistory

    layers, experts = 2, 8
    model = SimpleNamespace(args=SimpleNamespace(block_count=layers, expert_count=experts, moe_block_count=layers,
                                                 is_moe=lambda layer: True))
    full = ExpertCache(layers * experts, policy="lru", scope="layer", n_layers=layers)
    small = ExpertCache(layers * 3, policy="lru", scope="layer", n_layers=layers)
    past = UsageHistory("f", layers, experts)
    for _ in range(4):
        past.record(0, [5, 6])
        past.record(1, [1, 2, 3, 4])
    on, off = Placement(), Placement(warm_start=False)                # on by default
    assert warm_keys(model, on, full, None) == [(l, e) for l in range(layers) for e in range(experts)]
    assert warm_keys(model, off, full, None) == []
    assert warm_keys(model, on, small, past) == []                 # a short history names no hot set
    past.count_tokens(MIN_TOKENS)
    hot = warm_keys(model, on, small, past)
    assert sorted(hot) == [(0, 5), (0, 6), (1, 1), (1, 2), (1, 3)]  # each layer's quota of 3, most used first


def test_the_plan_says_what_the_warm_start_streams_and_why() -> None:
    from types import SimpleNamespace

    from colibri_aio.engine.placement import warm_start_text
    from colibri_aio.policy.usage import MIN_TOKENS, UsageHistory

    fits, short = SimpleNamespace(all_experts_fit=True, experts_total=16, slots=16, page_cache=False), \
        SimpleNamespace(all_experts_fit=False, experts_total=16, slots=6, page_cache=False)
    mapped = SimpleNamespace(all_experts_fit=True, experts_total=16, slots=16, page_cache=True)
    assert warm_start_text(Placement(), mapped, None).startswith("every expert (16: all fit) into the page cache")
    past = UsageHistory("f", 2, 8)
    assert warm_start_text(Placement(), fits, None).startswith("every expert (16: all fit)")
    assert warm_start_text(Placement(warm_start=False), fits, None) == "off (--no-warm-start)"
    assert "(--no-history)" in warm_start_text(Placement(), short, None)
    assert f"fewer than {MIN_TOKENS}" in warm_start_text(Placement(), short, past)
    past.count_tokens(MIN_TOKENS)
    assert warm_start_text(Placement(), short, past).startswith(f"the experts the usage history ({MIN_TOKENS} ")


async def test_the_warm_start_waits_for_what_it_is_told_to_follow() -> None:
    model = load(fixture("tiny_q8_0.gguf"))
    trunk: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    source, plan = await open_source(model, Placement(io="pread"), fill_after=trunk)
    try:
        assert plan.all_experts_fit and "every expert" in plan.warm_start
        await asyncio.sleep(0.05)
        assert source.policy.stats.warm_reads == 0 and source.policy.reads_in_flight == 0
        trunk.set_result(None)                                  # the trunk is read: the warm start begins
        await asyncio.sleep(0)                                  # (its callback runs on the next turn)
        for _ in range(500):
            if not source.policy.warm_pending and not source.policy.reads_in_flight:
                break
            await asyncio.sleep(0.01)
        a = model.args
        assert source.policy.stats.warm_reads == a.moe_block_count * a.expert_count
    finally:
        await source.aclose()


async def test_auto_keeps_experts_that_all_fit_in_the_page_cache_else_reads_into_a_pool() -> None:
    model = load(fixture("tiny_q8_0.gguf"))
    a = model.args
    source, plan = await open_source(model, Placement())
    try:
        assert plan.all_experts_fit and source.reader.backend == "mmap" and source.reader.pool is None
        assert source.reader.backend_reason.startswith("auto: every expert fits")
        assert not source.policy.warm_gives_way and source.policy.warm_run == a.expert_count
    finally:
        await source.aclose()
    source, _ = await open_source(model, Placement(cache_per_layer=a.expert_used_count))
    try:
        assert source.reader.backend != "mmap" and source.reader.pool is not None and source.policy.warm_gives_way
    finally:
        await source.aclose()
    source, _ = await open_source(model, Placement(io="uring"))     # asked for: kept
    try:
        assert source.reader.backend == "uring"
    finally:
        await source.aclose()


async def test_decode_steps_run_as_one_graph_over_the_mapped_expert_tensors_with_the_pools_bits() -> None:
    """With every expert in the page cache, a step's graph picks them from the file's stacked tensors (the
    stack index is the expert id); its logits are those of the pool's reads, step by step. A step while some
    expert is still unread (the warm start waits out the prompt) runs block by block, never as a one-graph try
    computed for nothing."""
    ids = oracle_ids()[0]

    async def steps(io: str) -> tuple[list[np.ndarray], int, int]:
        engine = await Engine.open(fixture("tiny_q8_0.gguf"), io=io, kernels="ggml", history=False)
        try:
            out = [await engine.prefill(ids[:2])]
            for t in ids[2:16]:
                out.append(await engine.net.forward([t]))
            return out, engine.net.one_graph_steps, engine.net.one_graph_misses
        finally:
            await engine.aclose()

    mapped, one_graph, wasted = await steps("auto")
    pooled, _, _ = await steps("pread")
    assert one_graph > 0 and wasted == 0
    assert all(np.array_equal(x, y) for x, y in zip(mapped, pooled))


async def test_while_the_page_cache_fills_a_step_runs_block_by_block_not_as_a_wasted_one_graph(monkeypatch) -> None:
    """Experts in the page cache with the warm start held back (a slow disk): decode steps that route to experts
    not read yet run block by block, each waiting for its own experts (a warm read it needs is promoted), never a
    one-graph step computed for nothing; once the fill is over, steps run as one graph. Same logits throughout."""
    import threading

    from colibri_aio.io.backends import MmapBackend

    ids = oracle_ids()[0]
    held, real = threading.Event(), MmapBackend._fault_in_batch

    def slow_warm(self, jobs, loop, advisor, *pacing):
        if not threading.current_thread().name.startswith("colibri-mmap-demand"):   # the warm start's workers
            held.wait(30)
        return real(self, jobs, loop, advisor, *pacing)

    monkeypatch.setattr(MmapBackend, "_fault_in_batch", slow_warm)
    engine = await Engine.open(fixture("tiny_q8_0.gguf"), io="auto", kernels="ggml", history=False)
    try:
        out = [await engine.prefill(ids[:1])]
        for t in ids[1:6]:
            out.append(await engine.net.forward([t]))
        assert engine.source.warming and engine.net.one_graph_misses == 0 and engine.net.one_graph_steps == 0
        held.set()
        await engine.source.reader.drained()
        for t in ids[6:10]:
            out.append(await engine.net.forward([t]))
        assert engine.net.one_graph_steps > 0 and engine.net.one_graph_misses == 0
    finally:
        held.set()
        await engine.aclose()
    reference = await Engine.open(fixture("tiny_q8_0.gguf"), io="pread", kernels="ggml", history=False)
    try:
        expected = [await reference.prefill(ids[:1])] + [await reference.net.forward([t]) for t in ids[1:10]]
    finally:
        await reference.aclose()
    assert all(np.array_equal(x, y) for x, y in zip(out, expected))
