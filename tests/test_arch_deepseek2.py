"""deepseek2 beyond the shared oracle tests (test_arch_families.py runs its fixtures against
transformers' DeepseekV3ForCausalLM or DeepseekV2ForCausalLM (the lite layout, no q LoRA) and
llama.cpp): the latent KV cache and the plan against what the engine allocates, the lite layout,
YaRN against transformers' own formula, the older attn_kv_b layout, and a one-line refusal for
every malformed deepseek2 input the loader checks."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from colibri_aio.arch import build_net
from colibri_aio.engine.engine import Engine
from colibri_aio.engine.mapped_source import MappedExpertSource
from colibri_aio.errors import ModelFormatError
from colibri_aio.gguf.model import load
from colibri_aio.kernels.ops import rope_yarn_cos_sin

from support import FIXTURES, ORACLE, main_in_process, rewrite_gguf, teacher_forced

F32 = FIXTURES / "deepseek2_f32.gguf"
IDS = json.loads((ORACLE / "family_ids.json").read_text())["sequences"][0]


def _owned_nbytes(*arrays: np.ndarray) -> int:
    """Bytes these arrays own (a view of another adds nothing): what was allocated."""
    return sum(a.nbytes for a in arrays if a.base is None)


def test_kv_cache_holds_one_latent_per_position_and_block() -> None:
    model = load(F32)
    a = model.args
    net = build_net(model, MappedExpertSource(model), n_ctx=100)
    latent = a.block_count * 100 * (a.kv_lora_rank + a.n_rot) * 2                   # 3 x 100 x (32 + 16) f16
    assert net.cache.nbytes == _owned_nbytes(*net.cache.k, *net.cache.v) == a.kv_cache_nbytes(100) == latent
    full_heads = a.block_count * 100 * a.head_count * (a.head_k + a.v_head) * 2      # what MHA would cache
    assert latent * 5 < full_heads
    # the value is the latent, stored once
    assert all(np.shares_memory(v, k) for k, v in zip(net.cache.k, net.cache.v))


# (fixture, blocks, dense blocks, experts per block): DeepSeek-V3's layout and V2-Lite's (no q LoRA)
PLANNED = {"deepseek2_q8_0": (3, 1, 12), "deepseek2lite_q8_0": (26, 1, 4)}


@pytest.mark.parametrize("stem", sorted(PLANNED))
async def test_plan_figures_are_what_the_engine_allocates(stem: str) -> None:
    """`plan` (sizes from the header, nothing allocated) against an opened engine's arrays."""
    path = FIXTURES / f"{stem}.gguf"
    blocks, dense, experts = PLANNED[stem]
    status, out, err = main_in_process("plan", str(path), "--ram-budget", "600M", "--ctx", "200", "--json")
    assert status == 0, err
    doc = json.loads(out)
    async with await Engine.open(path, io="pread", ram_budget="600M", n_ctx=200) as engine:
        m, cache = engine.model, engine.net.cache
        # f16, the default
        assert doc["kv_cache"] == _owned_nbytes(*cache.k, *cache.v) == blocks * 200 * (32 + 16) * 2
        resident = [m.token_embd.data, m.output.data, m.output_norm]
        resident += [t if isinstance(t, np.ndarray) else t.data for b in m.blocks for t in b.tensors.values()]
        assert doc["trunk"] == sum(r.nbytes for r in resident)
        pool = engine.source.reader.pool
        assert doc["slots"] == engine.source.policy.cache.n_slots == len(pool.slots)
        assert doc["pool"] == sum(len(arena) for arena in pool.arenas)
        # every MoE block's experts fit; the dense block has none to cache
        assert doc["experts_total"] == (m.args.block_count - m.args.leading_dense_block_count) * experts \
            == (blocks - dense) * experts
        assert m.experts[0] == [] and len(m.experts[1]) == experts


def test_lite_files_query_through_one_attn_q() -> None:
    """DeepSeek-V2-Lite's layout (the converter writes no q_lora_rank; llama.cpp knows it by its 26 or 27
    blocks): one attn_q per block, no q LoRA tensors in the trunk; softmax routing, unscaled."""
    model = load(FIXTURES / "deepseek2lite_q8_0.gguf")
    a = model.args
    assert (a.block_count, a.q_lora_rank, a.head_k, a.routing.gating, a.routing.normalize) == (26, 0, 48, "softmax",
                                                                                              False)
    for blk in model.blocks:
        assert "attn_q" in blk.tensors and not {"attn_q_a", "attn_q_a_norm", "attn_q_b"} & set(blk.tensors)
        assert blk.attn_q.shape == (a.head_count * a.head_k, a.embedding_length)
    assert load(FIXTURES / "deepseek2_q8_0.gguf", resident=False).args.q_lora_rank == 32  # V3: q LoRA kept


def test_yarn_tables_follow_transformers() -> None:
    """The frequencies of transformers' YaRN (truncate=True, as ggml floors/ceils) at DeepSeek-V3's
    settings; the magnitude is passed through."""
    pytest.importorskip("transformers", reason="transformers (a development tool, not in the test extra) computes "
                        "the reference frequencies")
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = DeepseekV3Config(qk_rope_head_dim=64, qk_nope_head_dim=128, rope_theta=10000.0,
                           max_position_embeddings=163840,
                           rope_scaling={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")                  # float32 (32,)
    cos, sin = rope_yarn_cos_sin(np.array([0, 1]), 64, 10000.0, factor=40.0, original_context=4096, magnitude=1.0)
    np.testing.assert_array_equal(cos[0], 1.0)
    np.testing.assert_allclose(np.arctan2(sin[1], cos[1]), inv_freq.numpy(), rtol=1e-5, atol=1e-9)
    positions = np.array([0, 1, 7, 1000, 100000])
    cos, sin = rope_yarn_cos_sin(positions, 64, 10000.0, factor=40.0, original_context=4096, magnitude=1.0)
    cos2, _ = rope_yarn_cos_sin(positions, 64, 10000.0, factor=40.0, original_context=4096, magnitude=0.5)
    np.testing.assert_allclose(cos2, 0.5 * cos, rtol=1e-6)


def test_kq_scale_is_mscale_squared_over_the_head() -> None:
    """DeepSeek-V3's softmax scale (its modeling code): mscale(40, 1)² / sqrt(128 + 64)."""
    a = load(F32).args
    assert a.rope_scaling.kq_scale(48) == pytest.approx((1 + 0.1 * math.log(8)) ** 2 / math.sqrt(48), rel=1e-6)
    assert a.rope_scaling.rotation_magnitude == pytest.approx(1.0, rel=1e-6)


def _kv_b_layout(name: str, arr: np.ndarray, stash: dict):
    """Older files: one attn_kv_b (H·(dn + dv), Lkv), each head's k rows then its v rows."""
    if name.endswith("attn_k_b.weight"):                 # (H, Lkv, dn)
        stash["k"] = arr
        return []
    if name.endswith("attn_v_b.weight"):                 # (H, dv, Lkv)
        k_b = stash.pop("k")
        kv_b = np.concatenate([k_b.transpose(0, 2, 1), arr], axis=1).reshape(-1, arr.shape[-1])
        return [(name.replace("attn_v_b", "attn_kv_b"), kv_b)]
    return [(name, arr)]


def test_older_attn_kv_b_files_give_the_same_logits(tmp_path) -> None:
    stash: dict = {}
    path = rewrite_gguf(F32, tmp_path / "kv_b.gguf",
                        drop_keys=("deepseek2.attention.key_length_mla", "deepseek2.attention.value_length_mla"),
                        keys={"deepseek2.attention.key_length": 48, "deepseek2.attention.value_length": 32,
                              "deepseek2.attention.head_count_kv": 4},
                        tensors=lambda n, a: _kv_b_layout(n, a, stash))
    model = load(path)
    assert not model.args.split_kv_b and "attn_kv_b" in model.blocks[1].tensors
    want = np.load(ORACLE / "deepseek2_f32.transformers.npz")["seq0"]
    got = teacher_forced(build_net(model, MappedExpertSource(model), kv_type="f32"), IDS[: want.shape[0]], decode=True)
    assert float(np.abs(got - want).max()) <= 1e-4 * float(np.abs(want).max())


def _drop(name: str):
    return lambda n, a: [] if n == name else [(n, a)]


# (rewrite of deepseek2_f32, phrase of the one-line refusal)
REFUSALS = {
    "latent_key_length": (dict(keys={"deepseek2.attention.key_length": 40}),
                          "key_length 40 / value_length 32 are not the latent head"),
    "no_kv_lora_rank": (dict(drop_keys=("deepseek2.attention.kv_lora_rank",)),
                        "missing metadata key deepseek2.attention.kv_lora_rank"),
    "no_q_lora_rank": (dict(drop_keys=("deepseek2.attention.q_lora_rank",)),
                       "missing metadata key deepseek2.attention.q_lora_rank"),
    # 27 blocks: DeepSeek-V2-Lite's count, which llama.cpp reads as one attn_q (no q LoRA)
    "lite_layout": (dict(keys={"deepseek2.block_count": 27}), "missing tensor blk.0.attn_q.weight"),
    "nope_width": (dict(keys={"deepseek2.attention.key_length_mla": 16}), "MLA sizes must be positive"),
    "no_shared_expert": (dict(keys={"deepseek2.expert_shared_count": 0}), "expert_shared_count must be positive"),
    "gating": (dict(keys={"deepseek2.expert_gating_func": 4}), "expert_gating_func 4 is not supported"),
    "rope_scaling": (dict(keys={"deepseek2.rope.scaling.type": "longrope"}),
                     "rope.scaling.type 'longrope' is not supported"),
    "yarn_factor": (dict(keys={"deepseek2.rope.scaling.factor": 0.5}), "YaRN needs rope.scaling.factor > 1"),
    "all_dense": (dict(keys={"deepseek2.leading_dense_block_count": 3}), "leaves no block with experts"),
    "dense_width": (dict(drop_keys=("deepseek2.feed_forward_length",)),
                    "missing metadata key deepseek2.feed_forward_length"),
    "dense_count": (dict(keys={"deepseek2.leading_dense_block_count": 2}), "missing tensor blk.1.ffn_gate.weight"),
    "groups": (dict(keys={"deepseek2.expert_group_count": 5}), "12 experts do not split into 5 groups"),
    "no_k_b": (dict(tensors=_drop("blk.1.attn_k_b.weight")), "missing tensor blk.1.attn_k_b.weight"),
    "k_b_heads": (dict(tensors=lambda n, a: [(n, a[:2] if n == "blk.0.attn_k_b.weight" else a)]),
                  "tensor blk.0.attn_k_b.weight has shape (2, 32, 32), expected (4, 32, 32)"),
    "experts_in_a_dense_block": (dict(tensors=lambda n, a: [(n, a)] + (
        [("blk.0.ffn_gate_inp.weight", np.zeros((12, 64), np.float32))] if n == "blk.0.ffn_norm.weight" else [])),
        "tensor blk.0.ffn_gate_inp.weight is not part of a deepseek2 model"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_malformed_deepseek2_files_are_refused_in_one_line(case: str, tmp_path) -> None:
    rewrite, phrase = REFUSALS[case]
    path = rewrite_gguf(F32, tmp_path / f"{case}_bad.gguf", **rewrite)
    with pytest.raises(ModelFormatError, match=phrase.replace("(", r"\(").replace(")", r"\)")):
        load(path)
    status, _, err = main_in_process("plan", str(path))
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and phrase in lines[0] and "Traceback" not in err, err
