"""EngineStats: an engine's cumulative counters at one moment, the numbers telemetry and the API show."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Cumulative counters of an engine at time ``t`` (monotonic seconds)."""

    t: float
    prompt_tokens: int
    generated_tokens: int
    prefill_s: float
    decode_s: float
    pinned_hits: int
    cached_hits: int
    prefetch_hits: int
    misses: int
    prefetch_reads: int
    prefetch_wasted: int
    prefetch_wasted_bytes: int
    prefetch_on: bool
    prefetch_reason: str
    lookahead_recall: float
    lookahead_precision: float
    bytes_read: int        # expert bytes delivered by the reader
    io_bytes: int          # bytes asked of the disk (aligned supersets)
    reads_in_flight: int
    slots_used: int
    slots_total: int
    read_busy_s: float     # wall time with at least one expert read in flight
    rss: int
    peak_rss: int
    prompt_tokens_cached: int = 0  # prompt tokens found in the KV cache (not prefilled; not in prompt_tokens)
    sequences_busy: int = 0        # sequence slots holding a generation now
    sequences_total: int = 1       # sequence slots (--parallel)
    batch_steps: int = 0           # decode steps of the parallel engine (each over every decoding stream)
    batch_rows: int = 0            # streams those steps carried, summed
    batch_last_rows: int = 0       # streams in the last step
    batch_union: int = 0           # distinct experts MoE blocks read in batched steps of several streams, summed
    batch_union_blocks: int = 0    # ... over so many (step, MoE block) pairs

    @property
    def lookups(self) -> int:
        return self.pinned_hits + self.cached_hits + self.prefetch_hits + self.misses

    @property
    def hit_rate(self) -> float:
        return (self.lookups - self.misses) / self.lookups if self.lookups else 0.0

    @property
    def batch_rows_mean(self) -> float:
        """Streams per decode step of the parallel engine, on average."""
        return self.batch_rows / self.batch_steps if self.batch_steps else 0.0

    @property
    def batch_union_mean(self) -> float:
        """Distinct experts a MoE block read per step of several streams, on average (k of one stream at most
        k x streams)."""
        return self.batch_union / self.batch_union_blocks if self.batch_union_blocks else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hit_rate, "batch_rows_mean": self.batch_rows_mean,
                "batch_union_mean": self.batch_union_mean}
