"""glm4moe beyond the oracle tests of test_arch_families: the NextN block skipped, the leading
dense block, optional q/k norms, one refusal per malformed input; and, for glm4moe and gpt-oss,
``plan``'s figures against what the engine allocates."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from gguf import GGUFReader

from colibri_aio.engine.engine import Engine
from colibri_aio.engine.plan import kv_cache_nbytes, working_nbytes
from colibri_aio.gguf.model import load
from colibri_aio.io.align import slot_nbytes_for

from support import FIXTURES, ORACLE, assert_refused_in_one_line, model_logits, rewrite_gguf

F32 = FIXTURES / "glm4moe_f32.gguf"
IDS = json.loads((ORACLE / "family_ids.json").read_text())["sequences"][0]


def _block(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    return -1 if m is None else int(m.group(1))


def test_hyper_parameters_come_from_the_file() -> None:
    m = load(F32)
    a = m.args
    assert (a.block_count, a.skipped_blocks, a.leading_dense_block_count) == (2, 1, 1)  # 3 in the file: 1 NextN
    assert (a.routing.gating, a.routing.normalize, a.routing.scale) == ("sigmoid", True, 2.5)
    assert (a.n_rot, a.key_length, a.feed_forward_length, a.expert_shared_count) == (16, 32, 64, 1)
    assert [len(layer) for layer in m.experts] == [0, 8]  # the dense block streams nothing
    assert "ffn_gate" in m.blocks[0] and "ffn_gate_inp" not in m.blocks[0]
    assert {"ffn_gate_shexp", "exp_probs_b.bias", "attn_q_norm"} <= set(m.blocks[1].tensors)


def _without_nextn(name: str, array: np.ndarray):
    return [] if _block(name) == 2 else [(name, array)]


def test_the_nextn_block_is_neither_loaded_nor_computed(tmp_path) -> None:
    """The same model without its NextN block (and without saying it has one) gives the same logits."""
    trunk_only = rewrite_gguf(F32, tmp_path / "trunk.gguf", tensors=_without_nextn,
                              keys={"glm4moe.block_count": 2, "glm4moe.nextn_predict_layers": 0})
    np.testing.assert_array_equal(model_logits(trunk_only, IDS), model_logits(F32, IDS))
    assert load(trunk_only).trunk_nbytes == load(F32).trunk_nbytes


def test_without_qk_norms_as_glm_4_5_air(tmp_path) -> None:
    air = rewrite_gguf(F32, tmp_path / "air.gguf", tensors=lambda n, a: [] if "attn_q_norm" in n or "attn_k_norm" in n
                       else [(n, a)])
    m = load(air)
    assert "attn_q_norm" not in m.blocks[1]
    assert np.abs(model_logits(air, IDS) - model_logits(F32, IDS)).max() > 1e-3  # the norms were applied where present


def test_a_zero_expert_width_is_split_from_the_dense_one(tmp_path) -> None:
    """llama.cpp's glm4-moe loader sizes experts of expert_feed_forward_length 0 as feed_forward_length /
    expert_used_count (64 / 2 = 32, the fixture's own width): the file opens and gives the same logits."""
    zero = rewrite_gguf(F32, tmp_path / "zero.gguf", keys={"glm4moe.expert_feed_forward_length": 0})
    assert load(zero).args.expert_feed_forward_length == 32
    np.testing.assert_array_equal(model_logits(zero, IDS), model_logits(F32, IDS))


def _drop(name: str):
    return lambda n, a: [] if n == name else [(n, a)]


def _add(name: str, array: np.ndarray, after: str):
    return lambda n, a: [(n, a)] + ([(name, array)] if n == after else [])


# (rewrite, phrase of the one-line refusal)
REFUSALS = {
    "all_blocks_nextn": (dict(keys={"glm4moe.nextn_predict_layers": 3}), "nextn_predict_layers 3 leaves no trunk"),
    "softmax_weight_gating": (dict(keys={"glm4moe.expert_gating_func": 3}), "expert_gating_func 3 is not supported"),
    "multimodal_rope": (dict(keys={"glm4moe.rope.dimension_sections": 8}), "multimodal RoPE sections"),
    "unequal_head_widths": (dict(keys={"glm4moe.attention.value_length": 16}), "equal key and value widths"),
    "no_dense_width": (dict(drop_keys=("glm4moe.feed_forward_length",)),
                       "missing metadata key glm4moe.feed_forward_length"),
    # llama.cpp requires the key (a width of 0 it defaults: test_a_zero_expert_width_is_split_from_the_dense_one)
    "no_expert_width": (dict(drop_keys=("glm4moe.expert_feed_forward_length",)),
                        "missing metadata key glm4moe.expert_feed_forward_length"),
    "no_selection_bias": (dict(tensors=_drop("blk.1.exp_probs_b.bias")), "missing tensor blk.1.exp_probs_b.bias"),
    "router_in_dense_block": (dict(tensors=_add("blk.0.ffn_gate_inp.weight", np.zeros((8, 64), np.float32),
                                                "blk.0.attn_norm.weight")),
                              "tensor blk.0.ffn_gate_inp.weight is not part of a glm4moe model"),
    "block_past_nextn": (dict(tensors=_add("blk.3.attn_norm.weight", np.ones(64, np.float32),
                                           "blk.0.attn_norm.weight")),
                         "tensor blk.3.attn_norm.weight lies beyond block_count"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_glm4moe_files_that_cannot_run_are_refused_in_one_line(case: str, tmp_path) -> None:
    rewrite, phrase = REFUSALS[case]
    assert_refused_in_one_line(rewrite_gguf(F32, tmp_path / f"{case}_bad.gguf", **rewrite), phrase, tmp_path)


@pytest.mark.parametrize("stem", ["glm4moe_q8_0", "gptoss_mxfp4"])
async def test_plan_figures_are_what_the_engine_allocates(stem: str) -> None:
    """Trunk, KV cache, expert count and pool as ``plan`` states them, against the file's own tensor
    table and the engine's arrays: trunk = every tensor of the blocks that run except routed experts
    (the NextN block and the experts stay out), experts only in blocks with experts."""
    path = FIXTURES / f"{stem}.gguf"
    described = load(path, resident=False)
    a = described.args
    tensors = [t for t in GGUFReader(path).tensors if _block(t.name) < a.block_count]
    trunk = sum(int(t.n_bytes) for t in tensors if "_exps.weight" not in t.name)
    experts = sum(int(t.shape[-1]) for t in tensors if t.name.endswith("ffn_gate_exps.weight"))
    slot, context, slots = slot_nbytes_for(described.expert_nbytes_max), 64, 5
    budget = trunk + kv_cache_nbytes(described, context) + working_nbytes(described) + slots * slot
    async with await Engine.open(path, io="pread", ram_budget=budget, n_ctx=context, history=False) as engine:
        plan, reader = engine.plan, engine.source.reader
        assert plan.trunk == trunk == engine.model.trunk_nbytes
        assert plan.experts_total == experts == a.moe_block_count * a.expert_count
        cache = engine.net.cache
        assert plan.kv_cache == cache.nbytes == sum(k.nbytes + v.nbytes for k, v in zip(cache.k, cache.v))
        # the cache's per-layer quotas divide the slots the budget buys among the blocks with experts
        assert plan.slots == slots // a.moe_block_count * a.moe_block_count == reader.n_slots
        assert reader.pool is not None and plan.pool == sum(s.nbytes for s in reader.pool.slots)
        assert (await engine.net.forward(IDS[:3])).shape == (a.vocab_size,)
