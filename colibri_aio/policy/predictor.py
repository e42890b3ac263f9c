"""Router-lookahead bookkeeping: how good the predictions are, and how many to prefetch.

While layer L computes, the forward pass applies router L+1 to a hidden state
of layer L and ranks candidate experts for layer L+1. This object receives
that ranking, later the experts layer L+1 really routed to, and keeps the
counters: recall (share of true experts that were prefetched) and precision
(share of prefetched experts that were used), plus the hit rate of each rank
of the ranking.

How many to prefetch. The engine's scheduler policy reads a fixed k
candidates (in replays of the trained model the adaptive count below read
1.7-2.1x the bytes and lost hit rate below 8 slots per layer:
evidence/replay_colibri_tiny.md, "What prefetch costs"); the replay can size
the set adaptively instead. There the i-th ranked candidate is worth a read
when the chance that it is used — its rank's measured precision — is high
enough. A wrong prefetch costs a disk read and a slot (it evicts an entry that
might have hit); on an idle disk (the caller says ``headroom``; the replay,
whose reads are instant, always does) the read is nearly free, so a lower bar
applies. The count is the longest prefix of ranks whose precision clears the
bar: it can be below k (predictions near chance, as on a random-weight model)
or above k (a good predictor whose ranks k+1.. still hit often). The bar is
never below ``min_lift`` times chance (k / expert_count, what a random guess
hits), so a predictor barely better than guessing reads nothing. Until
``min_samples`` predictions have been scored the count is k.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class LookaheadScore:
    """Counters of one predictor so far."""

    predictions: int      # predictions scored against the truth
    true_experts: int     # sum of |truth|
    prefetched: int       # sum of |prefetched|
    used: int             # sum of |prefetched ∩ truth|
    recall_at_k: float    # |top-k ∩ truth| / |truth|, whatever was prefetched

    @property
    def recall(self) -> float:
        return self.used / self.true_experts if self.true_experts else 0.0

    @property
    def precision(self) -> float:
        return self.used / self.prefetched if self.prefetched else 0.0


class LookaheadPredictor:
    """Scores next-layer predictions against the truth and sizes the prefetch set."""

    def __init__(self, expert_used_count: int, expert_count: int | None = None, *,
                 max_candidates: int | None = None, min_samples: int = 32, precision_bar: float = 0.5,
                 headroom_bar: float = 0.25, min_lift: float = 2.0) -> None:
        """``max_candidates``: longest ranking considered (default 2k, what the trace records)."""
        self.k = expert_used_count
        self.chance = expert_used_count / expert_count if expert_count else 0.0
        self.min_lift = min_lift
        self.max_candidates = max_candidates or 2 * expert_used_count
        self.min_samples, self.precision_bar, self.headroom_bar = min_samples, precision_bar, headroom_bar
        self._rank_hits = np.zeros(self.max_candidates, np.int64)
        self._rank_seen = np.zeros(self.max_candidates, np.int64)
        self._pending: dict[Hashable, tuple[list[int], list[int]]] = {}  # target -> (ranked, chosen)
        self._predictions = self._true = self._prefetched = self._used = self._hits_at_k = 0

    def prefetch_count(self, headroom: bool = False) -> int:
        """How many of the top-ranked candidates to prefetch (see the module docstring)."""
        if self._rank_seen[0] < self.min_samples:
            return self.k
        bar = max(self.headroom_bar if headroom else self.precision_bar, self.min_lift * self.chance)
        precision = self.rank_precision()
        below = np.flatnonzero(precision < bar)
        return int(below[0]) if below.size else self.max_candidates

    def rank_precision(self) -> np.ndarray:
        """For each rank, the share of predictions whose candidate at that rank was used."""
        return self._rank_hits / np.maximum(self._rank_seen, 1)

    def predicted(self, target: Hashable, ranked: Sequence[int], headroom: bool = False,
                  count: int | None = None) -> list[int]:
        """Record a ranking for ``target`` and return the ids to prefetch.

        That is the top :meth:`prefetch_count` candidates, or the top
        ``count`` when the caller fixes the number.

        ``target`` names the routing decision being predicted: the layer in
        decode, ``(position, layer)`` when several positions are in flight.

        The caller still skips ids already cached; they count as prefetched
        here because the prediction, not the cache, is being scored.
        """
        scored = [int(x) for x in ranked[: self.max_candidates]]     # rank statistics keep their length
        # ``count`` may reach past them: a decode step of several sequences hints the union of their rankings.
        chosen = [int(x) for x in ranked[: self.prefetch_count(headroom) if count is None else count]]
        self._pending[target] = (scored, chosen)
        return chosen

    def observed(self, target: Hashable, experts: Sequence[int]) -> None:
        """The experts ``target`` really routed to; scores the pending prediction for it, if any."""
        pending = self._pending.pop(target, None)
        if pending is None:
            return
        ranked, chosen = pending
        truth = {int(x) for x in experts}
        hits = np.fromiter((x in truth for x in ranked), bool, len(ranked))
        self._rank_seen[: len(ranked)] += 1
        self._rank_hits[: len(ranked)] += hits
        self._predictions += 1
        self._true += len(truth)
        self._prefetched += len(chosen)
        self._used += len(truth.intersection(chosen))
        self._hits_at_k += int(hits[: self.k].sum())

    def reset_counters(self) -> None:
        """Zero recall/precision counters (e.g. after a warm-up); rank statistics and pending predictions stay."""
        self._predictions = self._true = self._prefetched = self._used = self._hits_at_k = 0

    def discard(self, target: Hashable) -> None:
        """Forget an unscored prediction (the step was abandoned)."""
        self._pending.pop(target, None)

    @property
    def score(self) -> LookaheadScore:
        return LookaheadScore(self._predictions, self._true, self._prefetched, self._used,
                              self._hits_at_k / self._true if self._true else 0.0)
