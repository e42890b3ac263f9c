"""Decode steps of several sequences together (MoETransformer.decode_batch, arch/decode_graphs.py).

A sequence's logits never depend on the others in its step: each row of a
batched step is, bit for bit, what the same token on the same sequence gives
decoded alone. The fixtures cover each family's attention (sliding-window rings
and sinks, MLA's latent cache, llama4's chunks and temperatures), KV types,
sequences of different lengths, steps over a subset of the slots in any order,
and a hybrid family (qwen3next), which steps its sequences one at a time.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from colibri_aio.arch import build_net
from colibri_aio.engine.mapped_source import MappedExpertSource
from colibri_aio.errors import UserError
from colibri_aio.gguf.model import load
from colibri_aio.kernels.backend import Kernels, NumpyKernels

from support import fixture
from test_arch_qwen3moe import ggml  # noqa: F401 (the module's ggml kernels, a fixture)

FAMILIES = ["tiny_q8_0", "tiny_q4_k", "tiny_f32", "gptoss_mxfp4", "deepseek2_q8_0", "llama4_q8_0",
            "qwen2moe_q8_0", "glm4moe_q8_0", "minimaxm2_q8_0", "qwen3next_q8_0", "dots1_q8_0", "ernie45moe_q8_0",
            "hunyuanmoe_q8_0", "bailingmoe2_q8_0"]
PROMPTS = (7, 19, 3)      # each sequence's prompt length: different positions and context buckets
STEPS = 5


def _net(name: str, kernels: Kernels, kv_type: str, n_seq: int):
    model = load(fixture(f"{name}.gguf"))
    return build_net(model, MappedExpertSource(model), n_ctx=64, kernels=kernels, kv_type=kv_type, n_seq=n_seq)


def _sequences(vocab: int) -> tuple[list[list[int]], np.ndarray]:
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, vocab, n).tolist() for n in PROMPTS]
    return prompts, rng.integers(3, vocab, (STEPS, len(PROMPTS)))


def _schedule() -> list[list[int]]:
    """The slots of each step: all of them, a subset, another order."""
    return [[0, 1, 2], [2, 0], [1, 2, 0], [0], [0, 1, 2]][:STEPS]


async def _batched(net, prompts: list[list[int]], tokens: np.ndarray) -> dict[tuple[int, int], np.ndarray]:
    for i, prompt in enumerate(prompts):
        net.use(i)
        await net.prefill(prompt)
    out, taken = {}, [0] * len(prompts)
    for slots in _schedule():
        rows = [(i, int(tokens[taken[i], i])) for i in slots]
        logits = await net.decode_batch(rows)
        assert logits.shape == (len(rows), net.args.vocab_size)
        for (i, _), row in zip(rows, logits):
            out[i, taken[i]] = row
            taken[i] += 1
    return out


async def _alone(net, prompts: list[list[int]], tokens: np.ndarray, counts: list[int]) -> dict:
    out = {}
    for i, prompt in enumerate(prompts):
        net.reset()
        await net.prefill(prompt)
        for step in range(counts[i]):
            out[i, step] = await net.forward([int(tokens[step, i])])
    return out


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("name", FAMILIES)
def test_each_row_is_its_sequence_alone(name: str, kv_type: str, ggml: Kernels) -> None:  # noqa: F811
    together = _net(name, ggml, kv_type, n_seq=len(PROMPTS))
    alone = _net(name, ggml, kv_type, n_seq=1)
    prompts, tokens = _sequences(together.args.vocab_size)
    got = asyncio.run(_batched(together, prompts, tokens))
    counts = [sum(i in slots for slots in _schedule()) for i in range(len(PROMPTS))]
    want = asyncio.run(_alone(alone, prompts, tokens, counts))
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=f"{name} {kv_type}: sequence {key[0]} step {key[1]}")
    for i, prompt in enumerate(prompts):
        assert together.slots[i].n_past == len(prompt) + counts[i]
        assert together.slots[i].ids == prompt + tokens[:counts[i], i].tolist()
    several = sum(len(slots) > 1 for slots in _schedule())
    if together.batchable():
        assert together.batch_steps == several      # they ran together on the graphs
    else:
        assert name == "qwen3next_q8_0" and together.decode_graphs() is not None


def test_numpy_backend_steps_each_sequence() -> None:
    together, alone = (_net("tiny_q8_0", NumpyKernels(), "f32", n) for n in (len(PROMPTS), 1))
    prompts, tokens = _sequences(together.args.vocab_size)
    got = asyncio.run(_batched(together, prompts, tokens))
    counts = [sum(i in slots for slots in _schedule()) for i in range(len(PROMPTS))]
    want = asyncio.run(_alone(alone, prompts, tokens, counts))
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])


def test_a_step_that_cannot_run_whole_moves_no_sequence(ggml: Kernels) -> None:  # noqa: F811
    net = _net("tiny_q8_0", ggml, "f16", n_seq=2)

    async def run() -> None:
        for i in range(2):
            net.use(i)
            await net.prefill([5, 6, 7])
        with pytest.raises(ValueError, match="twice"):
            await net.decode_batch([(0, 5), (0, 6)])
        with pytest.raises(ValueError, match="no slot 2"):
            await net.decode_batch([(0, 5), (2, 6)])
        with pytest.raises(UserError, match="out of range"):
            await net.decode_batch([(0, 5), (1, net.args.vocab_size)])
        with pytest.raises(UserError, match="at least one"):
            await net.decode_batch([])
        assert [s.n_past for s in net.slots] == [3, 3]
        net.use(1)
        net.rewind(0)
        await net.prefill(list(range(3, 3 + net.n_ctx)))
        with pytest.raises(UserError, match="context full: slot 1"):
            await net.decode_batch([(0, 5), (1, 6)])
        assert [s.n_past for s in net.slots] == [3, net.n_ctx]

    asyncio.run(run())


def test_rows_alike_is_measured_per_type(ggml: Kernels) -> None:  # noqa: F811
    """The probe's answer is what a product over several rows really gives on this build."""
    model = load(fixture("tiny_q8_0.gguf"))
    w = model.blocks[0].attn_q
    m = ggml.mat(w)  # type: ignore[attr-defined]
    x = np.random.default_rng(3).standard_normal((6, w.shape[1])).astype(np.float32)
    together = ggml.linear(w, x)
    alone = np.concatenate([ggml.linear(w, x[i:i + 1]) for i in range(6)])
    assert ggml.rows_alike(m) == bool(np.array_equal(together, alone))  # type: ignore[attr-defined]


class _Arriving(MappedExpertSource):
    """The experts of a request in several batches of one to three, in a shuffled order: as reads land."""

    def __init__(self, model, seed: int = 0) -> None:
        super().__init__(model)
        self.rng = np.random.default_rng(seed)

    async def stream(self, layer, experts):
        order = self.rng.permutation(len(experts)).tolist()
        async for (batch,) in _one(super().stream(layer, experts)):
            items = [batch[i] for i in order]
            while items:
                n = int(self.rng.integers(1, 4))
                yield items[:n]
                items = items[n:]


async def _one(stream):
    yield [batch async for batch in stream]


def _arriving_net(name: str, kernels: Kernels, n_seq: int):
    model = load(fixture(f"{name}.gguf"))
    return build_net(model, _Arriving(model), n_ctx=64, kernels=kernels, kv_type="f16", n_seq=n_seq)


@pytest.mark.parametrize("name", ["tiny_q8_0", "tiny_q4_k", "gptoss_mxfp4", "llama4_q8_0", "deepseek2_q8_0"])
def test_experts_over_all_rows_give_each_row_its_bits(monkeypatch, name: str, ggml: Kernels) -> None:  # noqa: F811
    """A batched step runs each arriving batch of experts over every row routed to it in one product; the
    logits equal, bit for bit, those of the same steps row by row and of each sequence alone, experts
    arriving in several batches in any order."""
    got = {}
    for cells in ("batch", "rows"):
        monkeypatch.setenv("COLIBRI_GGML_EXPERT_CELLS", cells)
        net = _arriving_net(name, ggml, len(PROMPTS))
        prompts, tokens = _sequences(net.args.vocab_size)
        got[cells] = asyncio.run(_batched(net, prompts, tokens))
        together = net.expert_cell_products
        assert (together > 0) == (cells == "batch"), (cells, together)
    alone_net = _arriving_net(name, ggml, 1)
    counts = [sum(i in slots for slots in _schedule()) for i in range(len(PROMPTS))]
    alone = asyncio.run(_alone(alone_net, prompts, tokens, counts))
    assert alone_net.expert_cell_products == 0        # one row: its own graphs
    for key in alone:
        np.testing.assert_array_equal(got["batch"][key], got["rows"][key], err_msg=f"{name} {key}")
        np.testing.assert_array_equal(got["batch"][key], alone[key], err_msg=f"{name} {key}")


def test_expert_cells_carry_each_rows_terms(ggml: Kernels) -> None:  # noqa: F811
    """DecodeGraphs.expert_cells against DecodeGraphs.experts one row at a time on the fixture's experts:
    every cell the bits of its row's own product, whichever cells share an expert; the probe agrees."""
    net = _net("tiny_q8_0", ggml, "f16", n_seq=1)
    graphs = net.decode_graphs()
    layer = next(i for i in range(net.args.block_count) if net.args.is_moe(i))
    shape = net._experts_shape(layer)
    assert ggml.cells_alike(shape.gate) and ggml.cells_alike(shape.down)  # type: ignore[attr-defined]
    batch = dict(asyncio.run(_collect(net.experts.stream(layer, range(net.args.expert_count)))))
    rng = np.random.default_rng(2)
    rows, used = 6, net.args.expert_used_count
    h = rng.standard_normal((rows, shape.gate.cols)).astype(np.float32)
    routed = np.stack([rng.choice(net.args.expert_count, used, replace=False) for _ in range(rows)]).astype(np.int32)
    weights = rng.random((rows, used)).astype(np.float32)
    cells = routed.reshape(-1)
    assert len(set(cells.tolist())) < cells.size          # some expert serves several rows
    out = graphs.expert_cells(shape, np.repeat(h, used, axis=0), batch, cells, weights.reshape(-1))
    assert out is not None and out.shape == (rows * used, shape.down.rows)
    for i in range(rows):
        x2 = np.zeros((1, shape.down.rows), np.float32)
        alone = graphs.experts(net._experts_shape(layer, used=used), h[i:i + 1], x2, x2,
                               [batch[e] for e in routed[i].tolist()], routed[i].tolist(), weights[i:i + 1],
                               terms=True)
        np.testing.assert_array_equal(out[i * used:(i + 1) * used], alone, err_msg=f"row {i}")


async def _collect(stream) -> list:
    return [item async for batch in stream for item in batch]
