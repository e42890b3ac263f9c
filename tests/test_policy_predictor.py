"""LookaheadPredictor: recall/precision counters and how many candidates to prefetch."""
from __future__ import annotations

import pytest

from colibri_aio.policy.predictor import LookaheadPredictor


def test_recall_and_precision_of_prefetched_ids() -> None:
    p = LookaheadPredictor(2, min_samples=100)
    assert p.predicted(1, [4, 5, 6, 7]) == [4, 5]          # warm-up: k candidates
    p.observed(1, [5, 9])
    assert p.predicted(2, [1, 2, 3, 0]) == [1, 2]
    p.observed(2, [1, 2])
    s = p.score
    assert (s.predictions, s.true_experts, s.prefetched, s.used) == (2, 4, 4, 3)
    assert s.recall == pytest.approx(3 / 4) and s.precision == pytest.approx(3 / 4)
    assert s.recall_at_k == pytest.approx(3 / 4)


def test_observation_without_prediction_is_ignored_and_targets_are_separate() -> None:
    p = LookaheadPredictor(1, min_samples=100)
    p.observed(3, [1])
    p.predicted((0, 2), [7, 8])
    p.predicted((1, 2), [8, 7])
    p.observed((1, 2), [8])
    p.observed((0, 2), [8])
    assert p.score.predictions == 2 and p.score.used == 1


def test_rank_precision_drives_the_count() -> None:
    # Ranks 0-2 always hit, rank 3 hits half the time, ranks 4-5 never.
    p = LookaheadPredictor(2, max_candidates=6, min_samples=4, precision_bar=0.6, headroom_bar=0.4)
    for i in range(8):
        p.predicted(i, [0, 1, 2, 3, 4, 5])
        p.observed(i, [0, 1, 2] + ([3] if i % 2 else []))
    assert list(p.rank_precision()) == [1, 1, 1, 0.5, 0, 0]
    assert p.prefetch_count(headroom=False) == 3       # rank 3 (50%) is below 0.6
    assert p.prefetch_count(headroom=True) == 4        # but above 0.4 with an idle disk
    assert len(p.predicted(99, [0, 1, 2, 3, 4, 5], headroom=True)) == 4


def test_near_chance_predictions_prefetch_fewer_than_k() -> None:
    p = LookaheadPredictor(2, min_samples=4)
    for i in range(10):
        p.predicted(i, [0, 1, 2, 3])
        p.observed(i, [0, 5] if i % 5 == 0 else [6, 7])   # rank 0 right 20% of the time
    assert p.prefetch_count() == 0 and p.prefetch_count(headroom=True) == 0


def test_fixed_count_and_reset() -> None:
    p = LookaheadPredictor(2, min_samples=1)
    assert p.predicted(0, [1, 2, 3, 4], count=3) == [1, 2, 3]
    p.observed(0, [1, 2])
    p.reset_counters()
    assert p.score.predictions == 0 and p.prefetch_count() == 2   # rank statistics are kept
    p.predicted(1, [1, 2])
    p.discard(1)
    p.observed(1, [1, 2])
    assert p.score.predictions == 0


def test_the_bar_is_at_least_twice_chance() -> None:
    # Every rank hits 40% of the time: above the idle-disk bar of 0.25, but with k / E = 0.25
    # that is barely better than guessing, and twice chance (0.5) is the floor.
    def train(p: LookaheadPredictor) -> LookaheadPredictor:
        for i in range(10):
            p.predicted(i, [0, 1, 2, 3])
            p.observed(i, [0, 1, 2, 3] if i % 5 < 2 else [4, 5, 6, 7])
        return p

    assert train(LookaheadPredictor(2, min_samples=4)).prefetch_count(headroom=True) == 4
    assert train(LookaheadPredictor(2, 8, min_samples=4)).prefetch_count(headroom=True) == 0
    assert train(LookaheadPredictor(2, 64, min_samples=4)).prefetch_count(headroom=True) == 4
