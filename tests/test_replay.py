"""Replay of route traces: hand-computed hit counts per policy, batch-union, warm-up and pins,
lookahead prefetch, and the `replay` command."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from colibri_aio.errors import UserError
from colibri_aio.policy.replay import (
    ReplayConfig,
    Trace,
    replay,
    steps_from_records,
    warmup_boundary,
)
from support import run_cli

NBYTES = 1000


def rec(pos: int, layer: int, experts: list[int], phase: str = "decode", run: int = 0,
        predicted: list[int] | None = None) -> dict:
    r = {"kind": "route", "run": run, "phase": phase, "pos": pos, "token": 0, "layer": layer,
         "experts": experts, "weights": [1.0 / len(experts)] * len(experts)}
    if predicted is not None:
        r["predicted"] = {"oracle": predicted}
    return r


def one_layer_trace(sequence: list[int]) -> Trace:
    """A one-layer, top-1 model routing position i to sequence[i]."""
    steps = steps_from_records(rec(i, 0, [e]) for i, e in enumerate(sequence))
    return Trace(1, 8, 1, NBYTES, ("oracle",), steps)


CYCLE = [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize("policy,hits", [("lru", 0), ("lfu", 0), ("belady", 2)])
def test_cyclic_pattern_lru_thrashes_belady_does_not(policy: str, hits: int) -> None:
    # 3 keys cycling through 2 slots. LRU always evicts the key needed next. Belady: at the 3rd
    # access it evicts 1 (next used at 4, after 0 at 3), hits 0; evicts 0 (never again), hits 2.
    r = replay(one_layer_trace(CYCLE), ReplayConfig(policy=policy, cache_per_layer=2, warmup=0))
    assert (r.stats.hits, r.stats.misses) == (hits, 6 - hits)
    assert r.demand_bytes == (6 - hits) * NBYTES


def test_lfu_beats_lru_on_a_hot_key_with_scans() -> None:
    seq = [0, 0, 0, 1, 2, 0, 3, 4, 0]
    lru = replay(one_layer_trace(seq), ReplayConfig(policy="lru", cache_per_layer=2, warmup=0))
    lfu = replay(one_layer_trace(seq), ReplayConfig(policy="lfu", cache_per_layer=2, warmup=0))
    assert (lru.stats.hits, lfu.stats.hits) == (2, 4)


def test_belady_is_an_upper_bound() -> None:
    seq = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 0, 7, 2, 3, 1, 4, 1, 5, 2, 6]
    t = one_layer_trace(seq)
    best = replay(t, ReplayConfig(policy="belady", cache_per_layer=3, warmup=0)).stats.hits
    for policy in ("lru", "lfu", "lfru"):
        assert replay(t, ReplayConfig(policy=policy, cache_per_layer=3, warmup=0)).stats.hits <= best


def test_prefill_chunk_is_one_batch_union_step_per_layer() -> None:
    records = [rec(p, 0, e, "prefill") for p, e in enumerate([[0, 1], [1, 2], [0, 1]])]
    records += [rec(p, 1, [5, 6], "prefill") for p in range(3)]
    records += [rec(3, 0, [0, 3]), rec(3, 1, [5, 7])]
    steps = steps_from_records(records)
    assert [(s.layer, s.positions, s.experts) for s in steps] == [
        (0, (0, 1, 2), [0, 1, 2]), (1, (0, 1, 2), [5, 6]), (0, (3,), [0, 3]), (1, (3,), [5, 7])]
    r = replay(Trace(2, 8, 2, NBYTES, (), steps), ReplayConfig(policy="lru", cache_per_layer=4, warmup=0))
    assert (r.stats.lookups, r.stats.hits, r.positions_scored) == (9, 2, 4)


def test_prefill_as_decode_orders_positions_then_layers() -> None:
    records = [rec(p, layer, [p + layer], "prefill") for layer in range(2) for p in range(3)]
    records += [rec(3, 0, [9]), rec(3, 1, [9])]
    steps = steps_from_records(records, split_prefill=True)
    assert [(s.positions, s.layer) for s in steps] == [
        ((0,), 0), ((0,), 1), ((1,), 0), ((1,), 1), ((2,), 0), ((2,), 1), ((3,), 0), ((3,), 1)]
    assert [s.experts for s in steps[:4]] == [[0], [1], [1], [2]]


def test_warmup_is_not_scored_and_teaches_the_pins() -> None:
    # Warm-up: expert 7 is hot. Then 7 keeps coming back between scans that flush an LRU.
    seq = [7, 7, 7, 7] + [7, 1, 2, 3, 7, 4, 5, 6, 7, 1, 2, 3]
    t = one_layer_trace(seq)
    assert warmup_boundary(t.steps, 0.25) == 4
    lru = replay(t, ReplayConfig(policy="lru", cache_per_layer=2, warmup=0.25))
    pinned = replay(t, ReplayConfig(policy="pinned+lru", cache_per_layer=2, warmup=0.25, pin_fraction=0.5))
    assert lru.positions_scored == 12 and lru.stats.lookups == 12
    assert lru.stats.hits == 1                                    # only the first 7 (still cached)
    assert pinned.pinned == 1 and pinned.stats.pinned_hits == 3 and pinned.stats.cached_hits == 0


def test_pins_can_come_from_another_trace() -> None:
    evaluated = one_layer_trace([1, 2, 3, 4, 5, 6])
    pinned = replay(evaluated, ReplayConfig(policy="pinned+lru", cache_per_layer=2, warmup=0, pin_fraction=0.5),
                    pin_from=one_layer_trace([4, 4, 4, 5]))
    assert pinned.stats.pinned_hits == 1 and pinned.stats.misses == 5


def test_lookahead_prefetch_perfect_and_wrong_predictions() -> None:
    def trace(guess: list[int]) -> Trace:
        records = []
        for pos, (a, b) in enumerate([(1, 2), (3, 4), (5, 6)]):
            records += [rec(pos, 0, [a], predicted=guess or [b]), rec(pos, 1, [b])]
        return Trace(2, 8, 1, NBYTES, ("oracle",), steps_from_records(records))

    cfg = ReplayConfig(policy="lru", cache_per_layer=1, warmup=0, prefetch="oracle", prefetch_count=1)
    good = replay(trace([]), cfg)
    assert (good.stats.prefetch_hits, good.stats.misses, good.stats.prefetch_wasted) == (3, 3, 0)
    assert good.prefetch["recall"] == 1.0 and good.prefetch["precision"] == 1.0
    bad = replay(trace([7]), cfg)
    # (1, 7) is read at every position and evicted unused by the true expert each time.
    assert (bad.stats.prefetch_hits, bad.stats.misses, bad.stats.prefetch_reads) == (0, 6, 3)
    assert bad.stats.prefetch_wasted == 3 and bad.wasted_bytes == 3 * NBYTES
    assert bad.prefetch["recall"] == 0.0


@pytest.mark.parametrize("demote,layer1_hits", [(False, 0), (True, 4)])
def test_demoting_unused_prefetches_keeps_wrong_guesses_from_flushing_the_cache(demote: bool,
                                                                                layer1_hits: int) -> None:
    # Layer 1 alternates experts 0 and 1 (3 slots would hold them); each position also prefetches a
    # new wrong guess. Inserted as most recent and left there, guesses push 0 and 1 out every time;
    # demoted once their layer ran, each guess is the next prefetch's victim and 0, 1 stay.
    records = []
    for pos in range(6):
        records += [rec(pos, 0, [7], predicted=[pos + 10]), rec(pos, 1, [pos % 2])]
    t = Trace(2, 32, 1, NBYTES, ("oracle",), steps_from_records(records))
    r = replay(t, ReplayConfig(policy="lru", cache_per_layer=3, warmup=0, prefetch="oracle", prefetch_count=1,
                               demote=demote))
    assert r.stats.hits == 5 + layer1_hits    # layer 0 hits expert 7 after its first use


def test_per_layer_scope_keeps_layers_apart() -> None:
    # Layer 0 scans 4 new experts per position, layer 1 reuses one. With 4 slots shared, each
    # scan flushes layer 1's entry; with 2 slots per layer, layer 1 keeps it.
    records = []
    for pos in range(6):
        records += [rec(pos, 0, list(range(4 * pos, 4 * pos + 4))), rec(pos, 1, [0])]
    t = Trace(2, 32, 4, NBYTES, (), steps_from_records(records))
    per_layer = replay(t, ReplayConfig(policy="lru", cache_per_layer=2, scope="layer", warmup=0))
    shared = replay(t, ReplayConfig(policy="lru", cache_per_layer=2, scope="global", warmup=0))
    assert per_layer.stats.hits == 5 and shared.stats.hits == 0


def test_bad_options_are_user_errors() -> None:
    t = one_layer_trace(CYCLE)
    for cfg in (ReplayConfig(policy="mru"), ReplayConfig(cache_per_layer=0), ReplayConfig(warmup=1.0),
                ReplayConfig(prefetch="nope")):
        with pytest.raises(UserError):
            replay(t, cfg)


def write_trace(path: Path, sequence: list[int]) -> None:
    header = {"kind": "header", "format": "colibri-aio-route-trace", "version": 1, "model": "m",
              "block_count": 1, "expert_count": 8, "expert_used_count": 1, "expert_nbytes": NBYTES,
              "predictors": []}
    lines = [header] + [rec(i, 0, [e]) for i, e in enumerate(sequence)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_replay_command(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, CYCLE)
    done = run_cli("replay", str(path), "--cache-per-layer", "2", "--policy", "lru,belady", "--warmup", "0",
                   "--json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)["results"]
    assert [(r["policy"], r["hits"], r["demand_bytes"]) for r in rows] == [("lru", 0, 6000), ("belady", 2, 4000)]
    table = run_cli("replay", str(path), "--cache-per-layer", "1,2", "--policy", "all", "--warmup", "0")
    assert table.returncode == 0, table.stderr
    rows = [line.split() for line in table.stdout.splitlines()[2:]]
    assert len(rows) == 2 * 5
    assert [r[4] for r in rows if r[0] == "belady"] == ["0.000", "0.333"]   # hit rate at N = 1, 2


def test_replay_command_refuses_bad_input(tmp_path: Path) -> None:
    missing = run_cli("replay", str(tmp_path / "none.jsonl"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format": "other"}\n')
    assert run_cli("replay", str(bad)).returncode == 2
    good = tmp_path / "t.jsonl"
    write_trace(good, CYCLE)
    assert run_cli("replay", str(good), "--policy", "fifo").returncode == 2
