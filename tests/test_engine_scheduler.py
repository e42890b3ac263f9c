"""The scheduler's driver against a fake reader whose reads end when the test says so.

The fake keeps the reader's one rule (a slot is the kernel's until its read is
over, even if its future was cancelled, and ``start`` refuses such a slot), so
every test also checks that the driver never reuses a slot too early.
"""
from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import dataclass, field

import pytest

from colibri_aio.engine.scheduler import CachedExpertSource
from colibri_aio.errors import ExpertReadError
from colibri_aio.policy.backpressure import BackpressureController
from colibri_aio.policy.cache import ExpertCache
from colibri_aio.policy.predictor import LookaheadPredictor
from colibri_aio.policy.scheduler import SchedulerPolicy

LAYERS, EXPERTS, K = 2, 16, 2


@dataclass
class FakeRead:
    key: tuple[int, int]
    slot: int
    future: asyncio.Future
    urgent: bool = False
    background: bool = False


@dataclass
class FakeReader:
    """Starts nothing by itself: :meth:`land` or :meth:`fail` ends a read."""

    n_slots: int
    started: list[FakeRead] = field(default_factory=list)
    kernel: dict[int, FakeRead] = field(default_factory=dict)
    promoted: list[tuple[int, int]] = field(default_factory=list)
    closed: bool = False

    def promote(self, slot: int) -> None:
        read = self.kernel.get(slot)          # landed, its callback not run yet: nothing to promote
        if read is not None and not read.urgent:
            self.promoted.append(read.key)

    def start(self, key: tuple[int, int], slot: int, urgent: bool = False, background: bool = False) -> asyncio.Future:
        if slot in self.kernel:
            raise RuntimeError(f"slot {slot} still has a read in flight")  # what the real reader refuses
        read = FakeRead(key, slot, asyncio.get_running_loop().create_future(), urgent, background)
        self.started.append(read)
        self.kernel[slot] = read
        return read.future

    def start_many(self, items: list[tuple[tuple[int, int], int]], urgent: bool = False,
                   background: bool = False) -> list[asyncio.Future]:
        """Like the real reader: every item is checked before any read starts."""
        for _, slot in items:
            if slot in self.kernel:
                raise RuntimeError(f"slot {slot} still has a read in flight")
        return [self.start(key, slot, urgent, background) for key, slot in items]

    def in_flight(self, key: tuple[int, int]) -> FakeRead:
        return next(r for r in self.kernel.values() if r.key == key)

    def land(self, key: tuple[int, int]) -> None:
        read = self.kernel.pop(self.in_flight(key).slot)
        if not read.future.cancelled():
            read.future.set_result(f"weights of {key} in slot {read.slot}")

    def fail(self, key: tuple[int, int], error: BaseException) -> None:
        read = self.kernel.pop(self.in_flight(key).slot)
        if not read.future.cancelled():
            read.future.set_exception(error)

    async def aclose(self) -> None:
        assert not self.kernel, "the reader was closed with reads in flight"
        self.closed = True


def make(per_layer: int = 4, prefetch: str = "on") -> tuple[CachedExpertSource, FakeReader]:
    cache = ExpertCache(per_layer * LAYERS, policy="lru", scope="layer", n_layers=LAYERS)
    policy = SchedulerPolicy(cache, BackpressureController(mode=prefetch, start=0.0), LookaheadPredictor(K, EXPERTS),
                             expert_nbytes=lambda key: 1 << 20, prefetch_count=K)
    reader = FakeReader(cache.n_slots)
    return CachedExpertSource(reader, policy, lambda layer, expert: (layer, expert)), reader  # type: ignore[arg-type]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def collect(source: CachedExpertSource, layer: int, experts: list[int], got: list) -> None:
    async for batch in source.stream(layer, experts):
        got.extend(batch)


def ids(batch: list) -> list[int]:
    return [expert for expert, _ in batch]


async def test_hits_come_first_and_misses_are_submitted_before_the_first_yield() -> None:
    source, reader = make()
    warm = asyncio.create_task(collect(source, 0, [1], []))
    await settle()
    reader.land((0, 1))
    await warm
    stream = source.stream(0, [3, 1, 4])
    [(expert, weights)] = await anext(stream)
    assert (expert, weights) == (1, reader.started[0].future.result())   # the hit, before any miss landed
    assert [r.key for r in reader.kernel.values()] == [(0, 3), (0, 4)]   # both misses already submitted
    reader.land((0, 4))
    assert ids(await anext(stream)) == [4]
    reader.land((0, 3))
    assert ids(await anext(stream)) == [3]
    with pytest.raises(StopAsyncIteration):
        await anext(stream)


async def test_experts_ready_together_come_in_one_batch() -> None:
    """Hits together, then the misses that landed while compute ran, together: one kernel call each."""
    source, reader = make()
    warm = asyncio.create_task(collect(source, 0, [1, 2], []))
    await settle()
    reader.land((0, 1))
    reader.land((0, 2))
    await warm
    stream = source.stream(0, [2, 3, 1, 4])
    assert sorted(ids(await anext(stream))) == [1, 2]
    reader.land((0, 3))
    reader.land((0, 4))
    await settle()
    assert sorted(ids(await anext(stream))) == [3, 4]
    with pytest.raises(StopAsyncIteration):
        await anext(stream)


async def test_every_slot_busy_the_next_miss_waits_for_a_slot_compute_let_go() -> None:
    source, reader = make(per_layer=2)
    stream = source.stream(0, [1, 2, 3])
    first = asyncio.ensure_future(anext(stream))
    await settle()
    assert [r.key for r in reader.started] == [(0, 1), (0, 2)]          # no slot for 3 yet
    reader.land((0, 2))
    assert ids(await first) == [2] and len(reader.started) == 2                      # held by compute: still no slot
    second = asyncio.ensure_future(anext(stream))                        # compute is done with 2
    await settle()
    third = reader.started[-1]
    assert third.key == (0, 3) and third.slot == reader.started[1].slot  # 3 reuses the slot 2 let go
    reader.land((0, 1))
    reader.land((0, 3))
    rest = ids(await second)                                             # 1 and 3 landed together
    async for batch in stream:
        rest += ids(batch)
    assert rest == [1, 3]


async def test_a_read_failing_while_another_stream_holds_the_slot_fails_both() -> None:
    source, reader = make()
    error = ExpertReadError("model.gguf", 4096, 100, 0, 5, "injected")
    a_got: list = []
    a = asyncio.create_task(collect(source, 0, [5, 6], a_got))
    await settle()
    b = asyncio.create_task(collect(source, 0, [5], []))
    await settle()
    assert [r.key for r in reader.started] == [(0, 5), (0, 6)]   # b shares a's read of 5
    reader.fail((0, 5), error)
    for task in (a, b):
        with pytest.raises(ExpertReadError, match="expert 5"):
            await task
    reader.land((0, 6))                                # a's other read still ends in the kernel's time
    await settle()
    cache = source.policy.cache
    assert (0, 5) not in cache and all(cache.refs(s) == 0 for s in range(cache.n_slots))
    assert not source._errors and a_got == []
    retry = asyncio.create_task(collect(source, 0, [5], []))   # a later request reads it again
    await settle()
    reader.land((0, 5))
    await retry
    await source.aclose()


async def test_a_stale_prefetch_is_not_started() -> None:
    source, reader = make()
    stream = source.stream(1, [1])
    task = asyncio.ensure_future(anext(stream))
    await settle()
    source.hint(1, [7, 8])                            # layer 1 is being routed already: too late
    source.hint(0, [7, 8])
    assert [r.key for r in reader.started] == [(1, 1)]
    assert source.policy.stats.prefetch_stale == 2
    reader.land((1, 1))
    await task
    await stream.aclose()


async def test_a_wrong_guess_is_demoted_and_evicted_before_a_useful_expert() -> None:
    source, reader = make(per_layer=3)
    warm = asyncio.create_task(collect(source, 1, [9], []))   # useful, and least recently used
    await settle()
    reader.land((1, 9))
    await warm
    route0 = asyncio.create_task(collect(source, 0, [1], []))
    await settle()
    source.hint(1, [2, 3])                             # lookahead: layer 1 will want 2 and 3
    prefetched = {r.key: r.slot for r in reader.started if r.key[0] == 1 and r.key != (1, 9)}
    assert set(prefetched) == {(1, 2), (1, 3)}
    for key in [(0, 1), (1, 2), (1, 3)]:
        reader.land(key)
    await route0
    await collect(source, 1, [2], [])                  # 3 was a wrong guess
    miss = asyncio.create_task(collect(source, 1, [4], []))
    await settle()
    assert reader.started[-1].key == (1, 4) and reader.started[-1].slot == prefetched[(1, 3)]
    assert (1, 9) in source.policy.cache
    reader.land((1, 4))
    await miss


async def test_demand_reads_are_started_urgent_and_prefetches_are_not() -> None:
    """The reader hears which reads the model waits for (a backend that queues reads serves those first): demand
    reads as they start, a prefetch once a stream waits for it."""
    source, reader = make(per_layer=3)
    route0 = asyncio.create_task(collect(source, 0, [1], []))
    await settle()
    source.hint(1, [2, 3])
    assert {r.key: r.urgent for r in reader.started} == {(0, 1): True, (1, 2): False, (1, 3): False}
    reader.land((0, 1))
    await route0
    route1 = asyncio.create_task(collect(source, 1, [2], []))   # waits for the prefetch of (1, 2): promoted once
    await settle()
    assert reader.promoted == [(1, 2)]
    for key in [(1, 3), (1, 2)]:
        reader.land(key)
    await route1
    assert reader.promoted == [(1, 2)]


async def test_a_cancelled_consumer_leaves_its_reads_to_the_kernel() -> None:
    source, reader = make(per_layer=1)
    consumer = asyncio.create_task(collect(source, 0, [1], []))
    await settle()
    slot = reader.started[0].slot
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    nxt = asyncio.create_task(collect(source, 0, [2], []))   # wants the only slot of layer 0
    await settle()
    assert len(reader.started) == 1 and slot in reader.kernel   # not reused while the read is in flight
    reader.land((0, 1))
    await settle()
    assert reader.started[-1].key == (0, 2) and reader.started[-1].slot == slot
    reader.land((0, 2))
    await nxt


async def test_close_waits_for_every_read_in_flight() -> None:
    source, reader = make()
    consumer = asyncio.create_task(collect(source, 0, [1, 2], []))
    await settle()
    source.hint(1, [5, 6])
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    closing = asyncio.create_task(source.aclose())
    await settle()
    assert not closing.done() and not reader.closed and len(reader.kernel) == 4
    source.hint(1, [7])                                # closing: no new read starts
    for key in [(0, 1), (0, 2), (1, 5)]:
        reader.land(key)
    await settle()
    assert not closing.done() and len(reader.started) == 4
    reader.fail((1, 6), ExpertReadError("model.gguf", 0, 1, 1, 6, "injected"))
    await closing
    assert reader.closed and not source._weights and not source._reads


async def test_a_read_the_reader_refuses_fails_the_stream_that_wanted_it() -> None:
    source, reader = make()

    def refuse(key, slot, urgent=False, background=False):
        raise ValueError("needs more slot bytes than the pool has")

    reader.start = refuse  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="slot bytes"):
        async with aclosing(source.stream(0, [1])) as stream:
            async for _ in stream:
                pass
    assert (0, 1) not in source.policy.cache and source.policy.reads_in_flight == 0


async def test_warm_reads_are_started_in_the_background_and_demand_reads_are_not() -> None:
    """The reader hears which reads are the warm start's (a backend that queues reads keeps little of those
    queued at the device at a time): warm reads as they start, never a demand read."""
    source, reader = make(per_layer=3)
    source.start_warm([(1, 5), (1, 6)])
    await settle()
    route0 = asyncio.create_task(collect(source, 0, [1], []))
    await settle()
    assert {r.key: (r.urgent, r.background) for r in reader.started} == {
        (1, 5): (False, True), (1, 6): (False, True), (0, 1): (True, False)}
    for key in [(1, 5), (1, 6), (0, 1)]:
        reader.land(key)
    await route0


async def test_warm_reads_reach_the_reader_in_the_policys_order_the_likeliest_first() -> None:
    """Demand reads go in file order, but the warm start's keep the policy's: what a prompt nearly chose
    first (most named first), then the rest in file order."""
    source, reader = make(per_layer=3)
    source.near_misses(1, [6, 6])
    source.near_misses(0, [2])
    source.start_warm([(0, 1), (0, 2), (1, 5), (1, 6)])
    await settle()
    assert [(r.key, r.background) for r in reader.started] == [
        ((1, 6), True), ((0, 2), True), ((0, 1), True), ((1, 5), True)]
    for key in [(1, 6), (0, 2), (0, 1), (1, 5)]:
        reader.land(key)
    await settle()
    assert source.policy.warm_pending == 0 and source.policy.reads_in_flight == 0
