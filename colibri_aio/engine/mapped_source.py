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


def weights_from(buf: np.ndarray, loc: ExpertLocation, base: int = 0) -> ExpertWeights:
    """QTensor views of ``loc``'s three ranges inside ``buf``, which holds file byte ``base`` at index 0."""
    gate, up, down = (QTensor(buf[r.offset - base: r.offset - base + r.nbytes], r.ggml_type, r.shape)
                      for r in loc.ranges)
    return ExpertWeights(gate, up, down)


class MappedExpertSource:
    """Zero-copy expert views into a read-only mmap of the model file."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self._map: np.ndarray | None = np.memmap(model.path, dtype=np.uint8, mode="r")
        self.bytes_served = 0

    async def stream(self, layer: int, experts: Sequence[int]) -> AsyncIterator[ExpertBatch]:
        """Every expert in one batch: mapped bytes are always "ready" (the page cache faults them in)."""
        assert self._map is not None, "source is closed"
        batch = []
        for expert in experts:
            loc = self.model.experts[layer][expert]
            self.bytes_served += loc.nbytes
            batch.append((expert, weights_from(self._map, loc)))
        yield batch

    def hint(self, layer: int, experts: Sequence[int]) -> None:
        """The page cache does its own read-ahead; a hint changes nothing here."""

    def step(self, positions: int) -> None:
        """Nothing here is steered by step times."""

    async def aclose(self) -> None:
        self._map = None
