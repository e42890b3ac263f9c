"""Which routed expert lives in which buffer-pool slot: a sans-I/O expert cache.

The cache owns no memory. It maps keys ``(layer, expert)`` to slot ids
``0..n_slots-1`` of the I/O layer's buffer pool and decides, when a key
misses, which slot to reuse: it is the only slot allocator (the pool and the
reader hand out none). The caller does the reads and reports back.

Life of a slot::

    free --reserve(key)--> filling --mark_filled--> ready --(evicted by a later reserve)--> filling ...
                              └------mark_failed------> free

A slot that is *filling* belongs to the kernel (the read is in flight) and a
slot whose reference count is above zero is being read by compute: neither is
ever chosen as a victim (design invariant 2). When every candidate slot is
busy, :meth:`ExpertCache.reserve` returns ``None`` and the caller waits for a
release or a completion and asks again; it never gets a busy slot.

Pinned keys occupy slots that are never evicted. The remaining slots are
shared either by all layers (``scope="global"``) or split evenly into one
quota per layer (``scope="layer"``: a miss in layer L only evicts layer L's
entries, as in colibri and mixtral-offloading).

Eviction policies (the victim is the evictable entry with the lowest score):

- ``lru``: time of last use.
- ``lfu``: number of uses of the key since the cache was created — counted
  across evictions, so a hot expert that was pushed out comes back with its
  history — ties broken by last use.
- ``lfru``: frequency with exponential decay (the CRF of Lee et al.'s LRFU):
  each use adds 1 to a score that halves every ``half_life`` uses of the
  cache, so old popularity fades. ``half_life`` near 1 behaves like LRU, a
  very large one like LFU; the default is one pass over the cache's slots.
- ``belady``: the key whose next use is furthest in the future, given by a
  ``next_use`` oracle. Only a replay of a known trace can supply it; it is the
  offline optimum that bounds every online policy.

Under the online policies, a prefetched entry whose layer ran without using it
can be demoted (:meth:`ExpertCache.demote`): it becomes the first victim, so a
wrong prediction does not push out entries that are still useful.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, Literal

import numpy as np

Key = tuple[int, int]  # (layer, expert)
PolicyName = Literal["lru", "lfu", "lfru", "belady"]
Scope = Literal["global", "layer"]
POLICIES: tuple[str, ...] = ("lru", "lfu", "lfru", "belady")
SCOPES: tuple[str, ...] = ("global", "layer")


class EntryState(Enum):
    FILLING = "filling"  # a read into the slot is in flight: the kernel owns it
    READY = "ready"      # the slot holds the key's bytes


@dataclass(frozen=True, slots=True)
class Reservation:
    """A slot granted to ``key`` for a read; ``evicted`` is the key it held before, if any."""

    slot: int
    key: Key
    evicted: Key | None


@dataclass(slots=True)
class _Entry:
    key: Key
    slot: int
    state: EntryState
    pinned: bool
    prefetched: bool   # filled by a prefetch and not yet used by a demand lookup
    refs: int = 0
    last_use: int = 0
    demoted: bool = False  # a prefetch whose layer passed unused: the first victim


@dataclass(slots=True)
class CacheStats:
    """Demand lookups split by where the hit came from; reads split by why they were issued."""

    pinned_hits: int = 0
    cached_hits: int = 0
    prefetch_hits: int = 0      # first demand use of an entry a prefetch brought in
    misses: int = 0             # demand reservations: each one is a demand read
    prefetch_reads: int = 0     # prefetch reservations
    prefetch_wasted: int = 0    # prefetched entries evicted or failed before any demand use
    warm_reads: int = 0         # warm-start reservations (free slots only)
    evictions: int = 0
    failed_fills: int = 0
    busy_refusals: int = 0      # reserve() found no evictable slot

    @property
    def hits(self) -> int:
        return self.pinned_hits + self.cached_hits + self.prefetch_hits

    @property
    def lookups(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hits": self.hits, "lookups": self.lookups, "hit_rate": self.hit_rate}


class Residency:
    """Which experts' bytes are in place, as two arrays a kernel graph can read without asking the cache.

    ``ready[layer, expert]`` is True only between the successful end of the
    expert's read (:meth:`ExpertCache.mark_filled`) and the moment its entry
    leaves the cache (evicted, failed, dropped): it turns False *before* the
    slot is handed to another read, so a graph that only uses experts it
    sees ready never reads a slot being overwritten. ``slots[layer, expert]``
    is the slot of a ready expert and 0 otherwise: always a valid slot
    number, because ggml aborts on an expert index outside its stack; the
    bytes of slot 0 read for an expert that is not ready are discarded by
    the caller, which checks ``ready`` for every expert it used.
    """

    def __init__(self, n_layers: int, n_experts: int) -> None:
        self.slots = np.zeros((n_layers, n_experts), np.int32)
        self.ready = np.zeros((n_layers, n_experts), bool)

    def filled(self, key: Key, slot: int) -> None:
        self.slots[key] = slot
        self.ready[key] = True

    def gone(self, key: Key) -> None:
        self.ready[key] = False
        self.slots[key] = 0


class ExpertCache:
    """Maps (layer, expert) keys to pool slots and picks victims; does no I/O."""

    def __init__(self, n_slots: int, *, policy: PolicyName = "lru", scope: Scope = "global",
                 n_layers: int | None = None, pinned: Iterable[Key] = (),
                 half_life: float | None = None, next_use: Callable[[Key], float] | None = None) -> None:
        """``n_slots`` slots, ``pinned`` keys among them (reserved now, to be filled by the caller).

        ``scope="layer"`` needs ``n_layers``: each layer may hold at most
        ``(n_slots - len(pinned)) // n_layers`` unpinned entries (slots left
        over by the division stay unused, so a layer under its quota always
        finds a free slot). ``policy="belady"`` needs ``next_use(key)``.
        """
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}; choose from {', '.join(POLICIES)}")
        if scope not in SCOPES:
            raise ValueError(f"unknown cache scope {scope!r}; choose from {', '.join(SCOPES)}")
        if policy == "belady" and next_use is None:
            raise ValueError("policy 'belady' needs a next_use oracle")
        pins = list(dict.fromkeys(pinned))
        if len(pins) > n_slots:
            raise ValueError(f"{len(pins)} pinned keys do not fit in {n_slots} slots")
        if scope == "layer" and not n_layers:
            raise ValueError("scope 'layer' needs n_layers")
        self.n_slots, self.policy, self.scope = n_slots, policy, scope
        self.n_layers = n_layers
        self.layer_quota = (n_slots - len(pins)) // n_layers if scope == "layer" and n_layers else None
        self.half_life = float(half_life) if half_life else float(max(n_slots, 1))
        self.stats = CacheStats()
        self._next_use = next_use
        self._clock = 0
        self._free: list[int] = list(range(n_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._by_key: dict[Key, _Entry] = {}
        self._by_slot: dict[int, _Entry] = {}
        # Unpinned entries per eviction group in least-recently-used-first order.
        self._groups: dict[int | None, OrderedDict[Key, _Entry]] = {}
        self._uses: dict[Key, int] = {}                    # lfu: uses since creation
        self._crf: dict[Key, tuple[float, int]] = {}       # lfru: (score, clock of last update)
        self._pinned_keys = set(pins)
        self.residency: Residency | None = None
        for key in pins:
            self._insert(key, EntryState.FILLING, pinned=True, prefetched=False)

    # --- queries -----------------------------------------------------------------

    def __contains__(self, key: Key) -> bool:
        return key in self._by_key

    def __len__(self) -> int:
        return len(self._by_key)

    def slot_of(self, key: Key) -> int | None:
        """The slot holding or filling ``key``, without marking a use (for prefetch decisions)."""
        e = self._by_key.get(key)
        return None if e is None else e.slot

    def state(self, slot: int) -> EntryState | None:
        """``FILLING``, ``READY``, or ``None`` for a free slot."""
        e = self._by_slot.get(slot)
        return None if e is None else e.state

    def key_of(self, slot: int) -> Key | None:
        e = self._by_slot.get(slot)
        return None if e is None else e.key

    def refs(self, slot: int) -> int:
        e = self._by_slot.get(slot)
        return 0 if e is None else e.refs

    @property
    def pinned(self) -> dict[Key, int]:
        """Pinned keys and their slots (the caller fills them at start)."""
        return {k: e.slot for k, e in self._by_key.items() if e.pinned}

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def track_residency(self, n_layers: int, n_experts: int) -> Residency:
        """Keep a :class:`Residency` of every key from now on (filled from the entries ready now)."""
        if self.residency is None:
            self.residency = Residency(n_layers, n_experts)
            for e in self._by_key.values():
                if e.state is EntryState.READY:
                    self.residency.filled(e.key, e.slot)
        return self.residency

    # --- demand path ---------------------------------------------------------------

    def lookup(self, key: Key) -> int | None:
        """The slot of ``key`` if it is cached or being filled, else ``None``; a demand use.

        A hit is counted once per call, as a pinned, prefetch (first demand
        use of a prefetched entry, even while its read is still in flight) or
        cached hit (which includes a second lookup of a key whose demand read
        is in flight: that read is shared). A ``None`` is not counted: the
        miss is counted when the caller reserves a slot for the demand read.
        """
        e = self._by_key.get(key)
        if e is None:
            return None
        e.demoted = False
        if e.pinned:
            self.stats.pinned_hits += 1
        elif e.prefetched:
            self.stats.prefetch_hits += 1
            e.prefetched = False
        else:
            self.stats.cached_hits += 1
        self._touch(e)
        return e.slot

    def has_room(self, key: Key) -> bool:
        """Whether ``key`` would get a free slot without evicting anything (its layer's quota included)."""
        return bool(self._free) and (key in self._pinned_keys or self._has_room(key))

    def reserve(self, key: Key, *, prefetch: bool = False, warm: bool = False) -> Reservation | None:
        """A slot for reading ``key``, evicting an idle entry if needed; ``None`` if all are busy.

        The slot comes back *filling*: it belongs to the read until
        :meth:`mark_filled` or :meth:`mark_failed`. A demand reservation counts
        a miss and a use; a prefetch one counts a prefetch read and marks the
        entry so its first demand use is a prefetch hit; a ``warm`` one (the
        warm start) takes a free slot or nothing (``None``), and counts no use.
        """
        if key in self._by_key:
            raise ValueError(f"{key} is already in the cache (slot {self._by_key[key].slot})")
        if warm:
            if not self.has_room(key):
                return None
            self.stats.warm_reads += 1
            return Reservation(self._insert(key, EntryState.FILLING, pinned=key in self._pinned_keys,
                                            prefetched=False).slot, key, None)
        pinned = key in self._pinned_keys
        evicted: Key | None = None
        if not (self._free and (pinned or self._has_room(key))):
            # A pinned key whose earlier fill failed takes its slot back from its group.
            victim = self._victim(self._group_of(key))
            if victim is None:
                return self._refuse()
            evicted = victim.key
            self._evict(victim)
        e = self._insert(key, EntryState.FILLING, pinned=pinned, prefetched=prefetch)
        if prefetch:
            self.stats.prefetch_reads += 1
            self._clock += 1
            e.last_use = self._clock  # recent, so the next prefetch does not evict it at once
        else:
            self.stats.misses += 1
            self._touch(e)
        return Reservation(e.slot, key, evicted)

    def mark_filled(self, slot: int) -> None:
        """The read into ``slot`` completed with the right bytes."""
        e = self._entry(slot)
        if e.state is not EntryState.FILLING:
            raise ValueError(f"slot {slot} is not filling")
        e.state = EntryState.READY
        if self.residency is not None:
            self.residency.filled(e.key, slot)

    def mark_failed(self, slot: int) -> None:
        """The read into ``slot`` failed or was cancelled before submission: the entry is dropped.

        A pinned key stays pinned, so a later :meth:`reserve` of it gets a
        pinned slot again.
        """
        e = self._entry(slot)
        if e.state is not EntryState.FILLING:
            raise ValueError(f"slot {slot} is not filling")
        if e.refs:
            raise ValueError(f"slot {slot} failed while compute holds {e.refs} reference(s)")
        self.stats.failed_fills += 1
        if e.prefetched:
            self.stats.prefetch_wasted += 1
        self._remove(e)

    def demote(self, key: Key) -> bool:
        """Make an unused prefetched entry the next victim (its layer ran without using it).

        Returns whether ``key`` was such an entry. A later demand use
        promotes it back like any hit. Keeps wrong predictions from pushing
        out entries that are still useful.
        """
        e = self._by_key.get(key)
        if e is None or e.pinned or not e.prefetched:
            return False
        e.demoted = True
        self._groups[self._group_of(key)].move_to_end(key, last=False)
        return True

    def acquire(self, slot: int) -> None:
        """Compute starts reading ``slot``: it cannot be evicted until :meth:`release`."""
        self._entry(slot).refs += 1

    def release(self, slot: int) -> None:
        """Compute is done with ``slot``."""
        e = self._entry(slot)
        if e.refs <= 0:
            raise ValueError(f"slot {slot} released more often than acquired")
        e.refs -= 1

    # --- internals -------------------------------------------------------------------

    def _refuse(self) -> None:
        self.stats.busy_refusals += 1
        return None

    def _entry(self, slot: int) -> _Entry:
        e = self._by_slot.get(slot)
        if e is None:
            raise ValueError(f"slot {slot} holds no entry")
        return e

    def _group_of(self, key: Key) -> int | None:
        return key[0] if self.scope == "layer" else None

    def _has_room(self, key: Key) -> bool:
        """Whether ``key`` may take a free slot instead of evicting from its group."""
        if self.layer_quota is None:
            return bool(self._free)
        return len(self._groups.get(key[0], ())) < self.layer_quota

    def _insert(self, key: Key, state: EntryState, *, pinned: bool, prefetched: bool) -> _Entry:
        e = _Entry(key, self._free.pop(), state, pinned, prefetched)
        self._by_key[key], self._by_slot[e.slot] = e, e
        if not pinned:
            self._groups.setdefault(self._group_of(key), OrderedDict())[key] = e
        return e

    def _remove(self, e: _Entry) -> None:
        if self.residency is not None:
            self.residency.gone(e.key)  # before the slot can be reserved again
        del self._by_key[e.key], self._by_slot[e.slot]
        if not e.pinned:
            del self._groups[self._group_of(e.key)][e.key]
        self._free.append(e.slot)

    def _evict(self, e: _Entry) -> None:
        self.stats.evictions += 1
        if e.prefetched:
            self.stats.prefetch_wasted += 1
        self._remove(e)

    def _touch(self, e: _Entry) -> None:
        """Record a use of ``e`` for every policy's bookkeeping."""
        self._clock += 1
        e.last_use = self._clock
        if not e.pinned:
            self._groups[self._group_of(e.key)].move_to_end(e.key)
        self._uses[e.key] = self._uses.get(e.key, 0) + 1
        self._crf[e.key] = (self._crf_now(e.key) + 1.0, self._clock)

    def _crf_now(self, key: Key) -> float:
        score, at = self._crf.get(key, (0.0, self._clock))
        return score * math.exp2(-(self._clock - at) / self.half_life)

    def _evictable(self, e: _Entry) -> bool:
        return e.state is EntryState.READY and e.refs == 0

    def _victim(self, group: int | None) -> _Entry | None:
        entries = self._groups.get(group)
        if not entries:
            return None
        if self.policy == "lru":
            # Least recently used first; skip busy entries without sorting anything.
            return next((e for e in entries.values() if self._evictable(e)), None)
        candidates = [e for e in entries.values() if self._evictable(e)]
        if not candidates:
            return None
        # An unused prefetched entry scores one pending use: it was read because a use is expected,
        # and scoring it zero would make each prefetch evict the one before it.
        if self.policy == "lfu":
            return min(candidates, key=lambda e: (not e.demoted, self._uses.get(e.key, 0) + e.prefetched,
                                                  e.last_use))
        if self.policy == "lfru":
            return min(candidates, key=lambda e: (not e.demoted, self._crf_now(e.key) + e.prefetched, e.last_use))
        assert self._next_use is not None
        return max(candidates, key=lambda e: (self._next_use(e.key), -e.last_use))
