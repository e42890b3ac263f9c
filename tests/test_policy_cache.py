"""ExpertCache: victims per policy and scope, busy slots never evicted, pins, hit accounting."""
from __future__ import annotations

import pytest

from colibri_aio.errors import UserError
from colibri_aio.policy.budget import parse_size, slots_for_budget
from colibri_aio.policy.cache import ExpertCache, EntryState


def demand(cache: ExpertCache, key: tuple[int, int]) -> tuple[bool, tuple[int, int] | None]:
    """Use ``key`` as the engine would: hit, or reserve + fill. Returns (hit, evicted)."""
    if cache.lookup(key) is not None:
        return True, None
    res = cache.reserve(key)
    assert res is not None
    cache.mark_filled(res.slot)
    return False, res.evicted


def test_lru_evicts_least_recently_used() -> None:
    c = ExpertCache(2, policy="lru")
    demand(c, (0, 1))
    demand(c, (0, 2))
    demand(c, (0, 1))                      # 2 is now least recent
    assert demand(c, (0, 3)) == (False, (0, 2))
    assert (0, 1) in c and (0, 2) not in c


def test_slot_ids_are_the_pool_slots() -> None:
    c = ExpertCache(3)
    slots = [c.reserve((0, e)).slot for e in range(3)]
    assert sorted(slots) == [0, 1, 2]


def test_layer_scope_only_evicts_within_the_layer() -> None:
    c = ExpertCache(4, scope="layer", n_layers=2)   # quota 2 per layer
    for key in [(0, 1), (1, 1), (1, 2), (0, 2)]:
        demand(c, key)
    # Layer 1's entries are older, but a layer-0 miss must evict from layer 0.
    assert demand(c, (0, 3)) == (False, (0, 1))
    assert {(1, 1), (1, 2)} <= {c.key_of(s) for s in range(4)}


def test_global_scope_evicts_across_layers() -> None:
    c = ExpertCache(4, scope="global")
    for key in [(0, 1), (1, 1), (1, 2), (0, 2)]:
        demand(c, key)
    assert demand(c, (0, 3)) == (False, (0, 1))
    assert demand(c, (0, 4)) == (False, (1, 1))


def test_slot_in_use_by_compute_is_never_evicted() -> None:
    c = ExpertCache(2)
    demand(c, (0, 1))
    demand(c, (0, 2))
    c.acquire(c.slot_of((0, 1)))           # compute reads the least recent entry
    assert demand(c, (0, 3)) == (False, (0, 2))
    assert (0, 1) in c


def test_every_slot_busy_refuses_instead_of_evicting() -> None:
    c = ExpertCache(2)
    demand(c, (0, 1))
    res = c.reserve((0, 2))                # still filling: the kernel owns it
    c.acquire(c.slot_of((0, 1)))
    assert c.reserve((0, 3)) is None
    assert c.stats.busy_refusals == 1
    assert c.state(res.slot) is EntryState.FILLING and (0, 1) in c
    c.release(c.slot_of((0, 1)))           # compute is done: now the idle entry can go
    assert c.reserve((0, 3)).evicted == (0, 1)


def test_filling_slot_is_not_evicted_even_when_least_recent() -> None:
    c = ExpertCache(2)
    first = c.reserve((0, 1))              # oldest, never filled
    demand(c, (0, 2))
    assert c.reserve((0, 3)).evicted == (0, 2)
    assert c.state(first.slot) is EntryState.FILLING


def test_failed_fill_leaves_no_entry_and_frees_the_slot() -> None:
    c = ExpertCache(2)
    res = c.reserve((0, 1))
    c.mark_failed(res.slot)
    assert (0, 1) not in c and c.free_slots == 2 and c.state(res.slot) is None
    assert c.lookup((0, 1)) is None
    assert c.stats.failed_fills == 1


def test_release_more_than_acquire_is_an_error() -> None:
    c = ExpertCache(1)
    demand(c, (0, 1))
    with pytest.raises(ValueError):
        c.release(c.slot_of((0, 1)))


def test_reserving_a_present_key_is_an_error() -> None:
    c = ExpertCache(2)
    demand(c, (0, 1))
    with pytest.raises(ValueError):
        c.reserve((0, 1))


def test_pinned_keys_occupy_slots_and_are_never_evicted() -> None:
    c = ExpertCache(3, pinned=[(0, 7)])
    (slot,) = c.pinned.values()
    assert c.state(slot) is EntryState.FILLING   # the caller fills pins at start
    c.mark_filled(slot)
    for e in range(10):
        demand(c, (0, e))
    assert c.slot_of((0, 7)) == slot
    assert c.lookup((0, 7)) == slot
    assert c.stats.pinned_hits == 2   # (0, 7) came up once in the loop and once here


def test_pinned_key_whose_fill_failed_gets_a_pinned_slot_back() -> None:
    c = ExpertCache(2, pinned=[(0, 7)])
    c.mark_failed(c.pinned[(0, 7)])
    demand(c, (0, 1))
    demand(c, (0, 2))                            # takes the freed slot
    res = c.reserve((0, 7))                      # the pin evicts an ordinary entry
    assert res is not None and res.evicted == (0, 1)
    c.mark_filled(res.slot)
    for e in range(3, 6):
        demand(c, (0, e))
    assert (0, 7) in c


def test_hit_accounting_split_pinned_cached_prefetched() -> None:
    c = ExpertCache(4, pinned=[(0, 0)])
    c.mark_filled(c.pinned[(0, 0)])
    demand(c, (0, 1))                                   # miss
    p = c.reserve((1, 5), prefetch=True)
    c.mark_filled(p.slot)
    assert c.lookup((1, 5)) == p.slot                   # first demand use: prefetch hit
    assert c.lookup((1, 5)) == p.slot                   # then an ordinary cached hit
    assert c.lookup((0, 0)) is not None                 # pinned hit
    assert c.lookup((0, 1)) is not None                 # cached hit
    s = c.stats
    assert (s.pinned_hits, s.cached_hits, s.prefetch_hits, s.misses, s.prefetch_reads) == (1, 2, 1, 1, 1)
    assert s.hit_rate == pytest.approx(4 / 5)


def test_prefetch_hit_counts_while_the_read_is_still_in_flight() -> None:
    c = ExpertCache(2)
    p = c.reserve((1, 5), prefetch=True)
    assert c.lookup((1, 5)) == p.slot and c.stats.prefetch_hits == 1


def test_prefetched_entry_evicted_unused_is_wasted() -> None:
    c = ExpertCache(1)
    c.mark_filled(c.reserve((1, 5), prefetch=True).slot)
    demand(c, (1, 6))
    assert c.stats.prefetch_wasted == 1 and c.stats.prefetch_hits == 0


def test_consecutive_prefetches_do_not_evict_each_other_under_lfu() -> None:
    c = ExpertCache(3, policy="lfu")
    demand(c, (0, 1))
    c.mark_filled(c.reserve((1, 2), prefetch=True).slot)
    c.mark_filled(c.reserve((1, 3), prefetch=True).slot)
    assert c.reserve((1, 4), prefetch=True).evicted == (0, 1)  # tie on one use: the older goes


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfru"])
def test_demoted_prefetch_is_the_next_victim(policy: str) -> None:
    c = ExpertCache(3, policy=policy)
    demand(c, (0, 1))
    demand(c, (0, 2))
    c.mark_filled(c.reserve((0, 3), prefetch=True).slot)
    assert c.demote((0, 3)) and not c.demote((0, 1)) and not c.demote((0, 9))
    assert demand(c, (0, 4)) == (False, (0, 3))
    assert c.stats.prefetch_wasted == 1


def test_a_used_prefetch_cannot_be_demoted() -> None:
    c = ExpertCache(2)
    c.mark_filled(c.reserve((0, 3), prefetch=True).slot)
    c.lookup((0, 3))
    assert not c.demote((0, 3))


def test_lfu_keeps_a_frequent_key_that_lru_evicts() -> None:
    seq = [(0, 1)] * 3 + [(0, 2), (0, 3), (0, 1)]
    hits = {}
    for policy in ("lru", "lfu"):
        c = ExpertCache(2, policy=policy)
        hits[policy] = sum(demand(c, k)[0] for k in seq)
    assert hits == {"lru": 2, "lfu": 3}


def test_lfu_counts_survive_eviction() -> None:
    c = ExpertCache(2, policy="lfu")
    for key in [(0, 1)] * 2 + [(0, 2)] * 3:
        demand(c, key)
    assert demand(c, (0, 3)) == (False, (0, 1))   # 2 uses < 3 uses
    assert demand(c, (0, 1)) == (False, (0, 3))   # back with 3 uses, not 1
    # A tie of 3 uses each: the less recent (0, 2) goes; an LFU that forgot counts would evict (0, 1).
    assert demand(c, (0, 4)) == (False, (0, 2))


def test_lfru_short_half_life_acts_like_lru_long_like_lfu() -> None:
    seq = [(0, 1)] * 3 + [(0, 2), (0, 3), (0, 1)]
    hits = {}
    for half_life in (0.1, 1e9):
        c = ExpertCache(2, policy="lfru", half_life=half_life)
        hits[half_life] = sum(demand(c, k)[0] for k in seq)
    assert hits == {0.1: 2, 1e9: 3}


def test_belady_needs_an_oracle_and_evicts_the_furthest_next_use() -> None:
    with pytest.raises(ValueError):
        ExpertCache(2, policy="belady")
    future = {(0, 1): 10.0, (0, 2): 5.0}
    c = ExpertCache(2, policy="belady", next_use=lambda k: future.get(k, float("inf")))
    demand(c, (0, 1))
    demand(c, (0, 2))
    assert demand(c, (0, 3)) == (False, (0, 1))


def test_layer_scope_needs_layers_and_rejects_too_many_pins() -> None:
    with pytest.raises(ValueError):
        ExpertCache(4, scope="layer")
    with pytest.raises(ValueError):
        ExpertCache(1, pinned=[(0, 1), (0, 2)])


@pytest.mark.parametrize("text,expected", [
    ("512M", 512 << 20), ("12G", 12 << 30), ("1.5GiB", 3 << 29), ("800MB", 800 << 20),
    ("4096", 4096), ("2k", 2048), (" 1 T ", 1 << 40)])
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-1G", "1.5", "12X", "1e9", "0.3K", "G"])
def test_parse_size_refuses_garbage(text: str) -> None:
    with pytest.raises(UserError):
        parse_size(text)


def test_slots_for_budget() -> None:
    assert slots_for_budget(10_000, 1_000, 2_500) == 7
    assert slots_for_budget(1_000, 1_000, 2_500) == 0
    with pytest.raises(ValueError):
        slots_for_budget(1_000, 0, 0)


# --- the residency table a one-graph decode step reads (ExpertCache.track_residency) ---

def test_an_expert_is_resident_only_from_its_reads_success_until_its_slot_is_reserved_again() -> None:
    c = ExpertCache(2, policy="lru")
    r = c.track_residency(1, 4)
    a = c.reserve((0, 1))
    assert not r.ready[0, 1]                         # filling: the read may still write there
    c.mark_filled(a.slot)
    assert r.ready[0, 1] and r.slots[0, 1] == a.slot
    demand(c, (0, 2))
    b = c.reserve((0, 3))                            # evicts (0, 1): its slot goes to another read
    assert b.evicted == (0, 1) and b.slot == a.slot
    assert not r.ready[0, 1] and not r.ready[0, 3]   # both before the new read is even started
    assert r.ready[0, 2]
    c.mark_filled(b.slot)
    assert r.ready[0, 3] and r.slots[0, 3] == b.slot and not r.ready[0, 1]


def test_a_failed_read_never_makes_an_expert_resident() -> None:
    c = ExpertCache(2, pinned=[(0, 0)])
    r = c.track_residency(1, 4)
    c.mark_failed(c.slot_of((0, 0)))                 # a pinned fill that failed
    failed = c.reserve((0, 2))
    c.mark_failed(failed.slot)
    assert not r.ready.any()
    assert r.slots.max() == 0                        # an index ggml may still read: always a slot


def test_residency_taken_late_starts_from_the_ready_entries() -> None:
    c = ExpertCache(3)
    demand(c, (1, 2))
    filling = c.reserve((0, 1))
    r = c.track_residency(2, 4)
    assert r.ready.sum() == 1 and r.ready[1, 2] and r.slots[1, 2] == c.slot_of((1, 2))
    c.mark_filled(filling.slot)
    assert r.ready[0, 1]
