"""The scheduler's driver: an ExpertSource that performs a :class:`SchedulerPolicy`'s actions with an ExpertReader.

Every decision (cache, prefetch, backpressure) is the policy's
(:mod:`colibri_aio.policy.scheduler`); this module only turns events into
calls and actions into reads. Following one layer's experts::

    stream(layer, experts) -> policy.on_route   -> start its reads (reader.start, submitted at once)
        loop: policy.next_event -> Ready: yield the expert's views, then policy.on_used -> start reads
                                   Wait: await one of the reads' futures
                                   Failed: raise the read's error
    each read's end -> policy.on_read_done      -> start reads
    hint(layer, ranked) -> policy.on_hint       -> start prefetch reads
    step(positions)     -> policy.on_step
    start_warm(keys)    -> policy.start_warm    -> start warm-start reads (more as reads end)
    near_misses(layer, ids) -> policy.on_near_misses   (a prompt's experts ranked just past its choice)

The reads of one action go to the reader together, in file order (warm
reads in the policy's order: the likeliest first, then runs in file order),
so that neighbouring experts of a layer (a prefill's union, a warm-start run)
are read with one request per projection.

Slot ownership (design invariant 2): a slot's read belongs to the reader
until it is over, whatever the stream that wanted it does; the policy frees
or reuses a slot only after :meth:`SchedulerPolicy.on_read_done`, which the
driver reports when the read's future resolves, and ``aclose`` waits for
every read in flight before the reader releases the pool.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence

import numpy as np

from colibri_aio.engine.packing import LandedPacking
from colibri_aio.experts import ExpertBatch, ExpertLocation, ExpertWeights, ResidentExperts
from colibri_aio.io.align import plan_expert
from colibri_aio.io.reader import ExpertReader
from colibri_aio.logs import get_logger
from colibri_aio.policy.scheduler import Actions, Failed, Read, Ready, SchedulerPolicy, Wait

log = get_logger("colibri_aio.engine.scheduler")

# A source's experts as stacks: per layer the gate/up/down bases and strides, the stack depth, and the table of
# stack indices when it is not the cache's slot numbers (None: the cache's).
_Stacks = tuple[tuple[tuple[int, int, int], ...], tuple[tuple[int, int, int], ...], int, "np.ndarray | None"]


class CachedExpertSource:
    """An :class:`~colibri_aio.experts.ExpertSource` with a bounded cache and lookahead prefetch."""

    def __init__(self, reader: ExpertReader, policy: SchedulerPolicy,
                 locate: Callable[[int, int], ExpertLocation]) -> None:
        """``locate(layer, expert)``: where an expert's bytes are in the model file."""
        if reader.n_slots < policy.cache.n_slots:
            raise ValueError(f"the reader has {reader.n_slots} slots; the cache needs {policy.cache.n_slots}")
        self.reader, self.policy = reader, policy
        self._locate = locate
        self._reads: dict[int, asyncio.Future[ExpertWeights]] = {}  # slot -> its read in flight
        self._background: set[int] = set()                          # slots of warm-start reads in flight
        self._promoted: set[int] = set()                            # slots of reads a stream waited for
        self._weights: dict[int, ExpertWeights] = {}                # slot -> views of the bytes it holds
        self._keys: dict[int, tuple[int, int]] = {}                 # slot -> the (layer, expert) it holds
        self._packing: LandedPacking | None = None                  # experts put in the kernels' layout
        self._errors: dict[int, BaseException] = {}                 # slot -> why its read failed
        self.demand_wait_s = 0.0  # time the consumer waited for demand bytes
        self._resident: ResidentExperts | None = None
        self._resident_checked = False

    # --- start ---------------------------------------------------------------------------

    async def fill_pinned(self, progress: Callable[[str, int, int], None] | None = None) -> None:
        """Read every pinned expert into its slot (called once, at start); raise the first failure."""
        self._perform(self.policy.pinned_reads(time.perf_counter()))
        futures = list(self._reads.values())
        if progress is not None:
            for n, landed in enumerate(asyncio.as_completed(futures), 1):
                with contextlib.suppress(Exception):  # raised below, once every read is over
                    await landed
                progress("pin experts", n, len(futures))
        if futures:
            await asyncio.wait(futures)
        for future in futures:
            if future.exception() is not None:
                raise future.exception()  # type: ignore[misc]

    def use_packer(self, packer: object | None, n_experts: int, prepacked: bool = False) -> None:
        """From now on every expert that lands is put into ``packer``'s layout (the kernels'
        :meth:`expert_packer`; None: the file's), and every one that has landed already is, now: the kernels
        are known only once the source is open, and the pinned and first warm reads may be in.
        ``prepacked``: the reader reads a repacked experts file, whose bytes are in that layout already."""
        if packer is None:
            return
        self._packing = LandedPacking(packer, self._locate, n_experts, mapped=self.reader.pool is None,
                                      release=self.reader.release, prepacked=prepacked)
        for slot, weights in self._weights.items():
            self._weights[slot] = self._packing.land(self._keys[slot], weights)
        self._resident, self._resident_checked = None, False   # the stacks a graph picks from may move

    @property
    def packing(self) -> LandedPacking | None:
        """How landed experts are repacked (None: they keep the file's layout)."""
        return self._packing

    def start_warm(self, keys: Sequence[tuple[int, int]]) -> None:
        """Stream ``keys`` into free slots in the background, behind every demand and prefetch read."""
        self._perform(self.policy.start_warm(keys, time.perf_counter()))

    # --- the ExpertSource protocol ------------------------------------------------------------

    async def stream(self, layer: int, experts: Sequence[int]) -> AsyncIterator[ExpertBatch]:
        """Yield batches of ``(expert, weights)`` covering ``experts``: every expert ready now in one
        batch (cached ones first), then misses as they land, those landed together in one batch."""
        if self._reads:
            # Let the loop reap what has landed (its callbacks start the next reads) even when every
            # expert of every layer hits and nothing below would wait.
            await asyncio.sleep(0)
        demand, actions = self.policy.on_route(layer, experts, time.perf_counter())
        self._perform(actions)
        try:
            while True:
                event = self.policy.next_event(demand)
                if isinstance(event, Ready):
                    ready = [event, *self.policy.more_ready(demand)]
                    try:
                        yield [(e.expert, self._weights[e.slot]) for e in ready]
                    finally:
                        now = time.perf_counter()
                        for e in ready:
                            self._perform(self.policy.on_used(e.slot, now))
                elif isinstance(event, Wait):
                    await self._wait(event.slots)
                elif isinstance(event, Failed):
                    raise self._errors[event.slot]
                else:
                    return
        finally:
            self._perform(self.policy.on_end(demand, time.perf_counter()))

    def resident(self, layers: Sequence[int], n_experts: int) -> ResidentExperts | None:
        """The experts of ``layers`` (the MoE blocks) as one stack per matrix and layer, with the cache's table
        of who is in (:class:`ResidentExperts`): the pool's slots, or with the mmap reader the file's stacked
        expert tensors themselves. None when they are not such stacks: a pool whose slots are not one stride
        apart, experts of a layer not at the same offsets in their slots (O_DIRECT puts each range after its
        file offset's misalignment, which differs between experts whose size is not a multiple of the
        alignment), or mapped experts of a matrix not one stride apart in their file."""
        if self._resident_checked:
            return self._resident
        self._resident_checked = True
        if not layers:
            return None
        n_blocks = max(layers) + 1
        stacks = self._mapped_stacks(layers, n_experts) if self.reader.pool is None else self._pool_stacks(layers,
                                                                                                       n_experts)
        if stacks is None:
            return None
        bases, strides, depth, slots = stacks
        table = self.policy.cache.track_residency(n_blocks, n_experts)
        self._resident = ResidentExperts(table.slots if slots is None else slots, table.ready, bases, strides, depth,
                                         holds_all=self.reader.pool is None)
        return self._resident

    def _pool_stacks(self, layers: Sequence[int], n_experts: int) -> _Stacks | None:
        """Stacks over the pool's slots: every slot one stride apart, a layer's experts at the same offsets."""
        pool = self.reader.pool
        assert pool is not None
        stride, first = pool.slot_nbytes, pool.slots[0].address
        if any(s.address != first + s.index * stride for s in pool.slots):
            return None
        n_blocks = max(layers) + 1
        bases = [(0, 0, 0)] * n_blocks
        for layer in layers:
            offsets = {tuple(r.view_offset for r in plan_expert(self._locate(layer, e)).reads)
                       for e in range(n_experts)}
            if len(offsets) != 1:
                return None
            bases[layer] = tuple(first + off for off in offsets.pop())  # type: ignore[assignment]
        return tuple(bases), ((stride,) * 3,) * n_blocks, pool.n_slots, None

    def _mapped_stacks(self, layers: Sequence[int], n_experts: int) -> _Stacks | None:
        """Stacks over the mapped file: each matrix of a layer is one tensor of ``n_experts`` experts, the stack
        index is the expert's id (the table of slots is the identity)."""
        addresses = self.reader.mapped_addresses()
        if addresses is None:
            return None
        n_blocks = max(layers) + 1
        bases, strides = [(0, 0, 0)] * n_blocks, [(0, 0, 0)] * n_blocks
        for layer in layers:
            first, second = self._locate(layer, 0), self._locate(layer, min(1, n_experts - 1))
            steps = tuple(b.offset - a.offset for a, b in zip(first.ranges, second.ranges))
            for e in range(n_experts):
                loc = self._locate(layer, e)
                if any(r.file != f.file or r.offset != f.offset + e * step
                       for r, f, step in zip(loc.ranges, first.ranges, steps)):
                    return None
            bases[layer] = tuple(addresses[r.file] + r.offset for r in first.ranges)  # type: ignore[assignment]
            strides[layer] = steps  # type: ignore[assignment]
            if self._packing is not None:      # repacked matrices are read from their copies
                copies = [self._packing.copy_base(layer, p) for p in range(3)]
                bases[layer] = tuple(b if c is None else c for b, c in zip(bases[layer], copies))  # type: ignore
                strides[layer] = tuple(s if c is None else r.nbytes  # type: ignore[assignment]
                                       for s, c, r in zip(steps, copies, first.ranges))
        identity = np.tile(np.arange(n_experts, dtype=np.int32), (n_blocks, 1))
        return tuple(bases), tuple(strides), n_experts, identity

    @property
    def warming(self) -> bool:
        """Whether the warm start still has experts to read or reads in flight."""
        return self.policy.warm_pending > 0 or bool(self._background)

    @property
    def reading(self) -> bool:
        """Whether a read is in flight (its end waits for the event loop to run its callbacks)."""
        return bool(self._reads)

    def routed(self, routes: Sequence[tuple[int, Sequence[int]]]) -> None:
        """A forward pass used only resident experts, picked through :meth:`resident`'s table: each layer's
        routing (its unique experts, ascending), counted as :meth:`stream` would have counted it."""
        self._perform(self.policy.on_routes(routes, time.perf_counter()))

    @property
    def misses(self) -> int:
        """Demand misses of the cache so far."""
        return self.policy.cache.stats.misses

    def hint(self, layer: int, experts: Sequence[int]) -> None:
        """Lookahead's ranking for ``layer`` (best first): the policy picks what to prefetch."""
        self._perform(self.policy.on_hint(layer, experts, time.perf_counter()))

    def step(self, positions: int, sequences: int = 1) -> None:
        """A forward pass over ``positions`` positions of ``sequences`` sequences begins."""
        self.policy.on_step(positions, time.perf_counter(), sequences)

    def near_misses(self, layer: int, experts: Sequence[int]) -> None:
        """A prompt's router ranked ``experts`` of ``layer`` just past its choice (one per position and rank):
        the warm start reads the most often named first."""
        self.policy.on_near_misses(layer, experts)

    # --- actions ---------------------------------------------------------------------------

    def _perform(self, actions: Actions) -> None:
        for slot in actions.dropped:
            self._weights.pop(slot, None)
            self._keys.pop(slot, None)
            self._errors.pop(slot, None)
        for kind in ("demand", "prefetch", "warm"):
            # Warm reads in the policy's order: the likeliest first, then runs in file order.
            of_kind = [read for read in actions.reads if read.kind == kind]
            if kind != "warm":
                of_kind.sort(key=lambda r: r.key)
            if of_kind:
                self._start(of_kind, urgent=kind == "demand", background=kind == "warm")

    def _start(self, reads: list[Read], urgent: bool, background: bool) -> None:
        """Hand reads to the reader, in file order (``urgent``: demand reads, which the model waits for;
        ``background``: the warm start's, which it may never wait for); each one's end comes back through
        :meth:`_over`."""
        try:
            futures = self.reader.start_many([(self._locate(*read.key), read.slot) for read in reads], urgent,
                                             background)
        except Exception as exc:  # refused before reaching the kernel: the reads are over, failed
            for read in reads:
                self._errors[read.slot] = exc
                self._perform(self.policy.on_read_done(read, False, time.perf_counter()))
            return
        for read, future in zip(reads, futures):
            self._reads[read.slot] = future
            if read.kind == "warm":
                self._background.add(read.slot)
            # The first callback of the future: the policy hears of the end before any waiter wakes.
            future.add_done_callback(lambda f, read=read: self._over(read, f))

    def _over(self, read: Read, future: asyncio.Future[ExpertWeights]) -> None:
        del self._reads[read.slot]
        self._background.discard(read.slot)
        self._promoted.discard(read.slot)
        error = asyncio.CancelledError() if future.cancelled() else future.exception()
        if error is None:
            weights = future.result()
            if self._packing is not None:
                weights = self._packing.land(read.key, weights)
            self._weights[read.slot], self._keys[read.slot] = weights, read.key
            if self._resident is not None:
                self._check_resident(read, weights)
        else:
            self._errors[read.slot] = error
            if read.kind == "prefetch":
                log.warning("prefetch read failed", layer=read.key[0], expert=read.key[1], error=str(error))
        self._perform(self.policy.on_read_done(read, error is None, time.perf_counter()))

    def _check_resident(self, read: Read, weights: ExpertWeights) -> None:
        """Landed bytes where :meth:`resident` says they are, or the table is given up (never a wrong expert)."""
        r = self._resident
        assert r is not None
        layer = read.key[0]
        index = read.slot if self.reader.pool is not None else read.key[1]  # mapped: the stack index is the id
        at = [m.data.ctypes.data for m in (weights.gate, weights.up, weights.down)]
        if at != [b + index * step for b, step in zip(r.bases[layer], r.strides[layer])]:
            log.warning("pool slots are not where the resident table expects them; one-step decode off",
                        layer=read.key[0], expert=read.key[1], slot=read.slot)
            self._resident = None

    async def _wait(self, slots: tuple[int, ...]) -> None:
        """Until one of the reads into ``slots`` (any read, if none named) is over."""
        reads = [self._reads[s] for s in slots if s in self._reads] if slots else list(self._reads.values())
        if not reads:
            raise RuntimeError(f"waiting for reads into slots {slots} that are not in flight")
        for slot in slots:  # reads started for a guess (warm start, read-ahead) that the model now waits for
            if slot in self._reads and slot not in self._promoted:
                self._promoted.add(slot)
                self.reader.promote(slot)
        t0 = time.perf_counter()
        await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
        self.demand_wait_s += time.perf_counter() - t0

    # --- end -------------------------------------------------------------------------------

    async def settle(self) -> None:
        """Wait until no demand or prefetch read is in flight: a stream that ended early (cancelled, left) may
        have started reads, prefetches above all, that nobody waits for; the next stream then starts from a
        disk that only the warm start (which gives way to it) still reads."""
        while urgent := [f for slot, f in self._reads.items() if slot not in self._background]:
            await asyncio.wait(urgent)

    async def aclose(self) -> None:
        """Start no more reads, wait for every read in flight, forget every slot, close the reader.

        The policy's ``usage`` holds this run's selections; saving them is the engine's business."""
        self.policy.close()
        if self._reads:
            await asyncio.wait(list(self._reads.values()))
        self._weights.clear()
        self._keys.clear()
        self._errors.clear()
        await self.reader.aclose()
