"""dots1 beyond the oracle tests of test_arch_families: its hyper-parameters as llama.cpp's loader reads
them (expert groups, scaled sigmoid routing, the leading dense block), the optional selection bias, one
refusal per file llama.cpp cannot run either, and ``plan``'s figures against what the engine allocates."""
from __future__ import annotations

import json

import numpy as np
import pytest

from colibri_aio.gguf.model import load

from support import FIXTURES, ORACLE, assert_refused_in_one_line, model_logits, rewrite_gguf
from test_arch_glm4moe import test_plan_figures_are_what_the_engine_allocates as _plan_figures

F32 = FIXTURES / "dots1_f32.gguf"
IDS = json.loads((ORACLE / "family_ids.json").read_text())["sequences"][0]


def test_hyper_parameters_come_from_the_file() -> None:
    m = load(F32)
    a, r = m.args, m.args.routing
    assert (r.gating, r.normalize, r.scale, r.group_count, r.group_used) == ("sigmoid", True, 2.5, 2, 1)
    assert (a.block_count, a.leading_dense_block_count, a.feed_forward_length, a.expert_shared_count) == (3, 1, 64, 2)
    assert (a.head_count, a.head_count_kv, a.key_length, a.n_rot) == (4, 4, 16, 16)
    assert [len(layer) for layer in m.experts] == [0, 8, 8]   # the dense block streams nothing
    assert "ffn_gate" in m.blocks[0] and "ffn_gate_inp" not in m.blocks[0]
    assert m.blocks[1]["ffn_gate_shexp"].shape == (64, 64)    # expert width 32 x 2 shared experts
    assert {"exp_probs_b.bias", "attn_q_norm", "attn_k_norm"} <= set(m.blocks[1].tensors)


def test_the_selection_bias_is_optional_and_applied_where_present(tmp_path) -> None:
    """llama.cpp loads exp_probs_b as optional: a file without it opens, and the bias it lacks moves the choice."""
    plain = rewrite_gguf(F32, tmp_path / "plain.gguf", tensors=lambda n, a: [] if "exp_probs_b" in n else [(n, a)])
    assert "exp_probs_b.bias" not in load(plain).blocks[1]
    assert np.abs(model_logits(plain, IDS) - model_logits(F32, IDS)).max() > 1e-3


def _add(name: str, array: np.ndarray, after: str):
    return lambda n, a: [(n, a)] + ([(name, array)] if n == after else [])


# (rewrite, phrase of the one-line refusal)
REFUSALS = {
    # llama.cpp reads the key as optional, leaves the gating function NONE and aborts in its MoE graph
    "no_gating_func": (dict(drop_keys=("dots1.expert_gating_func",)),
                       "dots1 needs expert_gating_func 1 (softmax) or 2 (sigmoid); the file says None"),
    "softmax_weight_gating": (dict(keys={"dots1.expert_gating_func": 3}), "the file says 3"),
    "fewer_kv_heads": (dict(keys={"dots1.attention.head_count_kv": 2}), "sizes keys and values for every head"),
    "no_shared_count": (dict(drop_keys=("dots1.expert_shared_count",)), "missing metadata key dots1.expert_shared_count"),
    "no_shared_expert": (dict(keys={"dots1.expert_shared_count": 0}), "every dots1 MoE block has a shared expert"),
    "no_dense_width": (dict(drop_keys=("dots1.feed_forward_length",)), "missing metadata key dots1.feed_forward_length"),
    "groups_do_not_split": (dict(keys={"dots1.expert_group_count": 3}), "do not split into 3 groups"),
    "router_in_dense_block": (dict(tensors=_add("blk.0.ffn_gate_inp.weight", np.zeros((8, 64), np.float32),
                                                "blk.0.attn_norm.weight")),
                              "tensor blk.0.ffn_gate_inp.weight is not part of a dots1 model"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_dots1_files_that_cannot_run_are_refused_in_one_line(case: str, tmp_path) -> None:
    rewrite, phrase = REFUSALS[case]
    assert_refused_in_one_line(rewrite_gguf(F32, tmp_path / f"{case}_bad.gguf", **rewrite), phrase, tmp_path)


async def test_plan_figures_are_what_the_engine_allocates() -> None:
    await _plan_figures("dots1_q8_0")
