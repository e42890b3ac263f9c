"""Expert locations over any file, for benchmarks and tests that need no model.

A real GGUF puts an expert's gate, up and down slices in three different
stacked tensors, so its three ranges are far apart in the file; these
helpers do the same with random or sequential placement.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from colibri_aio.experts import ExpertLocation, TensorRange
from colibri_aio.io.align import ALIGN
from colibri_aio.kernels.qtensor import QTensor


def byte_range(offset: int, nbytes: int) -> TensorRange:
    """A range of ``nbytes`` raw bytes (I8, one row) at ``offset``."""
    return TensorRange(offset, nbytes, GGMLQuantizationType.I8, (1, nbytes))


def split_expert(expert_nbytes: int, align: int = ALIGN) -> tuple[int, int, int]:
    """Split an expert's bytes into three aligned parts (gate, up, down), the last taking the rest."""
    part = max(align, expert_nbytes // 3 // align * align)
    return part, part, expert_nbytes - 2 * part


def bench_locations(file_size: int, expert_nbytes: int, count: int, pattern: str,
                    rng: np.random.Generator, align: int = ALIGN) -> list[ExpertLocation]:
    """``count`` experts of ``expert_nbytes`` whose ranges are placed randomly or one after another.

    ``rand``: each range starts at an independent random aligned offset (the
    three projections of a real expert live in three different tensors).
    ``seq``: ranges follow each other through the file, wrapping at the end.
    """
    sizes = split_expert(expert_nbytes, align)
    if expert_nbytes > file_size:
        raise ValueError(f"an expert of {expert_nbytes} bytes does not fit in a {file_size}-byte file")
    locations = []
    cursor = 0
    for index in range(count):
        ranges = []
        for size in sizes:
            if pattern == "rand":
                offset = int(rng.integers(0, (file_size - size) // align + 1)) * align
            elif pattern == "seq":
                if cursor + size > file_size:
                    cursor = 0
                offset, cursor = cursor, cursor + size
            else:
                raise ValueError(f"unknown access pattern {pattern!r}; choose rand or seq")
            ranges.append(byte_range(offset, size))
        locations.append(ExpertLocation(0, index, *ranges))
    return locations


def random_locations(file_size: int, count: int, rng: np.random.Generator,
                     ggml_type: GGMLQuantizationType = GGMLQuantizationType.Q8_0,
                     shape: tuple[int, int] = (32, 64), offset_align: int = 32) -> list[ExpertLocation]:
    """``count`` experts of gate/up ``shape`` and down ``shape[::-1]`` at random ``offset_align``-aligned offsets."""
    rows, cols = shape
    gate_nbytes = QTensor.nbytes_for(ggml_type, (rows, cols))
    down_shape = (cols, rows)
    down_nbytes = QTensor.nbytes_for(ggml_type, down_shape)
    locations = []
    for index in range(count):
        offsets = [int(rng.integers(0, (file_size - n) // offset_align + 1)) * offset_align
                   for n in (gate_nbytes, gate_nbytes, down_nbytes)]
        locations.append(ExpertLocation(
            index % 4, index,
            TensorRange(offsets[0], gate_nbytes, ggml_type, (rows, cols)),
            TensorRange(offsets[1], gate_nbytes, ggml_type, (rows, cols)),
            TensorRange(offsets[2], down_nbytes, ggml_type, down_shape)))
    return locations
