"""The scheduler's policy, sans-I/O: events in, actions out (in the manner of h11).

One object decides where a forward pass's experts come from. It owns the
expert cache (which slot holds which expert, what to evict), the lookahead
predictor (what to prefetch), the backpressure controller (whether a prefetch
may read now) and the rules that tie them together. It never touches a file,
a future or an event loop: the driver (:mod:`colibri_aio.engine.scheduler`)
starts the reads it asks for and reports each one's end. Time comes in as
``now``, so tests run it on a fake clock.

Events in, and what comes out::

    on_route(layer, experts, now)  -> (Demand, Actions)   a layer asks for its routed experts
    on_routes(routes, now)         -> Actions             a whole pass ran on resident experts only
    next_event(demand)             -> Ready | Wait | Failed | Done   what that request does now
    on_used(slot, now)             -> Actions             compute is done with a Ready expert
    on_end(demand, now)            -> Actions             the request is over (or abandoned)
    on_hint(layer, ranked, now)    -> Actions             lookahead's ranking for a later layer
    on_read_done(read, ok, now)    -> Actions             a read is over: bytes in place, or failed
    start_warm(keys, now)          -> Actions             stream these experts into free slots
    on_near_misses(layer, experts) -> None                a prompt's router ranked these just past its choice
    on_step(positions, now), on_device(sample), pinned_reads(now), close()

:class:`Actions` says which reads to start (slot, key, why) and which slots
lost their contents (evicted or failed): the driver forgets their bytes.

The rules:

- Hits first: a layer's cached experts are held (never evicted while held)
  and handed out at once; its misses get slots, evicting idle entries, and are
  read together. Misses that find every slot held or filling get a slot as
  soon as a read lands or a hold ends (for any waiting request, oldest first).
- Every slot a request uses is held from lookup or reservation until compute
  is done with it, so neither a later miss nor a prefetch can evict it.
- A read that fails while requests hold its slot fails those requests; the
  entry goes once the last of them lets go. A failed read nobody holds (a
  prefetch) just frees its slot.
- Prefetch reads the lookahead's top ``prefetch_count`` candidates (fixed k:
  in replays of the trained model the adaptive count read 1.7-2.1x the bytes
  and lost hit rate below 8 slots per layer, evidence/replay_colibri_tiny.md,
  "What prefetch costs"), skipping cached ones, while the backpressure
  controller allows (state and in-flight cap) and an idle slot can be spared.
- A hint for a layer at or before the one being routed is stale: its reads
  could not land before they are needed, so none is started.
- Read-ahead (a pass over several positions: a prefill): the hint for the
  next layer is the union of its positions' likely experts, most voted first,
  and most of it will be routed, so all of it is read, as far as that layer
  has free slots (read-ahead never evicts), bypassing the backpressure gate
  and the per-hint count: the disk reads layer l + 1 while layer l computes
  instead of idling until l + 1's router has run. It gives way: it starts only
  while no request waits for a slot (a hint that comes while one waits is
  kept and started once none does), so it only ever queues behind demand
  reads already out; a later demand read of that layer waits behind it at
  most for the wrong guesses (few: they are demoted when the layer routes).
  Hints come from lookahead, so ``--prefetch off`` turns it off as well.
- Wrong guesses are demoted: when layer L routes, the experts prefetched for
  L that it did not use become the cache's first victims.
- The warm start streams a list of experts (every expert when they all fit,
  else the hot set of a usage history) into free slots, in file order, runs
  of neighbours at a time (the I/O layer reads a run with one request per
  projection). It never evicts, and it gives way: no warm read starts while
  a demand or prefetch read is in flight or a request waits for a slot, and
  at most ``warm_inflight_bytes`` of warm reads are out at once, so a demand
  read never queues behind more than that. It goes to the layers after the
  one being computed first (the ones a prefill or a decode step reaches
  next), wrapping around.
- Where the warm start fills the page cache instead of a pool (``warm_gives_way``
  False: the mmap reader, chosen when every expert fits), it does not give way
  to demand and prefetch reads: a page-cache fill costs the CPU almost nothing
  (no fresh pool page to fault in and zero), so it reads whole layers
  (``warm_run``) beside them, ``warm_inflight_bytes`` at a time (refilled once
  half of it has landed, so each read stays large); a demand or read-ahead
  read of an expert it is filling waits for that read instead of reading it
  twice. Its reads are started as ``warm`` (the driver tells the reader they
  are background reads): the mmap reader queues only a window of such a
  batch at the device at a time, so a demand read waits behind that window,
  not behind the whole batch. It still waits out prompts: what a prompt
  routes to comes first (its read-ahead), the rest after: against filling
  every layer during the prompt too, this rule's first token came at 0.92
  [0.84-0.98] of its time (n = 5, per round) for 0.91 [0.82-0.96] of its
  first 64 tokens' rate, and at
  1.06 [0.94-1.48] of the pool's time to first token for 1.11 [0.95-1.22] of
  its first tokens' rate (evidence/first_token_20261207T051144Z.md: arm ours-pa).
- The warm start reads the likeliest experts first: those a prompt's router
  ranked just past the ``expert_used_count`` it chose (:meth:`on_near_misses`),
  most often named first, before the runs in file order. What a prompt chose
  is read already; what the first decoded tokens miss are mostly experts it
  nearly chose: in one diagnostic run on the 8-layer Qwen3-30B-A3B-shaped
  cut, 34 of the 50 experts the first 16 decoded tokens used beyond a
  32-position prompt's were in the quarter of the others its near misses
  ranked first. Against file order, the first 16 decoded tokens took 0.91
  [0.86-0.95] of the time, per round (evidence/first_token_near_miss_ab_20261208T014515Z.md).
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from colibri_aio.policy.backpressure import BackpressureController, DeviceSample
from colibri_aio.policy.cache import EntryState, ExpertCache, Key
from colibri_aio.policy.predictor import LookaheadPredictor
from colibri_aio.policy.usage import UsageHistory

ReadKind = Literal["demand", "prefetch", "warm"]
NO_TICKET = -1  # warm reads are not the backpressure controller's business


@dataclass(frozen=True, slots=True)
class Read:
    """A read to start: ``key``'s bytes into cache slot ``slot`` (the pool slot of the same number)."""

    slot: int
    key: Key
    kind: ReadKind
    ticket: int  # the backpressure controller's, for on_read_done


@dataclass(slots=True)
class Actions:
    """What the driver does after an event: forget the bytes of ``dropped`` slots, then start ``reads``."""

    reads: list[Read] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Ready:
    """Hand ``expert`` (bytes in ``slot``) to compute, then report :meth:`SchedulerPolicy.on_used`."""

    expert: int
    slot: int


@dataclass(frozen=True, slots=True)
class Wait:
    """Wait for one of the reads into ``slots`` to end; for any read in flight when ``slots`` is empty."""

    slots: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Failed:
    """The read of ``expert`` into ``slot`` failed: raise its error to the consumer."""

    expert: int
    slot: int


@dataclass(frozen=True, slots=True)
class Done:
    """Every expert of the request was handed out."""


DONE = Done()
Event = Ready | Wait | Failed | Done


class Demand:
    """One layer's request for its routed experts, as the policy tracks it (the driver only passes it back)."""

    __slots__ = ("layer", "ready", "waiting", "todo", "failed")

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self.ready: deque[tuple[int, int]] = deque()   # (expert, slot): held, bytes in place
        self.waiting: dict[int, int] = {}              # slot -> expert: held, read in flight
        self.todo: deque[int] = deque()                # experts without a slot yet
        self.failed: list[tuple[int, int]] = []        # (expert, slot): held, read failed


@dataclass(slots=True)
class SchedulerStats:
    demand_reads: int = 0
    prefetch_reads: int = 0
    prefetch_skipped_gate: int = 0     # predicted misses not read: backpressure (state or in-flight cap)
    prefetch_skipped_busy: int = 0     # ... because no slot could be spared
    prefetch_stale: int = 0            # hints for a layer already reached
    failed_reads: int = 0
    ahead_reads: int = 0               # experts a prefill's read-ahead read (counted in prefetch_reads too)
    warm_reads: int = 0                # experts the warm start read
    warm_skipped: int = 0              # warm-start experts already cached, or with no free slot in their layer


class SchedulerPolicy:
    """Cache, lookahead and backpressure behind one set of events; does no I/O."""

    def __init__(self, cache: ExpertCache, backpressure: BackpressureController, predictor: LookaheadPredictor, *,
                 expert_nbytes: Callable[[Key], int], prefetch_count: int,
                 usage: UsageHistory | None = None, warm_inflight_bytes: int = 64 << 20, warm_run: int = 8,
                 read_ahead: bool = True, warm_gives_way: bool = True) -> None:
        """``expert_nbytes(key)``: bytes of one expert's read (what the backpressure cap counts);
        ``prefetch_count``: candidates read per hint; ``usage``: a history that records every routing;
        ``warm_inflight_bytes``: the most warm-start bytes out at once; ``warm_run``: the most neighbours
        one warm read takes; ``read_ahead``: a prefill reads the next layer's whole hint; ``warm_gives_way``:
        the warm start waits while more urgent reads are out (it waits out prompts either way; see the rules)."""
        self.cache, self.backpressure, self.predictor, self.usage = cache, backpressure, predictor, usage
        self.prefetch_count = prefetch_count
        self.read_ahead = read_ahead
        self._positions = 1                         # positions of the pass under way
        self._sequences = 1                         # ... of so many sequences (as many: a decode step)
        self._ahead: tuple[int, list[int]] | None = None  # a read-ahead hint waiting for no request to wait
        self.warm_inflight_bytes, self.warm_run = warm_inflight_bytes, warm_run
        self.warm_gives_way = warm_gives_way
        self._warm: dict[int, list[int]] = {}       # layer -> experts still to warm, ascending
        self._named: Counter[Key] = Counter()       # prompt positions whose router ranked the expert just past k
        self._ranked: list[Key] | None = None       # the warm list's named experts, the most named last
        self._warm_in_flight = 0                    # bytes
        self._urgent = 0                            # demand and prefetch reads in flight
        self.stats = SchedulerStats()
        self._nbytes = expert_nbytes
        self._in_flight: dict[int, Read] = {}      # slot -> the read filling it
        self._failed: set[int] = set()             # slots whose read failed while requests held them
        self._open: list[Demand] = []              # requests not yet ended, oldest first
        self._prefetched: dict[int, set[int]] = {}  # layer -> experts prefetched for its next use
        self._current_layer = -1
        self._closed = False

    # --- state ------------------------------------------------------------------------

    @property
    def prefetch_on(self) -> bool:
        return self.backpressure.prefetch_on

    @property
    def prefetch_reason(self) -> str:
        return self.backpressure.reason

    @property
    def reads_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def warm_pending(self) -> int:
        """Experts the warm start has yet to start reading."""
        return sum(len(v) for v in self._warm.values())

    # --- events -----------------------------------------------------------------------

    def pinned_reads(self, now: float) -> Actions:
        """Reads that fill every pinned expert's slot (once, at start)."""
        return Actions([self._read(slot, key, "demand", now) for key, slot in self.cache.pinned.items()])

    def start_warm(self, keys: Sequence[Key], now: float) -> Actions:
        """Stream ``keys`` into free slots in the background (see the module's rules); replaces any earlier list."""
        self._warm, self._ranked = {}, None
        for layer, expert in sorted(set(keys)):
            self._warm.setdefault(layer, []).append(expert)
        actions = Actions()
        self._warm_more(now, actions)
        return actions

    def on_near_misses(self, layer: int, experts: Sequence[int]) -> None:
        """A prompt's router ranked ``experts`` of ``layer`` just past the ones it chose, one entry per
        position and rank (repeats count): the warm start reads the most often named first (see the rules)."""
        for expert, times in Counter(experts).items():   # counted in C: a long prompt names many
            self._named[(layer, expert)] += times
        self._ranked = None

    def on_route(self, layer: int, experts: Sequence[int], now: float) -> tuple[Demand, Actions]:
        """``layer`` routed to ``experts`` (unique ids): hold the cached ones, read the misses."""
        self._routed(layer, experts)
        demand = Demand(layer)
        for e in experts:
            slot = self.cache.lookup((layer, e))
            if slot is None:
                demand.todo.append(e)
                continue
            self.cache.acquire(slot)
            if slot in self._failed:
                demand.failed.append((e, slot))
            elif self.cache.state(slot) is EntryState.READY:
                demand.ready.append((e, slot))
            else:
                demand.waiting[slot] = e
        self._open.append(demand)
        actions = Actions()
        self._serve(demand, now, actions)
        return demand, actions

    def on_routes(self, routes: Sequence[tuple[int, Sequence[int]]], now: float) -> Actions:
        """A whole forward pass whose every routed expert was ready (``routes``: each layer's unique ids,
        in layer order) ran without asking: count it as :meth:`on_route`, :meth:`on_used` and
        :meth:`on_end` per layer would (hits, recency, usage), leaving the cache as they would leave it.

        Slots are neither held nor released (nothing could evict them while that pass ran: it ran
        without an event in between); the reads that the per-layer events could start (warm start) are
        asked for once, after the last layer, instead of after each. Prefetch has nothing to do when
        every expert was resident, and no hint was given.
        """
        for layer, experts in routes:
            self._routed(layer, experts)
            for e in experts:
                if self.cache.lookup((layer, e)) is None:
                    raise ValueError(f"on_routes: expert {e} of layer {layer} is not cached")
        actions = Actions()
        self._serve_all(now, actions)
        return actions

    def next_event(self, demand: Demand) -> Event:
        """What ``demand``'s consumer does now: take a Ready expert, Wait, raise a Failed read, or stop."""
        if demand.failed:
            return Failed(*demand.failed[0])
        if demand.ready:
            return Ready(*demand.ready.popleft())
        if demand.waiting:
            return Wait(tuple(demand.waiting))
        if demand.todo:
            if not self._in_flight:
                raise RuntimeError(f"layer {demand.layer}: {len(demand.todo)} experts need slots and none can be "
                                   f"freed ({self.cache.n_slots} slots, all held)")
            return Wait(())
        return DONE

    def more_ready(self, demand: Demand) -> list[Ready]:
        """After a Ready from :meth:`next_event`: every other expert of ``demand`` ready now, so the
        consumer can compute them in one batch (none while a failed read is to be raised first)."""
        if demand.failed:
            return []
        ready = [Ready(*r) for r in demand.ready]
        demand.ready.clear()
        return ready

    def on_used(self, slot: int, now: float) -> Actions:
        """Compute is done with the Ready expert in ``slot``: it may be evicted again."""
        self.cache.release(slot)
        actions = Actions()
        self._serve_all(now, actions)
        return actions

    def on_end(self, demand: Demand, now: float) -> Actions:
        """The request is over, finished or abandoned: let go of every slot it still holds."""
        actions = Actions()
        for _, slot in demand.ready:
            self.cache.release(slot)
        for slot in demand.waiting:
            self._let_go(slot, actions)
        for _, slot in demand.failed:
            self._let_go(slot, actions)
        demand.ready.clear(), demand.waiting.clear(), demand.todo.clear(), demand.failed.clear()
        if demand in self._open:
            self._open.remove(demand)
        self._serve_all(now, actions)  # the slots let go may be what another request waits for
        return actions

    def on_hint(self, layer: int, ranked: Sequence[int], now: float) -> Actions:
        """Lookahead ranked ``layer``'s likely experts (best first): prefetch the top misses the gate allows."""
        actions = Actions()
        if self._closed or layer <= self._current_layer:
            self.stats.prefetch_stale += 1
            return actions
        if self.read_ahead and self._positions > self._sequences:
            self.predictor.predicted(layer, ranked)  # scored as a hint; the whole union is read
            self._ahead = (layer, [int(e) for e in ranked])
            self._ahead_more(now, actions)
            return actions
        for e in self.predictor.predicted(layer, ranked, count=self.prefetch_count * self._sequences):
            key = (layer, e)
            if self.cache.slot_of(key) is not None:
                continue
            if not self.backpressure.may_prefetch(self._nbytes(key), now):
                self.stats.prefetch_skipped_gate += 1
                break
            reservation = self.cache.reserve(key, prefetch=True)
            if reservation is None:
                self.stats.prefetch_skipped_busy += 1
                break
            if reservation.evicted is not None:
                actions.dropped.append(reservation.slot)
            self._prefetch(reservation.slot, key, now, actions)
        return actions

    def on_read_done(self, read: Read, ok: bool, now: float) -> Actions:
        """The read into ``read.slot`` is over (the kernel no longer writes there): its bytes are in place
        (``ok``), or it failed or was abandoned."""
        del self._in_flight[read.slot]
        if read.kind == "warm":
            self._warm_in_flight -= self._nbytes(read.key)
        else:
            self._urgent -= 1
            self.backpressure.completed(read.ticket, now, ok=ok)
        actions = Actions()
        holders = [d for d in self._open if read.slot in d.waiting]
        if ok:
            self.cache.mark_filled(read.slot)
            for d in holders:
                d.ready.append((d.waiting.pop(read.slot), read.slot))
        else:
            self.stats.failed_reads += 1
            if holders:  # each holder raises the error; the entry goes with the last of them
                self._failed.add(read.slot)
                for d in holders:
                    d.failed.append((d.waiting.pop(read.slot), read.slot))
            else:
                self.cache.mark_failed(read.slot)
                actions.dropped.append(read.slot)
        self._serve_all(now, actions)
        return actions

    def on_step(self, positions: int, now: float, sequences: int = 1) -> None:
        """A forward pass over ``positions`` positions of ``sequences`` sequences begins (the controller times
        decode steps by it: one position of each sequence). A decode step of several sequences prefetches
        for each (``prefetch_count`` candidates per sequence, still behind the backpressure gate); a prefill
        reads ahead.

        The pass starts again from its first layer: a hint for any layer is fresh until that layer
        routes (leading dense blocks hint the first MoE block before any layer of the pass routes).
        """
        self._current_layer = -1
        self._positions, self._sequences = positions, sequences
        self._ahead = None
        self.backpressure.step(now, positions, sequences)
        if self.usage is not None:
            self.usage.count_tokens(positions)

    def on_device(self, sample: DeviceSample) -> None:
        """An iostat-style sample of the model's device."""
        self.backpressure.device(sample)

    def close(self) -> None:
        """No read is started from here on; reads in flight still report their end."""
        self._closed = True

    # --- internals ---------------------------------------------------------------------

    def _read(self, slot: int, key: Key, kind: ReadKind, now: float) -> Read:
        if kind == "warm":
            read = Read(slot, key, kind, NO_TICKET)
            self._warm_in_flight += self._nbytes(key)
            self.stats.warm_reads += 1
        else:
            read = Read(slot, key, kind, self.backpressure.submitted(kind, self._nbytes(key), now))
            self._urgent += 1
            if kind == "demand":
                self.stats.demand_reads += 1
            else:
                self.stats.prefetch_reads += 1
        self._in_flight[slot] = read
        return read

    def _routed(self, layer: int, experts: Sequence[int]) -> None:
        """What a layer's routing teaches before any slot is looked up: predictor score, demotions, usage."""
        self._current_layer = layer
        if self._ahead is not None and self._ahead[0] <= layer:
            self._ahead = None  # its layer is here: what it would read is demand now
        self.predictor.observed(layer, experts)
        for e in self._prefetched.pop(layer, set()).difference(experts):
            self.cache.demote((layer, e))  # a wrong guess: evict it first, before anything useful
        if self.usage is not None:
            self.usage.record(layer, experts)

    def _serve(self, demand: Demand, now: float, actions: Actions) -> None:
        """Reserve slots and start reads for as many of ``demand``'s misses as the cache can take now."""
        while demand.todo and not self._closed:
            reservation = self.cache.reserve((demand.layer, demand.todo[0]))
            if reservation is None:
                return
            if reservation.evicted is not None:
                actions.dropped.append(reservation.slot)
            self.cache.acquire(reservation.slot)
            demand.waiting[reservation.slot] = demand.todo.popleft()
            actions.reads.append(self._read(reservation.slot, reservation.key, "demand", now))

    def _serve_all(self, now: float, actions: Actions) -> None:
        for demand in self._open:
            self._serve(demand, now, actions)
        self._ahead_more(now, actions)
        self._warm_more(now, actions)

    def _ahead_more(self, now: float, actions: Actions) -> None:
        """Start the read-ahead hint's reads, into its layer's free slots, once no request waits for a slot."""
        if self._ahead is None or self._closed or any(d.todo for d in self._open):
            return
        layer, experts = self._ahead
        self._ahead = None
        for e in experts:
            key = (layer, e)
            if self.cache.slot_of(key) is not None:
                continue
            if not self.cache.has_room(key):
                self.stats.prefetch_skipped_busy += 1
                break
            reservation = self.cache.reserve(key, prefetch=True)
            assert reservation is not None and reservation.evicted is None
            self._prefetch(reservation.slot, key, now, actions)
            self.stats.ahead_reads += 1

    def _prefetch(self, slot: int, key: Key, now: float, actions: Actions) -> None:
        """Read ``key`` into its reserved ``slot`` as a prefetch, remembered for its layer's next use."""
        actions.reads.append(self._read(slot, key, "prefetch", now))
        self._prefetched.setdefault(key[0], set()).add(key[1])

    def _warm_more(self, now: float, actions: Actions) -> None:
        """Start warm reads while no prompt runs, the warm window has room and, where it gives way, nothing
        more urgent is out."""
        if self._positions > self._sequences:
            return  # a prefill: its read-ahead keeps the disk busy with what it needs; warm reads would queue ahead
        if not self.warm_gives_way and self._warm_in_flight > self.warm_inflight_bytes // 2:
            return  # refill the window by halves: a read of a whole run, not an expert each time one lands
        self._warm_named(now, actions)
        while self._warm_room():
            layer = next((l for l in sorted(self._warm) if l > self._current_layer), min(self._warm))
            pending = self._warm[layer]
            previous, run_start = None, -1
            while pending and self._warm_in_flight < self.warm_inflight_bytes:
                expert = pending[0]
                if previous is not None and (expert != previous + 1 or expert - run_start >= self.warm_run):
                    break  # the run ends: the next warm read starts a new one
                pending.pop(0)
                if not self._warm_read((layer, expert), now, actions):
                    continue
                run_start = expert if previous is None else run_start
                previous = expert
            if not pending:
                del self._warm[layer]

    def _warm_room(self) -> bool:
        """Whether another warm read may start now (experts left, window room, nothing it gives way to)."""
        return bool(self._warm and not self._closed and self._warm_in_flight < self.warm_inflight_bytes
                    and not (self.warm_gives_way and (self._urgent or any(d.todo for d in self._open))))

    def _warm_named(self, now: float, actions: Actions) -> None:
        """Warm reads of the experts prompts nearly chose, the most often named first."""
        if self._ranked is None:
            pending = {layer: set(experts) for layer, experts in self._warm.items()}
            named = [key for key in self._named if key[1] in pending.get(key[0], ())]
            self._ranked = sorted(named, key=lambda key: (self._named[key], -key[0], -key[1]))
        while self._ranked and self._warm_room():
            layer, expert = key = self._ranked.pop()
            pending = self._warm.get(layer, [])
            if expert not in pending:
                continue  # read already (another run took it)
            pending.remove(expert)
            if not pending:
                del self._warm[layer]
            self._warm_read(key, now, actions)

    def _warm_read(self, key: Key, now: float, actions: Actions) -> bool:
        """Start the warm read of ``key`` into a free slot; False when it is cached or has no room."""
        if self.cache.slot_of(key) is not None or not self.cache.has_room(key):
            self.stats.warm_skipped += 1
            return False
        reservation = self.cache.reserve(key, warm=True)
        assert reservation is not None and reservation.evicted is None
        actions.reads.append(self._read(reservation.slot, key, "warm", now))
        return True

    def _let_go(self, slot: int, actions: Actions) -> None:
        """Drop a hold; a failed read's entry goes once nobody holds it."""
        self.cache.release(slot)
        if slot in self._failed and not self.cache.refs(slot):
            self._failed.discard(slot)
            self.cache.mark_failed(slot)
            actions.dropped.append(slot)
