"""Coalesced expert reads: runs of neighbouring experts read with one request per projection, byte-exact
whether their boundaries fall on aligned blocks or inside them, on every backend that fills pool slots."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from colibri_aio.errors import ExpertReadError
from colibri_aio.experts import ExpertLocation, TensorRange
from colibri_aio.io import ExpertReader
from colibri_aio.io.align import ALIGN, plan_expert
from colibri_aio.io.spans import adjacent, plan_span, runs

from test_io_reader import assert_exact
from support import requires_uring

pytestmark = requires_uring

EXPERTS = 12


def stacked_layer(start: int, rows: int, cols: int) -> list[ExpertLocation]:
    """One layer's experts as GGUF stacks them: gate, up and down tensors one after another from ``start``."""
    per = rows * cols // 32 * 34  # Q8_0
    tensors = [start + k * (EXPERTS * per + 96) for k in range(3)]  # 32-byte aligned, not 4096
    return [ExpertLocation(0, x, *(TensorRange(t + x * per, per, T.Q8_0, (rows, cols) if k < 2 else (cols, rows))
                                   for k, t in enumerate(tensors)))
            for x in range(EXPERTS)]


# 64 x 256 Q8_0: 17408 bytes per range, not a multiple of 4096 (boundaries anywhere in a block);
# 128 x 1024 Q8_0: 139264 = 34 blocks (every boundary at the tensor's own misalignment).
SHAPES = {"unaligned": (64, 256), "block_multiple": (128, 1024)}


@pytest.fixture
def layer_file(tmp_path: Path) -> Path:
    path = tmp_path / "layer.bin"
    path.write_bytes(np.random.default_rng(11).bytes(8 << 20))
    return path


@pytest.mark.parametrize("shape", SHAPES)
def test_a_run_is_one_read_per_projection_back_to_back(shape: str) -> None:
    locs = stacked_layer(4096 * 3 + 160, *SHAPES[shape])
    plans = [plan_expert(loc) for loc in locs]
    assert all(adjacent(a, b) for a, b in zip(locs, locs[1:]))
    assert runs(locs, plans) == [list(range(EXPERTS))]
    assert runs(locs, plans, max_run=5) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11]]
    for p in range(3):
        span = plan_span(plans, p)
        reads = [pl.reads[p] for pl in plans]
        assert span.file_offset == reads[0].file_offset and span.file_offset % ALIGN == 0
        assert span.nbytes == reads[-1].file_offset + reads[-1].read_nbytes - reads[0].file_offset
        assert all(s.nbytes % ALIGN == 0 and s.dest_offset % ALIGN == 0 for s in span.segments)
        # one shared block per boundary that falls inside a block
        inside = sum((r.range_offset + r.nbytes) % ALIGN != 0 for r in reads[:-1])
        assert len(span.fixups) == inside > 0


def test_experts_that_are_not_neighbours_are_read_alone() -> None:
    locs = stacked_layer(160, *SHAPES["unaligned"])
    picked = [locs[i] for i in (7, 1, 2, 5, 3)]
    plans = [plan_expert(loc) for loc in picked]
    assert [[picked[i].expert for i in run] for run in runs(picked, plans)] == [[1, 2, 3], [5], [7]]


@pytest.mark.parametrize("register", [False, True], ids=["unregistered", "registered"])
@pytest.mark.parametrize("backend", ["uring", "pread"])
@pytest.mark.parametrize("shape", SHAPES)
async def test_coalesced_reads_are_exact(layer_file: Path, backend: str, register: bool, shape: str) -> None:
    if register and backend != "uring":
        pytest.skip("only io_uring registers buffers")
    locs = stacked_layer(4096 * 5 + 32, *SHAPES[shape])
    chosen = [0, 1, 2, 3, 5, 6, 9, 10, 11]  # runs of 4, 2 and 3, in the order the cache hands them
    slots = [8, 0, 3, 1, 7, 2, 4, 6, 5]     # any slot for any expert
    reader = await ExpertReader.open(layer_file, max(loc.nbytes for loc in locs), n_slots=len(chosen),
                                     backend=backend, register=register)
    try:
        futures = reader.start_many([(locs[x], s) for x, s in zip(chosen, slots)])
        assert reader.in_flight == len(chosen)
        for x, weights in zip(chosen, await asyncio.gather(*futures)):
            assert_exact(layer_file, locs[x], weights)
        assert reader.stats.reads == len(chosen) and reader.in_flight == 0
    finally:
        await reader.aclose()


async def test_a_refused_item_submits_nothing(layer_file: Path) -> None:
    locs = stacked_layer(160, *SHAPES["unaligned"])
    reader = await ExpertReader.open(layer_file, locs[0].nbytes, n_slots=3)
    try:
        with pytest.raises(RuntimeError, match="slot 1"):
            reader.start_many([(locs[0], 1), (locs[1], 1)])  # the same slot twice
        with pytest.raises(ValueError, match="slot 3"):
            reader.start_many([(locs[0], 0), (locs[1], 3)])
        assert reader.in_flight == 0 and not any(reader.in_kernel(s) for s in range(3))
    finally:
        await reader.aclose()


async def test_a_run_past_the_end_of_the_file_fails_every_member(layer_file: Path) -> None:
    size = os.path.getsize(layer_file)
    rows, cols = SHAPES["unaligned"]
    per = rows * cols // 32 * 34
    start = size - 2 * per - 1000  # the last two experts' gate ranges reach past the end
    locs = [ExpertLocation(0, x, TensorRange(start + x * per, per, T.Q8_0, (rows, cols)),
                           TensorRange(x * per, per, T.Q8_0, (rows, cols)),
                           TensorRange(2 * per * 4 + x * per, per, T.Q8_0, (cols, rows))) for x in range(3)]
    reader = await ExpertReader.open(layer_file, locs[0].nbytes, n_slots=3)
    try:
        outcomes = await asyncio.gather(*reader.start_many([(loc, i) for i, loc in enumerate(locs)]),
                                        return_exceptions=True)
        assert all(isinstance(o, ExpertReadError) and "short read" in str(o) for o in outcomes)
        assert reader.in_flight == 0
    finally:
        await reader.aclose()
