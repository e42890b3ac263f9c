"""The scheduler policy on its own: events in, actions out, no reader, no loop, a fake clock."""
from __future__ import annotations

import pytest

from colibri_aio.policy.backpressure import BackpressureConfig, BackpressureController, DeviceSample
from colibri_aio.policy.cache import ExpertCache
from colibri_aio.policy.predictor import LookaheadPredictor
from colibri_aio.policy.scheduler import DONE, Actions, Failed, Ready, SchedulerPolicy, Wait
from colibri_aio.policy.usage import UsageHistory

LAYERS, EXPERTS, K = 3, 16, 2
NBYTES = 1 << 20


def make(per_layer: int = 4, *, mode: str = "on", config: BackpressureConfig | None = None,
         pinned: list[tuple[int, int]] = (), usage: UsageHistory | None = None) -> SchedulerPolicy:
    cache = ExpertCache(per_layer * LAYERS + len(pinned), policy="lru", scope="layer", n_layers=LAYERS,
                        pinned=pinned)
    return SchedulerPolicy(cache, BackpressureController(config, mode=mode, start=0.0),
                           LookaheadPredictor(K, EXPERTS), expert_nbytes=lambda key: NBYTES, prefetch_count=K,
                           usage=usage)


def land(policy: SchedulerPolicy, actions: Actions, now: float = 0.0, ok: bool = True) -> Actions:
    """Every read of ``actions`` ends (in order); returns what those ends asked for."""
    out = Actions()
    for read in actions.reads:
        more = policy.on_read_done(read, ok, now)
        out.reads += more.reads
        out.dropped += more.dropped
    return out


def consume(policy: SchedulerPolicy, demand) -> list[int]:
    """Take every Ready expert in turn (compute done at once); returns their ids in hand-out order."""
    got = []
    while isinstance(event := policy.next_event(demand), Ready):
        got.append(event.expert)
        policy.on_used(event.slot, 0.0)
    return got


def warm(policy: SchedulerPolicy, layer: int, experts: list[int]) -> None:
    """Route ``experts`` once and let them land, so they are cached."""
    demand, actions = policy.on_route(layer, experts, 0.0)
    land(policy, actions)
    assert consume(policy, demand) == experts and policy.next_event(demand) is DONE
    policy.on_end(demand, 0.0)


def test_hits_are_handed_out_first_and_every_miss_is_read_at_once() -> None:
    p = make()
    warm(p, 0, [1, 2])
    demand, actions = p.on_route(0, [3, 1, 4, 2], 0.0)
    assert [r.key for r in actions.reads] == [(0, 3), (0, 4)] and {r.kind for r in actions.reads} == {"demand"}
    assert consume(p, demand) == [1, 2]                       # hits before any miss landed
    assert p.next_event(demand) == Wait(tuple(r.slot for r in actions.reads))
    land(p, actions)
    assert consume(p, demand) == [3, 4] and p.next_event(demand) is DONE
    p.on_end(demand, 0.0)
    assert p.cache.stats.cached_hits == 2 and p.stats.demand_reads == 4 and p.reads_in_flight == 0


def test_a_held_expert_is_never_evicted() -> None:
    p = make(per_layer=2)
    warm(p, 0, [1, 2])
    held, _ = p.on_route(0, [1], 0.0)
    event = p.next_event(held)
    assert isinstance(event, Ready)                       # expert 1 is with compute now
    demand, actions = p.on_route(0, [5, 6], 0.0)
    assert [r.key for r in actions.reads] == [(0, 5)]     # evicts 2, not the held 1
    assert actions.dropped == [actions.reads[0].slot] and p.cache.slot_of((0, 1)) == event.slot


def test_every_slot_busy_waits_for_a_read_then_reuses_the_slot_compute_let_go() -> None:
    p = make(per_layer=2)
    demand, actions = p.on_route(0, [1, 2, 3], 0.0)
    assert [r.key for r in actions.reads] == [(0, 1), (0, 2)]    # the third has no slot yet
    first, second = actions.reads
    assert p.next_event(demand) == Wait((first.slot, second.slot))
    assert land(p, Actions([first])).reads == []                  # landed, but held: still no slot
    ready = p.next_event(demand)
    assert ready == Ready(1, first.slot)
    more = p.on_used(first.slot, 0.0)                             # compute let go of it: the third takes it
    assert [(r.slot, r.key) for r in more.reads] == [(first.slot, (0, 3))] and more.dropped == [first.slot]
    land(p, Actions([second]))
    land(p, more)
    assert consume(p, demand) == [2, 3] and p.next_event(demand) is DONE


def test_no_slot_can_be_freed_is_an_error_not_a_hang() -> None:
    p = make(per_layer=1)
    warm(p, 0, [1])
    holder, _ = p.on_route(0, [1], 0.0)
    assert isinstance(p.next_event(holder), Ready)       # the only slot of layer 0 is with compute
    demand, actions = p.on_route(0, [2], 0.0)
    assert actions.reads == []
    with pytest.raises(RuntimeError, match="none can be freed"):
        p.next_event(demand)


def test_a_read_failing_while_two_requests_hold_its_slot_fails_both_and_goes_with_the_last() -> None:
    p = make()
    a, actions = p.on_route(0, [7], 0.0)
    b, none = p.on_route(0, [7], 0.0)              # a second stream shares the read in flight
    assert none.reads == [] and p.next_event(b) == Wait((actions.reads[0].slot,))
    slot = actions.reads[0].slot
    assert land(p, actions, ok=False).dropped == []              # held: the entry stays for now
    assert p.next_event(a) == Failed(7, slot) and p.next_event(b) == Failed(7, slot)
    c, _ = p.on_route(0, [7], 0.0)                 # a lookup meanwhile sees the failure too
    assert p.next_event(c) == Failed(7, slot)
    assert p.on_end(a, 0.0).dropped == [] and p.on_end(c, 0.0).dropped == []
    assert p.on_end(b, 0.0).dropped == [slot]      # the last holder let go: the slot is free
    assert (0, 7) not in p.cache and p.cache.stats.failed_fills == 1 and p.stats.failed_reads == 1
    again, retry = p.on_route(0, [7], 0.0)         # and a later request reads it again
    assert [r.key for r in retry.reads] == [(0, 7)]


def test_a_failed_prefetch_nobody_holds_frees_its_slot() -> None:
    p = make()
    p.on_route(0, [1], 0.0)
    actions = p.on_hint(1, [4, 5, 6], 0.0)
    assert [r.key for r in actions.reads] == [(1, 4), (1, 5)] and {r.kind for r in actions.reads} == {"prefetch"}
    assert land(p, actions, ok=False).dropped == [r.slot for r in actions.reads]
    assert (1, 4) not in p.cache and p.cache.stats.prefetch_wasted == 2


def test_a_hint_for_a_layer_already_reached_is_stale() -> None:
    p = make()
    p.on_route(2, [1], 0.0)
    assert p.on_hint(2, [3, 4], 0.0).reads == [] and p.on_hint(1, [3, 4], 0.0).reads == []
    assert p.stats.prefetch_stale == 2 and p.stats.prefetch_reads == 0
    p.on_route(0, [1], 0.0)                        # the next token starts again at layer 0
    assert len(p.on_hint(1, [3, 4], 0.0).reads) == K


def test_prefetch_reads_the_top_k_misses_and_a_routed_prefetch_is_a_hit() -> None:
    p = make()
    warm(p, 1, [3])
    p.on_route(0, [1], 0.0)
    actions = p.on_hint(1, [3, 4, 5, 6], 0.0)      # 3 is cached: the top k are 3 and 4, so only 4 is read
    assert [r.key for r in actions.reads] == [(1, 4)]
    demand, more = p.on_route(1, [4, 3], 0.0)      # routed while the prefetch is still in flight
    assert more.reads == [] and consume(p, demand) == [3]
    land(p, actions)
    assert consume(p, demand) == [4] and p.cache.stats.prefetch_hits == 1


def test_a_wrong_guess_is_demoted_so_the_next_miss_evicts_it_first() -> None:
    p = make(per_layer=3)
    warm(p, 1, [8])                                 # useful, least recently used of what follows
    p.on_route(0, [1], 0.0)
    hinted = p.on_hint(1, [2, 3], 0.0)
    land(p, hinted)
    demand, _ = p.on_route(1, [2], 0.0)             # 3 was a wrong guess
    consume(p, demand)
    p.on_end(demand, 0.0)
    _, actions = p.on_route(1, [9], 0.0)
    slot_of_3 = next(r.slot for r in hinted.reads if r.key == (1, 3))
    assert actions.dropped == [slot_of_3] and (1, 8) in p.cache and (1, 3) not in p.cache


def test_backpressure_decides_whether_and_how_many_prefetches_go() -> None:
    off = make(mode="off")
    off.on_route(0, [1], 0.0)
    assert off.on_hint(1, [4, 5], 0.0).reads == [] and off.stats.prefetch_skipped_gate == 1
    capped = make(config=BackpressureConfig(max_prefetch_reads=1))
    capped.on_route(0, [1], 0.0)
    assert len(capped.on_hint(1, [4, 5], 0.0).reads) == 1 and capped.stats.prefetch_skipped_gate == 1
    assert off.prefetch_on is False and off.prefetch_reason == "forced off"


def test_prefetch_takes_no_slot_it_cannot_spare() -> None:
    p = make(per_layer=1)
    p.on_route(0, [1], 0.0)
    filling = p.on_hint(1, [4, 5], 0.0)             # the only slot of layer 1 is filling now
    assert [r.key for r in filling.reads] == [(1, 4)] and p.stats.prefetch_skipped_busy == 1


def test_pinned_reads_fill_every_pinned_slot_and_usage_is_recorded() -> None:
    usage = UsageHistory("test", LAYERS, EXPERTS)
    p = make(pinned=[(0, 3), (2, 1)], usage=usage)
    actions = p.pinned_reads(0.0)
    assert sorted(r.key for r in actions.reads) == [(0, 3), (2, 1)]
    land(p, actions)
    demand, none = p.on_route(0, [3], 0.0)
    assert none.reads == [] and consume(p, demand) == [3] and p.cache.stats.pinned_hits == 1
    assert usage.counts[0, 3] == 1 and usage.counts.sum() == 1


def test_an_abandoned_request_lets_go_of_everything_and_its_reads_still_land() -> None:
    p = make(per_layer=2)
    warm(p, 0, [1])
    demand, actions = p.on_route(0, [1, 2, 3], 0.0)
    assert isinstance(p.next_event(demand), Ready)          # 1 handed out, then the consumer stops
    p.on_used(p.cache.slot_of((0, 1)), 0.0)
    p.on_end(demand, 0.0)
    assert all(p.cache.refs(s) == 0 for s in range(p.cache.n_slots))
    land(p, actions)                                        # the read of 2 lands into the cache, unheld
    assert p.cache.state(p.cache.slot_of((0, 2))).value == "ready"


def test_after_close_no_read_starts() -> None:
    p = make(per_layer=1)
    demand, actions = p.on_route(0, [1, 2], 0.0)
    p.close()
    assert land(p, actions).reads == []                     # 2 would have taken the slot: not any more
    assert p.on_hint(1, [4], 0.0).reads == [] and p.stats.prefetch_stale == 1


def test_decode_steps_and_device_samples_reach_the_controller() -> None:
    p = make(mode="auto", config=BackpressureConfig(window=0.1, trial_steps=0))
    for t in (0.0, 0.1, 0.2):
        p.on_step(1, t)
    assert p.backpressure.counters.decode_steps == 2        # a step ends when the next begins
    for i in range(20):                                     # another reader keeps the device busy
        p.on_device(DeviceSample(end=0.2 + 0.1 * (i + 1), interval=0.1, util=0.97, r_await_ms=4, aqu_sz=8,
                                 read_bps=2e9, reads=100))
    p.on_route(0, [1], 2.5)
    assert p.on_hint(1, [4, 5], 2.5).reads == [] and p.prefetch_reason.startswith("device-busy")


def make_warm(per_layer: int = 4, window: int = 3 * NBYTES, run: int = 2, gives_way: bool = True) -> SchedulerPolicy:
    cache = ExpertCache(per_layer * LAYERS, policy="lru", scope="layer", n_layers=LAYERS)
    return SchedulerPolicy(cache, BackpressureController(mode="on", start=0.0), LookaheadPredictor(K, EXPERTS),
                           expert_nbytes=lambda key: NBYTES, prefetch_count=K, warm_inflight_bytes=window,
                           warm_run=run, warm_gives_way=gives_way)


def land_all(policy: SchedulerPolicy, actions: Actions) -> list[tuple[int, int]]:
    """Land reads until none is asked for; the keys read, in order."""
    keys = []
    while actions.reads:
        keys += [r.key for r in actions.reads]
        assert len(actions.reads) * NBYTES <= policy.warm_inflight_bytes
        actions = land(policy, actions)
    return keys


def test_warm_start_reads_every_key_into_free_slots_within_its_window() -> None:
    p = make_warm()
    keys = [(layer, e) for layer in range(LAYERS) for e in (0, 1, 2, 5)]
    first = p.start_warm(keys[::-1], 0.0)
    assert {r.kind for r in first.reads} == {"warm"} and len(first.reads) * NBYTES <= p.warm_inflight_bytes
    assert [r.key for r in first.reads] == sorted(r.key for r in first.reads)     # file order
    got = land_all(p, first)
    assert sorted(got) == sorted(keys) and p.warm_pending == 0 and p.reads_in_flight == 0
    assert all(p.cache.slot_of(k) is not None for k in keys)
    assert p.cache.stats.evictions == 0 and p.cache.stats.misses == 0 and p.stats.warm_reads == len(keys)


def test_warm_start_gives_way_to_demand_reads() -> None:
    p = make_warm()
    demand, urgent = p.on_route(1, [7], 0.0)
    assert [r.kind for r in urgent.reads] == ["demand"]
    assert p.start_warm([(2, 0), (2, 1)], 0.0).reads == []      # a demand read is in flight: nothing starts
    after = land(p, urgent)                                       # it lands: the warm start goes on
    assert [(r.kind, r.key) for r in after.reads] == [("warm", (2, 0)), ("warm", (2, 1))]
    assert consume(p, demand) == [7]
    p.on_end(demand, 0.0)


def test_warm_start_waits_out_a_prefill_and_goes_on_in_decode() -> None:
    p = make_warm()
    p.on_step(32, 0.0)                                            # a prefill: its read-ahead owns the disk
    assert p.start_warm([(2, 0), (2, 1)], 0.0).reads == []
    assert p.warm_pending == 2
    p.on_step(4, 0.0, sequences=4)                                # a decode step of four sequences
    demand, actions = p.on_route(0, [3], 0.0)
    after = land(p, actions)                                      # the demand read lands: warm reads start
    assert [(r.kind, r.key) for r in after.reads] == [("warm", (2, 0)), ("warm", (2, 1))]
    assert consume(p, demand) == [3]
    p.on_end(demand, 0.0)


def test_a_page_cache_warm_start_reads_whole_layers_beside_demand_and_waits_out_prompts() -> None:
    # The mmap reader's warm start: whole layers in file order, beside demand reads, two layers' bytes out at
    # once, refilled by halves; nothing new while a prompt runs.
    p = make_warm(per_layer=EXPERTS, window=2 * EXPERTS * NBYTES, run=EXPERTS, gives_way=False)
    p.on_step(32, 0.0)                                            # a prefill
    keys = [(layer, e) for layer in range(LAYERS) for e in range(EXPERTS)]
    assert p.start_warm(keys, 0.0).reads == [] and p.warm_pending == len(keys)
    p.on_step(1, 0.0)                                             # a decode step
    demand, urgent = p.on_route(0, [3], 0.0)
    first = land(p, urgent)                                       # an event: the warm start goes on
    assert [r.key for r in first.reads] == [(layer, e) for layer in (1, 2) for e in range(EXPERTS)]
    assert {r.kind for r in first.reads} == {"warm"}              # after the layer being routed, in file order
    assert consume(p, demand) == [3]
    p.on_end(demand, 0.0)
    demand, urgent = p.on_route(0, [4], 0.0)                      # a demand read out ...
    half = land(p, Actions(first.reads[:EXPERTS - 1]))
    assert half.reads == []                                       # not yet half the window landed
    rest = land(p, Actions(first.reads[EXPERTS - 1:EXPERTS]))     # ... and the warm start goes on beside it
    assert [r.key for r in rest.reads] == [(0, e) for e in range(EXPERTS) if e not in (3, 4)]
    land(p, urgent)
    assert consume(p, demand) == [4]
    p.on_end(demand, 0.0)
    assert p.cache.stats.evictions == 0 and p.stats.warm_skipped == 2


def test_a_demand_for_an_expert_the_warm_start_is_filling_waits_for_that_read() -> None:
    p = make_warm(per_layer=EXPERTS, window=2 * EXPERTS * NBYTES, run=EXPERTS, gives_way=False)
    warm_reads = p.start_warm([(0, e) for e in range(EXPERTS)], 0.0)
    demand, actions = p.on_route(0, [5], 0.0)
    assert actions.reads == []                                    # no second read of (0, 5)
    slot = next(r.slot for r in warm_reads.reads if r.key == (0, 5))
    assert p.next_event(demand) == Wait((slot,))
    land(p, warm_reads)
    assert consume(p, demand) == [5] and p.cache.stats.misses == 0


def test_the_warm_start_reads_what_prompts_nearly_chose_first_most_named_first() -> None:
    # A prompt's router ranked (2, 9) just past its choice three times, (0, 4) twice, (1, 7) once: after the
    # prompt those go first, most named first, then the runs in file order without them.
    p = make_warm(per_layer=EXPERTS, window=LAYERS * EXPERTS * NBYTES, run=EXPERTS, gives_way=False)
    p.on_step(32, 0.0)                                            # a prefill
    keys = [(layer, e) for layer in range(LAYERS) for e in range(EXPERTS)]
    assert p.start_warm(keys, 0.0).reads == []
    p.on_near_misses(0, [4, 4])
    p.on_near_misses(1, [7])
    p.on_near_misses(2, [9, 9, 9])
    p.on_step(1, 0.0)                                             # the first decoded token
    demand, urgent = p.on_route(0, [3], 0.0)
    after = land(p, urgent)
    named = [(2, 9), (0, 4), (1, 7)]
    assert [r.key for r in after.reads[:3]] == named and {r.kind for r in after.reads} == {"warm"}
    rest = [r.key for r in after.reads[3:]]
    assert rest == [(layer, e) for layer in (1, 2, 0) for e in range(EXPERTS) if (layer, e) not in [*named, (0, 3)]]
    assert consume(p, demand) == [3]
    p.on_end(demand, 0.0)


def test_a_near_miss_already_read_or_not_in_the_warm_list_is_not_read_again() -> None:
    p = make_warm(per_layer=EXPERTS, window=LAYERS * EXPERTS * NBYTES, run=EXPERTS, gives_way=False)
    warm(p, 0, [4])                                               # cached
    p.on_near_misses(0, [4, 4, 5])
    p.on_near_misses(2, [1])                                      # layer 2 is not in the warm list
    got = land_all(p, p.start_warm([(0, e) for e in range(6)], 0.0))
    assert got[0] == (0, 5) and sorted(got) == [(0, e) for e in (0, 1, 2, 3, 5)]
    assert p.stats.warm_skipped == 1 and p.cache.stats.evictions == 0


def test_warm_start_skips_what_is_cached_and_never_evicts() -> None:
    p = make_warm(per_layer=2)
    warm(p, 0, [1])
    got = land_all(p, p.start_warm([(0, 1), (0, 2), (0, 3)], 0.0))
    assert got == [(0, 2)]                                        # (0, 1) cached; (0, 3) finds its layer full
    assert p.stats.warm_skipped == 2 and p.cache.stats.evictions == 0
    assert p.cache.slot_of((0, 1)) is not None and p.cache.slot_of((0, 3)) is None


def test_a_prefill_reads_the_next_layers_whole_hint_into_free_slots_past_the_gate() -> None:
    p = make(per_layer=5, mode="off")                        # backpressure forbids every prefetch
    p.on_step(32, 0.0)                                        # a prefill: 32 positions
    p.on_route(0, [1], 0.0)
    ahead = p.on_hint(1, [9, 3, 4, 5, 6, 7, 8], 0.0)          # the union, most voted first
    assert [r.key for r in ahead.reads] == [(1, e) for e in (9, 3, 4, 5, 6)]  # as far as layer 1 has room
    assert {r.kind for r in ahead.reads} == {"prefetch"} and p.cache.stats.evictions == 0
    assert p.stats.ahead_reads == 5 and p.stats.prefetch_skipped_busy == 1
    land(p, ahead)
    demand, more = p.on_route(1, [3, 4, 5, 2], 0.0)           # 9 and 6 were wrong guesses
    assert [r.key for r in more.reads] == [(1, 2)] and more.dropped == [ahead.reads[0].slot]  # 9 goes first
    assert consume(p, demand) == [3, 4, 5] and p.cache.stats.prefetch_hits == 3


def test_without_read_ahead_or_in_decode_a_hint_reads_the_top_k() -> None:
    for p, positions in ((make(per_layer=5), 1), (make(per_layer=5), 32)):
        p.read_ahead = positions == 1
        p.on_step(positions, 0.0)
        p.on_route(0, [1], 0.0)
        assert [r.key for r in p.on_hint(1, [9, 3, 4, 5], 0.0).reads] == [(1, 9), (1, 3)]
        assert p.stats.ahead_reads == 0


def test_read_ahead_waits_while_a_request_waits_for_a_slot_then_goes() -> None:
    p = make(per_layer=2)
    p.on_step(32, 0.0)
    demand, actions = p.on_route(0, [1, 2, 3], 0.0)          # 3 waits for a slot of layer 0
    assert p.on_hint(1, [4, 5], 0.0).reads == []               # the demand read of 3 goes first
    assert land(p, actions).reads == []
    event = p.next_event(demand)
    assert isinstance(event, Ready) and event.expert == 1
    freed = p.on_used(event.slot, 0.0)                         # compute is done with 1: 3 takes its slot ...
    assert [(r.kind, r.key) for r in freed.reads] == [("demand", (0, 3)), ("prefetch", (1, 4)), ("prefetch", (1, 5))]
    assert p.stats.ahead_reads == 2                            # ... and the read-ahead goes behind it


def test_a_read_ahead_still_waiting_when_its_layer_routes_is_dropped() -> None:
    p = make(per_layer=1)
    p.on_step(32, 0.0)
    p.on_route(0, [1, 2], 0.0)                                 # 2 waits for layer 0's only slot
    p.on_hint(1, [4, 5], 0.0)
    demand, actions = p.on_route(1, [6], 0.0)                  # layer 1 is here before the read-ahead went
    assert [r.key for r in actions.reads] == [(1, 6)] and p.stats.ahead_reads == 0


def _state(p: SchedulerPolicy) -> tuple:
    """Everything a pass leaves behind that later decisions read: counters, recency, use counts, usage."""
    c = p.cache
    return (c.stats, p.stats, [list(g) for g in c._groups.values()], dict(c._uses),
            {k: v for k, v in c._crf.items()}, c._clock, p.usage.counts.tolist(), p._current_layer)


def test_a_pass_counted_at_once_leaves_the_policy_as_its_per_layer_requests_do() -> None:
    """on_routes (a one-graph decode step on resident experts) against on_route/on_used/on_end per layer."""
    passes = [[(0, [1, 4]), (1, [2, 3]), (2, [0, 5])], [(0, [4, 9]), (1, [2, 3]), (2, [5, 7])],
              [(0, [1, 9]), (1, [3, 8]), (2, [0, 7])]]
    first = [(layer, e) for route in passes for layer, es in route for e in es]
    policies = [make(per_layer=5, mode="off", usage=UsageHistory("test", LAYERS, EXPERTS)) for _ in range(2)]
    for p in policies:                       # the same misses first: every expert read once (in 0.1 s)
        for layer in range(LAYERS):
            experts = sorted({e for l, e in first if l == layer})
            demand, actions = p.on_route(layer, experts, 0.0)
            land(p, actions, 0.1)
            assert consume(p, demand) == experts
            p.on_end(demand, 0.1)
    per_layer, at_once = policies
    now = 1.0
    for route in passes * 2:
        per_layer.on_step(1, now)
        at_once.on_step(1, now)
        for layer, experts in route:
            demand, actions = per_layer.on_route(layer, experts, now)
            assert actions.reads == [] and consume(per_layer, demand) == experts
            per_layer.on_end(demand, now)
        assert at_once.on_routes(route, now).reads == []
        now += 1.0
    assert _state(at_once) == _state(per_layer)
    assert per_layer.cache.stats.cached_hits == 2 * 3 * 6


def test_a_pass_counted_at_once_refuses_an_expert_that_is_not_cached() -> None:
    p = make()
    with pytest.raises(ValueError, match="not cached"):
        p.on_routes([(0, [3])], 0.0)


def test_a_decode_step_of_several_sequences_prefetches_for_each_and_is_timed_as_a_decode_step() -> None:
    """B sequences, one position each: a decode step (the controller times it; no read-ahead, which is for a
    prefill), whose hint is the union of the streams' rankings: k candidates per sequence go to the gate (here one
    that takes them all; its cap on reads in flight still bounds them)."""
    p = make(per_layer=8, config=BackpressureConfig(max_prefetch_reads=16))
    p.on_step(3, 0.0, sequences=3)
    p.on_route(0, [1], 0.0)
    assert [r.key for r in p.on_hint(1, [9, 3, 4, 5, 6, 7, 8, 10], 0.0).reads] == [(1, e) for e in (9, 3, 4, 5, 6, 7)]
    assert p.stats.ahead_reads == 0
    p.on_step(3, 0.1, sequences=3)
    p.on_step(3, 0.2, sequences=3)
    assert p.backpressure.counters.decode_steps == 2
    p.on_step(32, 0.3)                                        # a prefill chunk in between: neither it nor the
    p.on_step(3, 0.4, sequences=3)                            # step it cut short is a timed decode step
    assert p.backpressure.counters.decode_steps == 2
    p.on_step(3, 0.5, sequences=3)
    assert p.backpressure.counters.decode_steps == 3
