"""bailingmoe2 (Ling/Ring 2.0) against llama.cpp, the one oracle there is (transformers has no class for it):
a hand-written checkpoint converted by llama.cpp's converter (fixtures/make_bailingmoe2_fixture.py). The NumPy
reference and the ggml backend (prefill, and decode on graphs) against llama.cpp's logits; its hyper-parameters,
the NextN block skipped, one refusal per file llama.cpp cannot run either, and ``plan``'s figures."""
from __future__ import annotations

import json

import numpy as np
import pytest

from colibri_aio.gguf.model import load

from support import FIXTURES, ORACLE, assert_refused_in_one_line, model_logits, rewrite_gguf, teacher_forced
from test_arch_families import GGML_VS_LLAMACPP, QUANTISED_VS_LLAMACPP, REL_TOL, _net
from test_arch_families import ggml  # noqa: F401 (the module's ggml kernels, a fixture)
from test_arch_glm4moe import test_plan_figures_are_what_the_engine_allocates as _plan_figures

F32 = FIXTURES / "bailingmoe2_f32.gguf"
IDS = json.loads((ORACLE / "family_ids.json").read_text())["sequences"]
STEMS = ["bailingmoe2_f32", "bailingmoe2_q8_0"]


def _llamacpp(stem: str) -> list[tuple[list[int], np.ndarray]]:
    ref = np.load(ORACLE / f"{stem}.llamacpp.npz")
    return [(IDS[int(key[3:])][: ref[key].shape[0]], ref[key]) for key in sorted(ref.files)]


def _agrees(got: np.ndarray, want: np.ndarray, rel: float) -> None:
    tol = rel * float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= tol
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * tol
    np.testing.assert_array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


@pytest.mark.parametrize("stem", STEMS)
def test_numpy_reference_matches_llamacpp(stem: str) -> None:
    """F32 weights: to float32 rounding; Q8_0: within llama.cpp's Q8_0 activations' reach, as every family."""
    net = _net(stem)
    for ids, want in _llamacpp(stem):
        _agrees(teacher_forced(net, ids, decode=False), want, REL_TOL if stem.endswith("_f32") else QUANTISED_VS_LLAMACPP)


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("stem", STEMS)
def test_ggml_logits_match_llamacpp(stem: str, decode: bool, ggml) -> None:  # noqa: F811
    net = _net(stem, ggml)
    for ids, want in _llamacpp(stem):
        _agrees(teacher_forced(net, ids, decode=decode), want, GGML_VS_LLAMACPP)
    if decode:
        assert net.decode_graphs().steps > 0


def test_hyper_parameters_come_from_the_file() -> None:
    m = load(F32)
    a, r = m.args, m.args.routing
    assert (r.gating, r.normalize, r.scale, r.group_count, r.group_used) == ("sigmoid", True, 2.5, 2, 1)
    assert (a.block_count, a.skipped_blocks, a.leading_dense_block_count) == (3, 1, 1)   # 4 in the file: 1 NextN
    assert (a.n_rot, a.key_length, a.expert_shared_feed_forward_length, a.feed_forward_length) == (8, 16, 32, 64)
    assert [len(layer) for layer in m.experts] == [0, 8, 8]
    assert m.blocks[1]["attn_qkv"].shape == (128, 64) and "exp_probs_b.bias" in m.blocks[1]


def test_the_nextn_block_is_neither_loaded_nor_computed(tmp_path) -> None:
    trunk = rewrite_gguf(F32, tmp_path / "trunk.gguf", keys={"bailingmoe2.block_count": 3,
                                                             "bailingmoe2.nextn_predict_layers": 0},
                         tensors=lambda n, a: [] if n.startswith("blk.3.") else [(n, a)])
    np.testing.assert_array_equal(model_logits(trunk, IDS[0]), model_logits(F32, IDS[0]))


REFUSALS = {
    # llama.cpp's loader requires the key
    "no_gating_func": (dict(drop_keys=("bailingmoe2.expert_gating_func",)),
                       "bailingmoe2 needs expert_gating_func 1 (softmax) or 2 (sigmoid); the file says None"),
    "softmax_weight_gating": (dict(keys={"bailingmoe2.expert_gating_func": 3}), "the file says 3"),
    "narrow_heads": (dict(keys={"bailingmoe2.attention.head_count": 2}), "queries as wide as the embedding"),
    "all_blocks_nextn": (dict(keys={"bailingmoe2.nextn_predict_layers": 4}), "nextn_predict_layers 4 leaves no trunk"),
    "no_shared_count": (dict(drop_keys=("bailingmoe2.expert_shared_count",)),
                        "missing metadata key bailingmoe2.expert_shared_count"),
    "no_qkv": (dict(tensors=lambda n, a: [] if n == "blk.1.attn_qkv.weight" else [(n, a)]),
               "missing tensor blk.1.attn_qkv.weight"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_bailingmoe2_files_that_cannot_run_are_refused_in_one_line(case: str, tmp_path) -> None:
    rewrite, phrase = REFUSALS[case]
    assert_refused_in_one_line(rewrite_gguf(F32, tmp_path / f"{case}_bad.gguf", **rewrite), phrase, tmp_path)


async def test_plan_figures_are_what_the_engine_allocates() -> None:
    await _plan_figures("bailingmoe2_q8_0")
