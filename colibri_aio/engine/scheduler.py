"""The scheduler: a bounded expert cache over the reader's buffer pool, demand reads
overlapped with compute, and lookahead prefetch behind a backpressure gate.

The policy objects (:class:`~colibri_aio.policy.cache.ExpertCache`, the
backpressure controller) decide; this module only carries their decisions
out with the :class:`~colibri_aio.io.reader.ExpertReader`:

- ``stream(layer, experts)``: cached experts are yielded at once, as one
  batch; every miss is reserved and submitted together; missed experts are
  yielded as their reads land, every read that has landed by the time the
  consumer asks in one batch. An expert being yielded is held (``acquire``)
  so no read can evict it, and is released when the consumer advances.
- ``hint(layer, ranked)``: the lookahead's ranking for the next layer. The
  predictor decides how many candidates are worth reading; while the
  backpressure controller allows (prefetch on, in-flight cap not reached),
  predicted misses are read into slots the cache can spare. Demand reads
  never wait behind more than the cap of prefetches, and a prefetch for a
  layer already passed is not started.
- ``step(positions)``: a forward pass begins; the backpressure controller
  times decode steps by it to judge, on a saturated disk, whether prefetch
  slows them.

Slot ownership (design invariant 2): a cache slot that is filling belongs to
its read until the read is over, even if every waiter went away; evicting a
ready slot releases its lease, which gives the pool slot back.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import structlog

from colibri_aio.experts import ExpertBatch
from colibri_aio.gguf.model import Model
from colibri_aio.io.reader import ExpertReader, SlotLease
from colibri_aio.policy.backpressure import BackpressureController
from colibri_aio.policy.cache import ExpertCache, Key, Reservation, SlotState
from colibri_aio.policy.predictor import LookaheadPredictor
from colibri_aio.policy.usage import UsageHistory, default_usage_path

log = structlog.get_logger("colibri_aio.engine.scheduler")

ReadKind = Literal["demand", "prefetch"]


@dataclass(slots=True)
class SchedulerStats:
    demand_reads: int = 0
    prefetch_reads: int = 0
    prefetch_skipped_gate: int = 0     # predicted misses not read: backpressure (state or in-flight cap)
    prefetch_skipped_busy: int = 0     # ... because no slot could be spared
    prefetch_stale: int = 0            # prefetches whose layer had passed before they were started
    demand_wait_s: float = 0.0         # time the consumer waited for demand bytes


class _Fill:
    """One read into one cache slot.

    ``over`` resolves once the read's bookkeeping is done (lease stored, cache
    entry marked). Waiters wait on it, not on ``task``: a task can already be
    done while its done-callback is still queued.
    """

    __slots__ = ("key", "kind", "task", "ticket", "over")

    def __init__(self, key: Key, kind: ReadKind, task: asyncio.Task[SlotLease], ticket: int) -> None:
        self.key, self.kind, self.task, self.ticket = key, kind, task, ticket
        self.over: asyncio.Future[None] = task.get_loop().create_future()


class CachedExpertSource:
    """An :class:`~colibri_aio.experts.ExpertSource` with a bounded cache and lookahead prefetch."""

    def __init__(self, model: Model, reader: ExpertReader, cache: ExpertCache,
                 backpressure: BackpressureController, *, usage: UsageHistory | None = None) -> None:
        if reader.pool is not None and reader.pool.n_slots < cache.n_slots:
            raise ValueError(f"the pool has {reader.pool.n_slots} slots; the cache needs {cache.n_slots}")
        self.model, self.reader, self.cache = model, reader, cache
        self.backpressure, self.usage = backpressure, usage
        self.predictor = LookaheadPredictor(model.args.expert_used_count, model.args.expert_count)
        self.stats = SchedulerStats()
        self._leases: dict[int, SlotLease] = {}   # ready slots
        self._fills: dict[int, _Fill] = {}        # filling slots
        self._failures: dict[Key, BaseException] = {}  # failed reads a stream still holds
        self._current_layer = -1
        self._started = False  # reads started and not yet kicked to the kernel
        self._prefetched: dict[int, set[int]] = {}  # layer -> experts prefetched for its next use
        self._held: list[int] = []                  # slots of the batch ``ready`` handed out
        self._closed = False

    # --- start -----------------------------------------------------------------

    async def fill_pinned(self, progress: Callable[[str, int, int], None] | None = None) -> None:
        """Read every pinned expert into its slot (called once, at start)."""
        pinned = self.cache.pinned
        for key, slot in pinned.items():
            self._start_fill(slot, key, "demand")
        tasks = [self._fills[s].task for s in list(self._fills)]
        if progress is not None:
            for n, landed in enumerate(asyncio.as_completed(tasks), 1):
                with contextlib.suppress(Exception):  # _settle raises the first failure below
                    await landed
                progress("pin experts", n, len(tasks))
        await self._settle(tasks)

    # --- demand path -------------------------------------------------------------

    async def stream(self, layer: int, experts: Sequence[int]) -> AsyncIterator[ExpertBatch]:
        """Yield batches of ``(expert, weights)`` for ``experts``: cached ones first, misses as they land.

        Every slot this layer uses is held (acquired) from lookup or
        reservation until the consumer is done with it, so neither a later
        miss nor a prefetch can evict it in between.
        """
        self._begin(layer, experts)
        ready: deque[tuple[int, int]] = deque()     # (expert, slot): bytes in place
        waiting: dict[int, int] = {}                # slot -> expert: read in flight
        todo: deque[int] = deque()                  # misses without a slot yet
        for e in experts:
            slot = self.cache.lookup((layer, e))
            if slot is None:
                todo.append(e)
                continue
            self.cache.acquire(slot)
            if self.cache.state(slot) is SlotState.READY:
                ready.append((e, slot))
            else:
                waiting[slot] = e
        try:
            self._reserve_misses(layer, todo, waiting)
            while ready or waiting or todo:
                await self._kick()
                if not ready:
                    await self._wait_for(layer, ready, waiting, todo)
                    continue
                batch = list(ready)
                ready.clear()
                try:
                    yield [(e, self._leases[slot].weights) for e, slot in batch]
                finally:
                    for _, slot in batch:
                        self.cache.release(slot)
                self._reserve_misses(layer, todo, waiting)
        finally:
            for _, slot in ready:
                self.cache.release(slot)
            for slot in waiting:
                self._let_go(slot)

    def ready(self, layer: int, experts: Sequence[int]) -> ExpertBatch | None:
        """All of ``experts`` at once if every one is cached and ready (held until :meth:`release`),
        else ``None`` and nothing changed: the caller streams them instead. The same bookkeeping as
        :meth:`stream` (hits, predictor score, usage), without a task or an await."""
        cache, slots = self.cache, []
        for e in experts:
            slot = cache.slot_of((layer, e))
            if slot is None or cache.state(slot) is not SlotState.READY:
                return None
            slots.append(slot)
        self._begin(layer, experts)
        for e, slot in zip(experts, slots):
            cache.lookup((layer, e))
            cache.acquire(slot)
        self._held = slots
        return [(e, self._leases[s].weights) for e, s in zip(experts, slots)]

    def release(self) -> None:
        """Let go of the batch :meth:`ready` returned."""
        held, self._held = self._held, []
        for slot in held:
            self.cache.release(slot)

    def _begin(self, layer: int, experts: Sequence[int]) -> None:
        """A layer asks for ``experts``: score the lookahead's guess, demote its wrong prefetches, count usage."""
        self._current_layer = layer
        self.predictor.observed(layer, experts)
        for e in self._prefetched.pop(layer, set()).difference(experts):
            self.cache.demote((layer, e))  # a wrong guess: evict it first, before anything useful
        if self.usage is not None:
            self.usage.record(layer, experts)

    async def _kick(self) -> None:
        """Let reads started since the last kick reach the kernel before compute takes the thread.

        A read task only runs when the event loop does, and the io_uring reactor
        submits a loop iteration's reads together in a callback; compute on the
        hits (or on an expert already here) does not yield to the loop, so
        without this the reads would wait for it instead of overlapping it.
        Two turns of the loop: one for the read tasks, one for the submit.
        """
        if self._started:
            self._started = False
            await asyncio.sleep(0)
            await asyncio.sleep(0)

    def _reserve_misses(self, layer: int, todo: deque[int], waiting: dict[int, int]) -> None:
        """Reserve slots and submit reads for as many misses as the cache can take now."""
        while todo:
            res = self.cache.reserve((layer, todo[0]))
            if res is None:
                return
            self._evict(res)
            self.cache.acquire(res.slot)
            self._start_fill(res.slot, res.key, "demand")
            waiting[res.slot] = todo.popleft()

    async def _wait_for(self, layer: int, ready: deque[tuple[int, int]], waiting: dict[int, int],
                        todo: deque[int]) -> None:
        """Block until a read this layer needs lands (or, when every slot is busy, any read)."""
        tasks = {self._fills[s].over: s for s in waiting if s in self._fills}
        if len(tasks) < len(waiting):  # some reads already ended: handle them without waiting
            done = {s for s in waiting if s not in self._fills}
        else:
            if not tasks:  # every slot is filling for someone else: wait for any read, then retry
                tasks = {f.over: s for s, f in self._fills.items()}
            if not tasks:
                raise RuntimeError(f"layer {layer}: {len(todo)} experts need slots and none can be freed "
                                   f"({self.cache.n_slots} slots)")
            t0 = time.perf_counter()
            finished, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            self.stats.demand_wait_s += time.perf_counter() - t0
            done = {tasks[t] for t in finished} & waiting.keys()
        for slot in done:
            if self.cache.state(slot) is not SlotState.READY:  # the read failed
                error = self._failures.pop((layer, waiting.pop(slot)))
                self._let_go(slot)
                raise error
            ready.append((waiting.pop(slot), slot))
        self._reserve_misses(layer, todo, waiting)

    def _let_go(self, slot: int) -> None:
        """Drop this stream's hold on a slot; a failed read's entry goes once nobody holds it."""
        self.cache.release(slot)
        if slot not in self._fills and self.cache.state(slot) is SlotState.FILLING and not self.cache.refs(slot):
            self._failures.pop(self.cache.key_of(slot), None)  # type: ignore[arg-type]
            self.cache.mark_failed(slot)

    # --- prefetch ---------------------------------------------------------------------

    def hint(self, layer: int, experts: Sequence[int]) -> None:
        """Prefetch the predicted misses of ``layer`` (ranked best first) while backpressure allows."""
        if layer <= self._current_layer or self._closed:
            self.stats.prefetch_stale += 1
            return
        # A fixed k candidates: in replays of the trained model the adaptive count read
        # 1.7-2.1x the bytes and lost hit rate below 8 slots per layer
        # (evidence/replay_colibri_tiny.md, "What prefetch costs").
        chosen = self.predictor.predicted(layer, experts, count=self.model.args.expert_used_count)
        for e in chosen:
            key = (layer, e)
            if self.cache.slot_of(key) is not None:
                continue
            if not self.backpressure.may_prefetch(self.model.expert(*key).nbytes, time.perf_counter(),
                                                  self._precision()):
                self.stats.prefetch_skipped_gate += 1
                return
            res = self.cache.reserve(key, prefetch=True)
            if res is None:
                self.stats.prefetch_skipped_busy += 1
                return
            self._evict(res)
            self._start_fill(res.slot, key, "prefetch")
            self._prefetched.setdefault(layer, set()).add(e)

    def step(self, positions: int) -> None:
        """A forward pass over ``positions`` positions begins: the backpressure controller times
        decode steps by it, for its trials of prefetch on against off on a saturated disk."""
        self.backpressure.step(time.perf_counter(), positions)

    def _precision(self) -> float | None:
        """Share of prefetched experts that were used, once enough predictions were scored."""
        score = self.predictor.score
        return score.precision if score.prefetched >= 4 * self.model.args.expert_used_count * 8 else None

    # --- reads --------------------------------------------------------------------------

    def _evict(self, res: Reservation) -> None:
        if res.evicted is not None:
            self._leases.pop(res.slot).release()

    def _start_fill(self, slot: int, key: Key, kind: ReadKind) -> None:
        loc = self.model.expert(*key)
        ticket = self.backpressure.submitted(kind, loc.nbytes, time.perf_counter())
        task = asyncio.get_running_loop().create_task(self.reader.read(loc))
        fill = _Fill(key, kind, task, ticket)
        self._fills[slot] = fill
        self._started = True
        if kind == "demand":
            self.stats.demand_reads += 1
        else:
            self.stats.prefetch_reads += 1
        task.add_done_callback(lambda t: self._fill_done(slot, fill))

    def _fill_done(self, slot: int, fill: _Fill) -> None:
        """A read is over: the slot now holds the key's bytes, or (failed) its entry is dropped
        as soon as no stream holds it; the error waits in ``_failures`` for the stream that does."""
        del self._fills[slot]
        try:
            self._account(slot, fill)
        finally:
            fill.over.set_result(None)

    def _account(self, slot: int, fill: _Fill) -> None:
        failed = fill.task.cancelled() or fill.task.exception() is not None
        self.backpressure.completed(fill.ticket, time.perf_counter(), ok=not failed)
        if failed:
            error = fill.task.exception() if not fill.task.cancelled() else asyncio.CancelledError()
            if self.cache.refs(slot):
                self._failures[fill.key] = error
            else:
                self.cache.mark_failed(slot)
                if fill.kind == "prefetch":
                    log.warning("prefetch read failed", layer=fill.key[0], expert=fill.key[1], error=str(error))
            return
        self._leases[slot] = fill.task.result()
        self.cache.mark_filled(slot)

    @staticmethod
    async def _settle(tasks: list[asyncio.Task[SlotLease]]) -> None:
        """Wait for ``tasks``; re-raise the first failure once all are over."""
        if not tasks:
            return
        await asyncio.wait(tasks)
        for t in tasks:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]

    # --- end --------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Wait for every read in flight, release every lease, close the reader."""
        self._closed = True
        pending = [f.task for f in self._fills.values()]
        if pending:
            await asyncio.wait(pending)
        for fill in [t for t in pending if not t.cancelled() and t.exception() is not None]:
            fill.exception()  # consumed: the engine is closing
        for lease in self._leases.values():
            lease.release()
        self._leases.clear()
        await self.reader.aclose()
        if self.usage is not None:
            self.usage.save(default_usage_path(self.usage.fingerprint))
