"""Every family beyond qwen3moe against oracles we did not write (fixtures/families.md).

The fixtures are tiny random models made by transformers (Qwen2MoeForCausalLM,
OlmoeForCausalLM, MixtralForCausalLM, DeepseekV3ForCausalLM, DeepseekV2ForCausalLM without
q LoRA, Glm4MoeForCausalLM, GptOssForCausalLM, MiniMaxM2ForCausalLM), converted by llama.cpp's
converter, F32 and Q8_0 (gpt-oss: MXFP4 experts). Tolerances as in test_arch_qwen3moe: the
transformers oracle ran on the file's dequantised weights, so the NumPy kernels must agree with it to
1e-4 x max|logit| on every fixture, prefill and one-token decode; llama.cpp also
rounds activations to Q8_0 before each quantised product, so against it argmax
agrees wherever its own top-2 margin is clear, and logits agree closely on F32.

A family's fixtures join these tests by being in fixtures/oracle/ with an
architecture the engine runs.
"""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from gguf import GGUFReader

from colibri_aio.arch import SUPPORTED_ARCHITECTURES, build_net
from colibri_aio.arch.graph import NumpyBuilder
from colibri_aio.arch.layers import MoETransformer
from colibri_aio.engine.mapped_source import MappedExpertSource
from colibri_aio.gguf.model import load
from colibri_aio.kernels.backend import Kernels, KernelsUnavailable, open_kernels

from support import FIXTURES, ORACLE, family_stems, oracle_tolerance, teacher_forced

REL_TOL = 1e-4
QUANTISED_VS_LLAMACPP = 0.05  # x max|logit|: llama.cpp's Q8_0 activations; argmax checked beyond twice this margin
# The NumPy reference (dequantised weights, float32 activations) against llama.cpp (activations rounded to Q8_0)
# says nothing where the two differ by more than the logits' spread: qwen3next's DeltaNet RMS-norms each head's
# output, at the first positions one q·k of two L2-normed, nearly orthogonal vectors, whose rounding the norm
# scales up (measured 0.34 x max|logit| between transformers and llama.cpp on qwen3next_q8_0). There the ggml
# backend, which rounds as llama.cpp does, gives its logits bit for bit (test_ggml_logits_match_llamacpp).
ACTIVATION_ROUNDING_DOMINATES = {"qwen3next_q8_0"}
GGML_VS_LLAMACPP = 1e-3  # x max|logit|: ggml and llama.cpp run the same kernels on the same rounded activations
# Attention (q·k, the masked softmax, its mix of values) runs in NumPy, which rounds the last bits otherwise
# than ggml (float32 exp and division; ggml: its vector expf, a double sum, a reciprocal). Quantising the
# attention output to Q8_0 for attn_output absorbs those bits, except where one lies on a rounding boundary:
# in gptoss_mxfp4's prefill one code of layer 0 flips by one step, and the later Q8_0/MXFP4 products carry
# it to 1.6% of max|logit| (decode: 0). With llama.cpp's attention outputs the logits are llama.cpp's bit
# for bit (test_ggml_with_llamacpps_attention_outputs_gives_its_logits_bit_for_bit).
ATTENTION_ROUNDING_FLIP = {("gptoss_mxfp4", False): 0.02}  # (stem, decode): x max|logit|, measured 0.0161
IDS = json.loads((ORACLE / "family_ids.json").read_text())["sequences"]


def _architecture(stem: str) -> str:
    return GGUFReader(FIXTURES / f"{stem}.gguf").fields["general.architecture"].contents()


FAMILY_FIXTURES = sorted(
    stem for stem in (p.name.split(".")[0] for p in ORACLE.glob("*.transformers.npz"))
    if stem in family_stems() and (FIXTURES / f"{stem}.gguf").exists()
    and _architecture(stem) in SUPPORTED_ARCHITECTURES)  # qwen3moe's tiny_*: test_arch_qwen3moe.py, its own ids


def _net(stem: str, kernels: Kernels | None = None) -> MoETransformer:
    """The family's net on ``kernels`` (None: the NumPy reference), with a float32 KV cache, as the oracles ran
    (the f16 default's tolerance is stated and tested in test_arch_qwen3moe.py)."""
    model = load(FIXTURES / f"{stem}.gguf")
    return build_net(model, MappedExpertSource(model), kernels=kernels, kv_type="f32")


def _oracle(stem: str, kind: str) -> list[tuple[list[int], np.ndarray]]:
    ref = np.load(ORACLE / f"{stem}.{kind}.npz")
    return [(IDS[int(key[3:])][: ref[key].shape[0]], ref[key]) for key in sorted(ref.files)]


def test_every_new_family_has_f32_and_quantised_fixtures() -> None:
    families = {_architecture(s) for s in FAMILY_FIXTURES}
    assert {"qwen2moe", "olmoe", "llama", "deepseek2"} <= families
    for arch in families:
        stems = [s for s in FAMILY_FIXTURES if _architecture(s) == arch]
        assert any(s.endswith("_f32") for s in stems) and any(not s.endswith("_f32") for s in stems), arch


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("stem", FAMILY_FIXTURES)
def test_logits_match_transformers(stem: str, decode: bool) -> None:
    net = _net(stem)
    for ids, want in _oracle(stem, "transformers"):
        got = teacher_forced(net, ids, decode=decode)
        tol = REL_TOL * float(np.abs(want).max())
        assert float(np.abs(got - want).max()) <= tol, stem
        top2 = np.sort(want, axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > tol
        np.testing.assert_array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


@pytest.mark.parametrize("stem", FAMILY_FIXTURES)
def test_argmax_matches_llamacpp(stem: str) -> None:
    if stem in ACTIVATION_ROUNDING_DOMINATES:
        pytest.skip("llama.cpp's Q8_0 activations move these logits beyond their spread (ACTIVATION_ROUNDING_DOMINATES)")
    net, f32_weights = _net(stem), stem.endswith("_f32")
    for ids, want in _oracle(stem, "llamacpp"):
        got = teacher_forced(net, ids, decode=False)
        scale = float(np.abs(want).max())
        tol = (REL_TOL if f32_weights else QUANTISED_VS_LLAMACPP) * scale
        if f32_weights:
            assert float(np.abs(got - want).max()) <= tol, stem
        top2 = np.sort(want, axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 2 * tol
        np.testing.assert_array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


@pytest.fixture(scope="module")
def ggml() -> Kernels:
    try:
        kernels = open_kernels("ggml")
    except KernelsUnavailable as e:
        pytest.skip(str(e))
    yield kernels
    kernels.close()


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("stem", FAMILY_FIXTURES)
def test_ggml_logits_match_llamacpp(stem: str, decode: bool, ggml: Kernels) -> None:
    """ggml rounds activations as llama.cpp does: held to llama.cpp's logits (GGML_VS_LLAMACPP)."""
    net = _net(stem, ggml)
    # Without AVX-512: deepseek2lite_q8_0's decode measured 6.5e-3 (its 26 blocks carry a moved Q8_0 code on).
    rel = oracle_tolerance(ATTENTION_ROUNDING_FLIP.get((stem, decode), GGML_VS_LLAMACPP), 1e-2)
    for ids, want in _oracle(stem, "llamacpp"):
        got = teacher_forced(net, ids, decode=decode)
        tol = rel * float(np.abs(want).max())
        assert float(np.abs(got - want).max()) <= tol, stem
        top2 = np.sort(want, axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 2 * tol
        np.testing.assert_array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


@pytest.mark.parametrize("stem", sorted(p.name.split(".")[0] for p in ORACLE.glob("*.llamacpp_attention.npz")))
def test_ggml_with_llamacpps_attention_outputs_gives_its_logits_bit_for_bit(monkeypatch, stem: str,
                                                                           ggml: Kernels) -> None:
    """Every product but attention's (embedding, q/k/v/o with biases, YaRN, the router, the MXFP4 experts
    on Q8_0 activations, the clamped SwiGLU, the expert biases, the head) is llama.cpp's to the bit: given
    llama.cpp's attention output of each layer (fixtures/make_family_oracles.py attention), the ggml
    backend's prefill logits are llama.cpp's exactly (without it: ATTENTION_ROUNDING_FLIP)."""
    monkeypatch.setenv("COLIBRI_GGML_PREFILL", "ops")   # the per-operation prefill, whose attention is NumPy's
    net = _net(stem, ggml)
    ids, want = _oracle(stem, "llamacpp")[0]
    with np.load(ORACLE / f"{stem}.llamacpp_attention.npz") as ref:
        theirs = {int(name.split("-")[1]): ref[name] for name in ref.files}
    assert sorted(theirs) == list(range(net.args.block_count))
    ours = NumpyBuilder.attend
    mine: dict[int, np.ndarray] = {}

    def llamacpps(f: NumpyBuilder, layer: int, *args, **options) -> np.ndarray:
        mine[layer] = ours(f, layer, *args, **options)
        return theirs[layer]

    monkeypatch.setattr(NumpyBuilder, "attend", llamacpps)
    got = teacher_forced(net, ids, decode=False)
    assert np.array_equal(got, want)
    assert sorted(mine) == sorted(theirs)
    for layer, o in mine.items():  # the attention itself agrees to float32 rounding
        np.testing.assert_allclose(o, theirs[layer], rtol=0, atol=1e-6 * float(np.abs(theirs[layer]).max()))


@pytest.mark.parametrize("stem", [s for s in FAMILY_FIXTURES if s.endswith("_f32")])
def test_prefill_in_pieces_continues_the_same_cache(stem: str) -> None:
    net, ids = _net(stem), IDS[0]
    whole = teacher_forced(net, ids, decode=False)
    net.reset()

    async def pieces() -> np.ndarray:
        return np.concatenate([await net.forward(ids[:7], logits="all"), await net.forward(ids[7:], logits="all")])

    np.testing.assert_allclose(asyncio.run(pieces()), whole, rtol=0, atol=REL_TOL * float(np.abs(whole).max()))


def test_each_family_builds_its_own_forward_pass() -> None:
    names = {_architecture(s): type(_net(s)).__name__ for s in FAMILY_FIXTURES}
    assert names["qwen2moe"] == "Qwen2MoE" and names["olmoe"] == "OLMoE" and names["llama"] == "Mixtral"
    assert names["deepseek2"] == "DeepSeek2" and names["minimax-m2"] == "MiniMaxM2"
