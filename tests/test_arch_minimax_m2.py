"""minimax-m2 beyond the oracle tests of test_arch_families: its hyper-parameters as llama.cpp's loader
reads them, one refusal per file llama.cpp cannot run either, and ``plan``'s figures against what the
engine allocates."""
from __future__ import annotations

import json

import numpy as np
import pytest

from colibri_aio.gguf.model import load

from support import FIXTURES, ORACLE, assert_refused_in_one_line, model_logits, rewrite_gguf
from test_arch_glm4moe import test_plan_figures_are_what_the_engine_allocates as _plan_figures

F32 = FIXTURES / "minimaxm2_f32.gguf"
IDS = json.loads((ORACLE / "family_ids.json").read_text())["sequences"][0]


def test_hyper_parameters_come_from_the_file() -> None:
    m = load(F32)
    a = m.args
    assert (a.routing.gating, a.routing.normalize, a.routing.scale) == ("sigmoid", True, 0.0)
    assert (a.n_rot, a.key_length, a.head_count, a.head_count_kv) == (16, 32, 4, 2)  # partial RoPE: 16 of 32
    assert (a.expert_count, a.expert_used_count, a.expert_feed_forward_length) == (8, 2, 32)
    assert [len(layer) for layer in m.experts] == [8, 8]
    assert m.blocks[0]["attn_q_norm"].shape == (128,) and m.blocks[0]["attn_k_norm"].shape == (64,)
    assert "exp_probs_b.bias" in m.blocks[1].tensors


def test_an_expert_weights_scale_key_is_not_read(tmp_path) -> None:
    """llama.cpp's minimax-m2 loader reads no expert_weights_scale: a file that has one (2.5 here) gives
    llama.cpp the logits of the file without it, bit for bit (measured), and so it does here."""
    scaled = rewrite_gguf(F32, tmp_path / "scaled.gguf", keys={"minimax-m2.expert_weights_scale": 2.5})
    assert load(scaled).args.routing.scale == 0.0
    np.testing.assert_array_equal(model_logits(scaled, IDS), model_logits(F32, IDS))


def _drop(name: str):
    return lambda n, a: [] if n == name else [(n, a)]


# (rewrite, phrase of the one-line refusal)
REFUSALS = {
    # llama.cpp reads the key as optional, leaves the gating function NONE and aborts in its MoE graph
    "no_gating_func": (dict(drop_keys=("minimax-m2.expert_gating_func",)),
                       "minimax-m2 needs expert_gating_func 1 (softmax) or 2 (sigmoid); the file says None"),
    "softmax_weight_gating": (dict(keys={"minimax-m2.expert_gating_func": 3}), "the file says 3"),
    "no_selection_bias": (dict(tensors=_drop("blk.1.exp_probs_b.bias")), "missing tensor blk.1.exp_probs_b.bias"),
    "no_q_norm": (dict(tensors=_drop("blk.0.attn_q_norm.weight")), "missing tensor blk.0.attn_q_norm.weight"),
    "qk_norm_width": (dict(tensors=lambda n, a: [(n, a[:32] if n == "blk.0.attn_k_norm.weight" else a)]),
                      "tensor blk.0.attn_k_norm.weight has shape"),
    "wide_rotation": (dict(keys={"minimax-m2.rope.dimension_count": 64}), "at most key_length 32"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_minimax_m2_files_that_cannot_run_are_refused_in_one_line(case: str, tmp_path) -> None:
    rewrite, phrase = REFUSALS[case]
    assert_refused_in_one_line(rewrite_gguf(F32, tmp_path / f"{case}_bad.gguf", **rewrite), phrase, tmp_path)


async def test_plan_figures_are_what_the_engine_allocates() -> None:
    await _plan_figures("minimaxm2_q8_0")
