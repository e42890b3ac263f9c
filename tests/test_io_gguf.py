"""Every expert of the tiny GGUF fixtures, read through every backend, matches gguf's own reader."""
from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from colibri_aio.gguf.model import load
from colibri_aio.io import ExpertReader
from support import requires_uring

pytestmark = requires_uring

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MODELS = ["tiny_f32.gguf", "tiny_q8_0.gguf", "tiny_q4_k.gguf", "tiny_bf16.gguf"]


def stacked_expert_bytes(path: Path) -> dict[tuple[int, int, str], bytes]:
    """(layer, expert, projection) -> bytes, cut from gguf's view of each stacked tensor."""
    out = {}
    for tensor in GGUFReader(path).tensors:
        parts = tensor.name.split(".")
        if len(parts) == 4 and parts[2].endswith("_exps"):
            layer, proj = int(parts[1]), parts[2].removeprefix("ffn_").removesuffix("_exps")
            raw = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(tensor.data.shape[0], -1)
            for expert, row in enumerate(raw):
                out[(layer, expert, proj)] = row.tobytes()
    return out


@pytest.mark.parametrize("backend", ["uring", "pread", "mmap"])
@pytest.mark.parametrize("name", MODELS)
async def test_every_expert_matches_the_gguf_reader(name: str, backend: str) -> None:
    path = FIXTURES / name
    if not path.is_file():
        pytest.skip(f"fixture {name} not built")
    model = load(path, resident=False)
    want = stacked_expert_bytes(path)
    reader = await ExpertReader.open(path, model.expert_nbytes_max, n_slots=3, backend=backend)

    async def worker(slot: int, locs: list) -> None:  # one slot each, all three busy at once
        for loc in locs:
            weights = await reader.start(loc, slot)
            for proj in ("gate", "up", "down"):
                tensor = getattr(weights, proj)
                assert tensor.shape == getattr(loc, proj).shape
                assert tensor.data.tobytes() == want[(loc.layer, loc.expert, proj)], (loc.layer, loc.expert, proj)

    every = [loc for layer in model.experts for loc in layer]
    try:
        async with asyncio.timeout(30):
            await asyncio.gather(*(worker(slot, every[slot::3]) for slot in range(3)))
        assert reader.stats.reads == model.args.block_count * model.args.expert_count == len(every)
    finally:
        await reader.aclose()
