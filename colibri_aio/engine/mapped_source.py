"""An expert source that reads straight from an mmap of the GGUF: the page cache decides.

This is how llama.cpp reaches its weights. It needs no buffer pool and is the
reference for the streaming sources: every other source must give the same bytes.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import numpy as np

from colibri_aio.experts import ExpertBatch, ExpertLocation, ExpertWeights
from colibri_aio.gguf.model import Model
from colibri_aio.kernels.qtensor import QTensor


def weights_from(maps: list[np.ndarray], loc: ExpertLocation) -> ExpertWeights:
    """QTensor views of ``loc``'s three ranges inside ``maps``, the bytes of each of the model's files."""
    gate, up, down = (QTensor(maps[r.file][r.offset: r.offset + r.nbytes], r.ggml_type, r.shape)
                      for r in loc.ranges)
    return ExpertWeights(gate, up, down)


class MappedExpertSource:
    """Zero-copy expert views into a read-only mmap of each of the model's files."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self._maps: list[np.ndarray] | None = [np.memmap(p, dtype=np.uint8, mode="r") for p in model.paths]
        self.bytes_served = 0

    async def stream(self, layer: int, experts: Sequence[int]) -> AsyncIterator[ExpertBatch]:
        """Every expert in one batch: mapped bytes are always "ready" (the page cache faults them in)."""
        assert self._maps is not None, "source is closed"
        batch = []
        for expert in experts:
            loc = self.model.experts[layer][expert]
            self.bytes_served += loc.nbytes
            batch.append((expert, weights_from(self._maps, loc)))
        yield batch

    def hint(self, layer: int, experts: Sequence[int]) -> None:
        """The page cache does its own read-ahead; a hint changes nothing here."""

    def step(self, positions: int, sequences: int = 1) -> None:
        """Nothing here is steered by step times."""

    def near_misses(self, layer: int, experts: Sequence[int]) -> None:
        """Nothing is warmed here: every expert is mapped."""

    def resident(self, layers: Sequence[int], n_experts: int) -> None:
        """Mapped experts are not one pool of slots: a graph asks :meth:`stream` for them."""
        return None

    @property
    def reading(self) -> bool:
        return False

    def routed(self, routes: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Never called: :meth:`resident` offers no table to pick from."""

    @property
    def misses(self) -> int:
        """Every mapped expert is at hand: none is missed."""
        return 0

    async def aclose(self) -> None:
        self._maps = None
