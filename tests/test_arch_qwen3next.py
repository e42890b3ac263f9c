"""qwen3next: hyper-parameters as llama.cpp reads them, the recurrent blocks' state in the KV plan, a
context that continues only from its end, the older ``ssm_in`` layout, and one-line refusals.

The oracle comparisons (transformers, llama.cpp) run in test_arch_families.py and the decode graphs'
in test_decode_graphs.py, as for every family.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGUFReader

from colibri_aio.arch import build_net
from colibri_aio.arch.kvcache import STATE_CHECKPOINTS, RecurrentShape
from colibri_aio.engine.engine import Engine
from colibri_aio.engine.mapped_source import MappedExpertSource
from colibri_aio.engine.plan import kv_cache_nbytes, working_nbytes
from colibri_aio.gguf.model import load
from colibri_aio.io.align import slot_nbytes_for
from colibri_aio.kernels.ops import causal_conv, gated_delta_rule

from support import FIXTURES, ORACLE, assert_refused_in_one_line, rewrite_gguf

F32 = FIXTURES / "qwen3next_f32.gguf"
Q8_0 = FIXTURES / "qwen3next_q8_0.gguf"
IDS = json.loads((ORACLE / "family_ids.json").read_text())["sequences"][0]

pytestmark = pytest.mark.skipif(not F32.exists(), reason="the qwen3next fixtures are not made")


def test_hyper_parameters_come_from_the_file_and_llama_cpp() -> None:
    a = load(F32).args
    assert a.recurrent == (True, True, True, False)           # full attention every 4th block
    assert a.routing.gating == "softmax" and a.routing.normalize and a.routing.scale == 0.0
    state = a.recurrent_state(0)
    assert state == RecurrentShape(2 * a.key_heads * a.state_size + a.inner_size, a.conv_kernel - 1,
                                   a.value_heads, a.state_size)
    assert a.recurrent_state(3) is None
    assert a.n_rot == a.key_length // 4                        # partial_rotary_factor 0.25


def test_the_kv_plan_holds_keys_for_attention_blocks_and_a_state_for_the_others() -> None:
    m = load(F32)
    a = m.args
    net = build_net(m, MappedExpertSource(m), n_ctx=64, kv_type="f32")
    cache = net.cache
    keys = sum(k.nbytes + v.nbytes for k, v in zip(cache.k, cache.v))
    assert [len(k) for k in cache.k] == [0, 0, 0, 64]
    states = 3 * (2 + STATE_CHECKPOINTS) * 4 * a.recurrent_state(0).floats   # read, written, kept; float32
    assert cache.nbytes == keys + states == a.kv_cache_nbytes(64, "f32")


async def test_plan_figures_are_what_the_engine_allocates() -> None:
    described = load(Q8_0, resident=False)
    a = described.args
    tensors = GGUFReader(Q8_0).tensors
    trunk = sum(int(t.n_bytes) for t in tensors if "_exps.weight" not in t.name)
    slot, context, slots = slot_nbytes_for(described.expert_nbytes_max), 64, 8
    budget = trunk + kv_cache_nbytes(described, context) + working_nbytes(described) + slots * slot
    async with await Engine.open(Q8_0, io="pread", ram_budget=budget, n_ctx=context, history=False) as engine:
        plan = engine.plan
        assert plan.trunk == trunk == engine.model.trunk_nbytes
        assert plan.kv_cache == engine.net.cache.nbytes == a.kv_cache_nbytes(context)
        assert plan.experts_total == a.block_count * a.expert_count
        assert (await engine.net.forward(IDS[:3])).shape == (a.vocab_size,)


async def test_a_context_continues_from_its_end_and_is_never_rewound_into() -> None:
    """The recurrent state is of the whole sequence so far: a prefix shorter than the context cannot be
    continued (resumable says 0, and the prefix runs again), its end can, and either way the logits are
    those of one pass."""
    m = load(F32)
    net = build_net(m, MappedExpertSource(m), n_ctx=64, kv_type="f32")
    whole = await net.prefill(IDS[:12], logits="all")
    assert net.resumable(12) == 12 and net.resumable(8) == 0
    with pytest.raises(ValueError, match="cannot rewind"):
        net.rewind(8)
    net.reset()
    await net.prefill(IDS[:5])
    tolerance = 1e-4 * float(np.abs(whole).max())              # the oracles' (a product of 1 row or of 12)
    for i in range(5, 12):                                     # one position at a time, from the end
        np.testing.assert_allclose(await net.forward(IDS[i:i + 1]), whole[i], rtol=0, atol=tolerance)


async def test_a_checkpoint_lets_a_shorter_prefix_continue_with_the_bits_of_one_pass() -> None:
    """A checkpoint keeps the state of the context at that point: a later cut to it continues from there
    (resumable finds the longest one within the prefix), with the bits of the same calls run afresh;
    checkpoints past the cut go, and only the last STATE_CHECKPOINTS are kept."""
    m = load(F32)
    net = build_net(m, MappedExpertSource(m), n_ctx=64, kv_type="f32")
    await net.prefill(IDS[:4])
    await net.prefill(IDS[4:6])
    want = await net.forward(IDS[8:9])                          # another token after the same two calls
    net.reset()
    await net.prefill(IDS[:4])
    net.checkpoint()
    await net.prefill(IDS[4:6])
    net.checkpoint()
    await net.prefill(IDS[6:12])
    assert net.cache.checkpoints == [4, 6]
    assert net.resumable(10) == 6 and net.resumable(5) == 4 and net.resumable(3) == 0
    net.rewind(6)
    assert net.cache.checkpoints == [4, 6]
    np.testing.assert_array_equal(await net.forward(IDS[8:9]), want)
    net.rewind(4)                                               # the checkpoint at 6 is past the cut
    assert net.cache.checkpoints == [4] and net.resumable(6) == 4
    for end in (5, 6, 7):                                       # the oldest gives way
        await net.forward(IDS[end - 1:end])
        net.checkpoint()
    assert net.cache.checkpoints == [6, 7][-STATE_CHECKPOINTS:]


async def test_a_chats_next_turn_continues_from_the_last_prompts_checkpoint() -> None:
    """Turn 2's prompt extends turn 1's prompt but not its context's end (the answer is rendered anew):
    it prefills only what follows turn 1's prompt, and decodes what a fresh engine decodes."""
    first = IDS[:10]
    async with await Engine.open(F32, io="pread", n_ctx=64, history=False, kernels="numpy") as engine:
        pieces = [p async for p in engine.generate(first, max_tokens=4)]
        second = first + [pieces[0].token] + IDS[10:16]
        turn2 = [p async for p in engine.generate(second, max_tokens=4)]
    assert turn2[0].cached_tokens == len(first)
    async with await Engine.open(F32, io="pread", n_ctx=64, history=False, kernels="numpy") as fresh:
        alone = [p async for p in fresh.generate(second, max_tokens=4, reuse=False)]
    assert [p.token for p in turn2] == [p.token for p in alone]


async def test_a_failed_step_leaves_the_state_of_the_positions_before_it() -> None:
    m = load(F32)
    net = build_net(m, MappedExpertSource(m), n_ctx=64, kv_type="f32")
    await net.prefill(IDS[:6])
    want = await net.forward(IDS[6:7])
    net.reset()
    await net.prefill(IDS[:6])
    stream = net.experts.stream

    def broken(layer, ids):
        if layer == 2:
            raise OSError("a read failed")
        return stream(layer, ids)

    net.experts.stream = broken
    with pytest.raises(OSError):
        await net.forward(IDS[6:7])
    net.experts.stream = stream
    assert net.n_past == 6 and net.resumable(6) == 6
    np.testing.assert_array_equal(await net.forward(IDS[6:7]), want)


async def test_the_older_ssm_in_layout_gives_the_same_logits() -> None:
    """qwen3nextlegacy_f32 holds each DeltaNet input projection as one ssm_in (per key head [q, k, v·r, z·r]):
    the same rows multiplied as one matrix in another order, so qwen3next_f32's logits to float32 rounding,
    and llama.cpp's on it (which equal its logits on qwen3next_f32)."""
    got = []
    for path in (F32, FIXTURES / "qwen3nextlegacy_f32.gguf"):
        m = load(path)
        assert ("ssm_in" in m.blocks[0]) == (path != F32) and ("attn_qkv" in m.blocks[0]) == (path == F32)
        net = build_net(m, MappedExpertSource(m), n_ctx=32, kv_type="f32")
        got.append(await net.prefill(IDS, logits="all"))
    assert float(np.abs(got[0] - got[1]).max()) <= 1e-5 * float(np.abs(got[0]).max())
    want = np.load(ORACLE / "qwen3nextlegacy_f32.llamacpp.npz")["seq0"]
    assert float(np.abs(got[1] - want).max()) <= 5e-5 * float(np.abs(want).max())   # as qwen3next_f32's


def test_the_convolution_and_delta_rule_continue_across_calls() -> None:
    """Two calls from the state the first leaves are one call: what lets a prompt run in chunks and
    decode continue it."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((9, 6)).astype(np.float32), rng.standard_normal((6, 4)).astype(np.float32)
    one, _ = causal_conv(x, np.zeros((6, 3), np.float32), w)
    first, state = causal_conv(x[:4], np.zeros((6, 3), np.float32), w)
    np.testing.assert_allclose(np.concatenate([first, causal_conv(x[4:], state, w)[0]]), one, atol=1e-6)
    q, k, v = (rng.standard_normal((9, 2, 8)).astype(np.float32) for _ in range(3))
    g, beta = -rng.random((9, 2)).astype(np.float32), rng.random((9, 2)).astype(np.float32)
    zero = np.zeros((2, 8, 8), np.float32)
    whole, end = gated_delta_rule(q, k, v, g, beta, zero)
    head, mid = gated_delta_rule(q[:4], k[:4], v[:4], g[:4], beta[:4], zero)
    tail, end2 = gated_delta_rule(q[4:], k[4:], v[4:], g[4:], beta[4:], mid)
    np.testing.assert_array_equal(np.concatenate([head, tail]), whole)
    np.testing.assert_array_equal(end2, end)


def _drop(name: str):
    return lambda n, a: [] if n == name else [(n, a)]


# (rewrite, phrase of the one-line refusal)
REFUSALS = {
    "no_conv_kernel": (dict(drop_keys=("qwen3next.ssm.conv_kernel",)), "missing metadata key qwen3next.ssm.conv_kernel"),
    "value_heads": (dict(keys={"qwen3next.ssm.time_step_rank": 3}), "is not a multiple of ssm.group_count"),
    "no_projection": (dict(tensors=lambda n, a: [] if n.startswith("blk.1.attn_qkv") else [(n, a)]),
                      "recurrent block 1 has neither attn_qkv and attn_gate nor ssm_in"),
    "no_ssm_a": (dict(tensors=_drop("blk.0.ssm_a")), "missing tensor blk.0.ssm_a"),
    "recurrent_flags": (dict(keys={"qwen3next.attention.recurrent_layers": [True, False]}),
                        "recurrent_layers must hold 4 flags"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_qwen3next_files_that_cannot_run_are_refused_in_one_line(case: str, tmp_path) -> None:
    rewrite, phrase = REFUSALS[case]
    assert_refused_in_one_line(rewrite_gguf(F32, tmp_path / f"{case}_bad.gguf", **rewrite), phrase, tmp_path)
