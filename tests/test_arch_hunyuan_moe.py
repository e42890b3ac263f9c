"""hunyuan-moe beyond the oracle tests of test_arch_families: its hyper-parameters as llama.cpp's loader
reads them (experts sized by feed_forward_length, the shared expert's width and its default), one refusal
per file llama.cpp cannot run either, and ``plan``'s figures against what the engine allocates."""
from __future__ import annotations

import json

import numpy as np
import pytest

from colibri_aio.gguf.model import load

from support import FIXTURES, ORACLE, assert_refused_in_one_line, model_logits, rewrite_gguf
from test_arch_glm4moe import test_plan_figures_are_what_the_engine_allocates as _plan_figures

F32 = FIXTURES / "hunyuanmoe_f32.gguf"
IDS = json.loads((ORACLE / "family_ids.json").read_text())["sequences"][0]


def test_hyper_parameters_come_from_the_file() -> None:
    m = load(F32)
    a, r = m.args, m.args.routing
    assert (r.gating, r.normalize, r.scale, r.group_count) == ("softmax", True, 0.0, 1)
    assert (a.block_count, a.leading_dense_block_count, a.expert_feed_forward_length) == (2, 0, 32)
    assert (a.expert_shared_feed_forward_length, a.head_count, a.head_count_kv, a.key_length) == (32, 4, 2, 16)
    assert [len(layer) for layer in m.experts] == [8, 8]
    assert {"attn_q_norm", "attn_k_norm", "ffn_gate_shexp"} <= set(m.blocks[0].tensors)


def test_the_shared_width_defaults_to_the_ffn_width(tmp_path) -> None:
    """llama.cpp sizes the shared expert feed_forward_length wide when its own key is absent or 0."""
    default = rewrite_gguf(F32, tmp_path / "default.gguf", drop_keys=("hunyuan-moe.expert_shared_feed_forward_length",))
    assert load(default).args.expert_shared_feed_forward_length == 32
    np.testing.assert_array_equal(model_logits(default, IDS), model_logits(F32, IDS))


def _add(name: str, array: np.ndarray, after: str):
    return lambda n, a: [(n, a)] + ([(name, array)] if n == after else [])


# (rewrite, phrase of the one-line refusal)
REFUSALS = {
    "no_expert_width_key": (dict(drop_keys=("hunyuan-moe.expert_feed_forward_length",)),
                            "missing metadata key hunyuan-moe.expert_feed_forward_length"),
    "no_ffn_width": (dict(drop_keys=("hunyuan-moe.feed_forward_length",)),
                     "missing metadata key hunyuan-moe.feed_forward_length"),
    "no_q_norm": (dict(tensors=lambda n, a: [] if n == "blk.0.attn_q_norm.weight" else [(n, a)]),
                  "missing tensor blk.0.attn_q_norm.weight"),
    # llama.cpp's hunyuan-moe graph has no selection bias and its loader refuses the tensor
    "selection_bias": (dict(tensors=_add("blk.0.exp_probs_b.bias", np.zeros(8, np.float32), "blk.0.attn_norm.weight")),
                       "tensor blk.0.exp_probs_b.bias is not part of a hunyuan-moe model"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_hunyuan_moe_files_that_cannot_run_are_refused_in_one_line(case: str, tmp_path) -> None:
    rewrite, phrase = REFUSALS[case]
    assert_refused_in_one_line(rewrite_gguf(F32, tmp_path / f"{case}_bad.gguf", **rewrite), phrase, tmp_path)


async def test_plan_figures_are_what_the_engine_allocates() -> None:
    await _plan_figures("hunyuanmoe_q8_0")
