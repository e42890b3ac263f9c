"""ernie4_5-moe beyond the oracle tests of test_arch_families: its hyper-parameters as llama.cpp's loader
and graph read them (softmax routing with a selection bias, always renormalised; the shared expert's own
width key), what llama.cpp's graph ignores and so do we, one refusal per file llama.cpp cannot run either,
and ``plan``'s figures against what the engine allocates."""
from __future__ import annotations

import json

import numpy as np
import pytest

from colibri_aio.gguf.model import load

from support import FIXTURES, ORACLE, assert_refused_in_one_line, model_logits, rewrite_gguf
from test_arch_glm4moe import test_plan_figures_are_what_the_engine_allocates as _plan_figures

F32 = FIXTURES / "ernie45moe_f32.gguf"
IDS = json.loads((ORACLE / "family_ids.json").read_text())["sequences"][0]


def test_hyper_parameters_come_from_the_file() -> None:
    m = load(F32)
    a, r = m.args, m.args.routing
    assert (r.gating, r.normalize, r.scale, r.group_count) == ("softmax", True, 0.0, 1)
    assert (a.block_count, a.leading_dense_block_count, a.feed_forward_length) == (3, 1, 128)
    assert a.expert_shared_feed_forward_length == 64 and a.n_rot == a.key_length == 16
    assert [len(layer) for layer in m.experts] == [0, 8, 8]
    assert "ffn_gate" in m.blocks[0] and m.blocks[1]["ffn_gate_shexp"].shape == (64, 64)
    assert "exp_probs_b.bias" in m.blocks[1]


def test_what_llamacpps_graph_fixes_is_not_read_from_the_file(tmp_path) -> None:
    """llama.cpp's ernie4_5-moe graph fixes softmax gating and renormalisation, and never adds an
    attn_output.bias it loads: a file saying otherwise gives the same logits."""
    other = rewrite_gguf(F32, tmp_path / "other.gguf",
                         keys={"ernie4_5-moe.expert_gating_func": 2, "ernie4_5-moe.expert_weights_norm": False},
                         tensors=lambda n, a: [(n, a)] + ([("blk.1.attn_output.bias", np.ones(64, np.float32))]
                                                          if n == "blk.1.attn_norm.weight" else []))
    assert "attn_output.bias" in load(other).blocks[1]
    np.testing.assert_array_equal(model_logits(other, IDS), model_logits(F32, IDS))


def test_a_file_without_shared_experts_opens(tmp_path) -> None:
    """No expert_shared_feed_forward_length (or 0) and no ffn_*_shexp: ERNIE without a shared expert."""
    bare = rewrite_gguf(F32, tmp_path / "bare.gguf", drop_keys=("ernie4_5-moe.expert_shared_feed_forward_length",),
                        tensors=lambda n, a: [] if "_shexp" in n else [(n, a)])
    assert "ffn_gate_shexp" not in load(bare).blocks[1]
    assert np.abs(model_logits(bare, IDS) - model_logits(F32, IDS)).max() > 1e-3


# (rewrite, phrase of the one-line refusal)
REFUSALS = {
    "interleaved_moe": (dict(keys={"ernie4_5-moe.interleave_moe_layer_step": 2}),
                        "interleave_moe_layer_step 2: llama.cpp loads experts on every block"),
    "no_interleave_key": (dict(drop_keys=("ernie4_5-moe.interleave_moe_layer_step",)),
                          "missing metadata key ernie4_5-moe.interleave_moe_layer_step"),
    "no_dense_width": (dict(drop_keys=("ernie4_5-moe.feed_forward_length",)),
                       "missing metadata key ernie4_5-moe.feed_forward_length"),
    "shared_expert_without_width": (dict(drop_keys=("ernie4_5-moe.expert_shared_feed_forward_length",)),
                                    "_shexp.weight is not part of a ernie4_5-moe model"),
    "unequal_head_widths": (dict(keys={"ernie4_5-moe.attention.value_length": 8}), "equal key and value widths"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_ernie4_5_moe_files_that_cannot_run_are_refused_in_one_line(case: str, tmp_path) -> None:
    rewrite, phrase = REFUSALS[case]
    assert_refused_in_one_line(rewrite_gguf(F32, tmp_path / f"{case}_bad.gguf", **rewrite), phrase, tmp_path)


async def test_plan_figures_are_what_the_engine_allocates() -> None:
    await _plan_figures("ernie45moe_q8_0")
