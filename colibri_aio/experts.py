"""Where routed experts live in the GGUF, and the interface compute uses to get their bytes.

In a GGUF, ``blk.L.ffn_{gate,up,down}_exps`` are stacked with the expert axis
outermost, so one expert's slice of each is one contiguous byte range: three
ranges per expert. The forward pass asks an :class:`ExpertSource` for the
experts a layer routed to and never learns where the bytes came from (mmap,
RAM, or a buffer-pool slot filled by io_uring).
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from gguf import GGMLQuantizationType

from colibri_aio.kernels.qtensor import QTensor

PROJECTIONS = ("gate", "up", "down")


@dataclass(frozen=True, slots=True)
class TensorRange:
    """One expert's slice of one stacked tensor: ``nbytes`` at absolute ``offset`` in the model's file ``file``."""

    offset: int
    nbytes: int
    ggml_type: GGMLQuantizationType
    shape: tuple[int, int]  # NumPy order (rows, cols); cols is the quantised axis
    file: int = 0           # index of the part holding it (0 for a model in one file)


@dataclass(frozen=True, slots=True)
class ExpertLocation:
    """The three byte ranges of routed expert ``expert`` in block ``layer``."""

    layer: int
    expert: int
    gate: TensorRange  # (expert_feed_forward_length, embedding_length)
    up: TensorRange    # (expert_feed_forward_length, embedding_length)
    down: TensorRange  # (embedding_length, expert_feed_forward_length)

    @property
    def ranges(self) -> tuple[TensorRange, TensorRange, TensorRange]:
        return (self.gate, self.up, self.down)

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """Views of one expert's three matrices; valid only while their lease is held."""

    gate: QTensor
    up: QTensor
    down: QTensor


@dataclass(frozen=True, slots=True, eq=False)
class ResidentExperts:
    """Every expert a source holds, seen as one stack per matrix and layer, with a table of which are in.

    Expert ``e`` of MoE layer ``l`` whose ``ready[l, e]`` is True has its gate,
    up and down matrices at ``bases[l][i] + slots[l, e] * strides[l][i]`` for
    ``slots[l, e]`` < ``depth``: a buffer pool's slots, one stride apart, each
    expert of a layer at the same offsets in its slot; or a mapping of the
    file, where each matrix is one stacked tensor and the stack index is the
    expert's id. The source keeps both
    arrays current: an entry is ready only once its bytes have landed, and
    stops being ready before its slot is given to another read. A kernel graph
    may thus pick its experts by these arrays without asking the source, as
    long as nothing reads into the pool while it runs and the caller then
    checks ``ready`` for each expert it used.
    """

    slots: np.ndarray                      # (layers, experts) int32: stack index (0 where not ready)
    ready: np.ndarray                      # (layers, experts) bool
    bases: tuple[tuple[int, int, int], ...]   # per layer: gate, up, down address of stack index 0
    strides: tuple[tuple[int, int, int], ...]  # per layer: gate, up, down bytes from one stack index to the next
    depth: int
    # Every expert has its place (the file's own pages): one not ready is one not read yet, soon to be,
    # rather than one the cache may never hold.
    holds_all: bool = False


ExpertBatch = list[tuple[int, ExpertWeights]]  # (expert id, views of its bytes), as a source yields them


class ExpertSource(Protocol):
    """Delivers routed experts' bytes to the MoE layer.

    ``stream(layer, experts)`` yields batches of ``(expert, weights)``, each
    requested expert exactly once, in whatever order the bytes become ready:
    every expert ready at that moment in one batch (cached ones first), so the
    kernels can run a batch in one call. The views in a batch stay valid only
    until the iterator is advanced again or closed: the consumer finishes with
    them before asking for the next batch. Compute must therefore not depend on
    arrival order or batching (the MoE layer sums expert outputs in routing
    order, and a backend's output for an expert does not depend on the others
    in its batch, so placement never changes the result).
    """

    def stream(self, layer: int, experts: Sequence[int]) -> AsyncIterator[ExpertBatch]: ...

    def hint(self, layer: int, experts: Sequence[int]) -> None:
        """A prediction that ``layer`` will soon ask for ``experts`` (may be ignored)."""
        ...

    def step(self, positions: int, sequences: int = 1) -> None:
        """A forward pass over ``positions`` positions of ``sequences`` sequences begins (one position of
        each: a decode step); lets a scheduler time decode steps (may be ignored)."""
        ...

    def near_misses(self, layer: int, experts: Sequence[int]) -> None:
        """A prompt's router ranked ``experts`` of ``layer`` just past the ones it chose, one per position and
        rank: a warm start may read the most often named first (may be ignored)."""
        ...

    def resident(self, layers: Sequence[int], n_experts: int) -> ResidentExperts | None:
        """Every expert of ``layers`` this source holds, as one stack per matrix and layer with the table of
        which are in (:class:`ResidentExperts`), for a kernel graph to pick its experts from; None when its
        experts are not in one strided pool (a graph then asks :meth:`stream` for them)."""
        ...

    @property
    def reading(self) -> bool:
        """Whether a read is in flight (its end waits for the event loop to run its callbacks)."""
        ...

    def routed(self, routes: Sequence[tuple[int, Sequence[int]]]) -> None:
        """A forward pass used only experts it picked through :meth:`resident`'s table: each layer's unique
        experts (ascending), to be counted as :meth:`stream` would have counted them."""
        ...

    @property
    def misses(self) -> int:
        """Experts asked for by :meth:`stream` so far that were not resident (0 for a source without a cache)."""
        ...

    async def aclose(self) -> None: ...
