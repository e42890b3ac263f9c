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
            "qwen2moe_q8_0", "glm4moe_q8_0", "minimaxm2_q8_0", "qwen3next_q8_0"]
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
