"""Expert parallelism on paper: placements, and the bytes and time a layer's remote experts cost."""
import pytest

from colibri_aio.policy.expert_parallel import (
    ID_WEIGHT_BYTES, Link, balanced, expert_counts, host_loads, round_robin, traffic)
from colibri_aio.policy.replay import Step


def step(layer: int, *routes: tuple[int, ...], run: int = 0) -> Step:
    return Step(run=run, layer=layer, positions=tuple(range(len(routes))), routes=tuple(routes), predicted={})


LINK = Link(bandwidth_bytes_s=1000.0, rtt_s=0.5, activation_bytes=2)


def test_round_robin_puts_expert_e_on_host_e_mod_hosts_in_every_layer():
    assert round_robin(2, 5, 2) == [[0, 1, 0, 1, 0], [0, 1, 0, 1, 0]]


def test_balanced_spreads_the_uses_so_no_host_carries_much_more_than_another():
    counts = [[10, 9, 1, 1, 1, 0], [0, 0, 0, 0, 5, 5]]
    placement = balanced(counts, 2)
    assert sorted(placement[0][:2]) == [0, 1]          # the two busy experts apart
    assert placement[1][4] != placement[1][5]
    for layer, where in zip(counts, placement):
        load = [sum(n for e, n in enumerate(layer) if where[e] == h) for h in range(2)]
        assert max(load) - min(load) <= max(layer)


def test_a_layer_whose_experts_are_all_at_home_costs_nothing():
    t = traffic([step(0, (0, 2))], round_robin(1, 4, 2), hosts=2, hidden=4, link=LINK)
    assert (t.positions, t.round_trips, t.home_sent, t.home_received, t.seconds) == (1, 0, 0, 0, 0.0)


def test_one_remote_host_is_one_message_each_way_with_the_ids_and_weights():
    # hidden 4 x 2 bytes = 8 bytes each way, plus 8 bytes (id, weight) per expert sent there
    t = traffic([step(0, (0, 1, 3))], round_robin(1, 4, 2), hosts=2, hidden=4, link=LINK)
    assert t.remote_messages == 1 and t.remote_experts == 2
    assert t.home_sent == 8 + 2 * ID_WEIGHT_BYTES and t.home_received == 8
    assert t.seconds == pytest.approx(0.5 + (24 + 8) / 1000.0)
    assert t.busiest_remote_sent == 8


def test_remote_hosts_of_a_layer_share_one_round_trip_and_home_link_carries_all():
    t = traffic([step(0, (1, 2, 3))], round_robin(1, 4, 4), hosts=4, hidden=4, link=LINK)
    assert t.round_trips == 1 and t.remote_messages == 3
    assert t.home_sent == 3 * (8 + ID_WEIGHT_BYTES) and t.home_received == 3 * 8
    assert t.seconds == pytest.approx(0.5 + (t.home_sent + t.home_received) / 1000.0)


def test_positions_are_counted_once_each_over_layers_and_runs():
    steps = [step(0, (0,), (1,)), step(1, (1,), (1,)), step(0, (3,), run=1), step(1, (2,), run=1)]
    t = traffic(steps, round_robin(2, 4, 2), hosts=2, hidden=4, link=LINK)
    assert t.positions == 3 and t.layers == 6
    assert t.round_trips == 4                     # (0,L0) home; (1,L0), (0,L1), (1,L1), (2,L0) away; (2,L1) home
    assert t.per_token(t.home_received) == pytest.approx(4 * 8 / 3)


def test_one_host_sends_nothing():
    steps = [step(0, (0, 1, 2, 3)), step(1, (3, 2))]
    t = traffic(steps, round_robin(2, 4, 1), hosts=1, hidden=4, link=LINK)
    assert (t.round_trips, t.home_sent, t.seconds, t.busiest_remote_sent) == (0, 0, 0.0, 0)


def test_counts_and_host_loads_add_up_to_every_routing():
    steps = [step(0, (0, 1), (1, 2)), step(1, (3, 0), (0, 1))]
    counts = expert_counts(steps, block_count=2, expert_count=4)
    assert counts == [[1, 2, 1, 0], [2, 1, 0, 1]]
    loads = host_loads(counts, round_robin(2, 4, 2), 2)
    assert loads == [1 + 1 + 2, 2 + 1 + 1] and sum(loads) == 8
