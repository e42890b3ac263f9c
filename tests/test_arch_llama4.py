"""llama4: its hyper-parameters as llama.cpp reads them, chunked attention and the NoPE query temperature
past the first chunk (where the 24-position oracles of test_arch_families.py cannot reach), the plan's
figures, and one-line refusals of broken files."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from colibri_aio.arch import build_net
from colibri_aio.arch.llama4 import CHUNK
from colibri_aio.engine.mapped_source import MappedExpertSource
from colibri_aio.gguf.model import load
from colibri_aio.kernels.backend import KernelsUnavailable, open_kernels
from colibri_aio.kernels.ggml_graph import StepInputs
from colibri_aio.kernels.ops import attention, attention_temperature

from support import FIXTURES, ORACLE, assert_refused_in_one_line, rewrite_gguf
from test_arch_glm4moe import test_plan_figures_are_what_the_engine_allocates as _plan_figures

F32 = FIXTURES / "llama4_f32.gguf"
IDS = json.loads((ORACLE / "family_ids.json").read_text())["sequences"][0]


def test_hyper_parameters_come_from_the_file_and_llama_cpp() -> None:
    m = load(F32)
    a = m.args
    assert [a.is_moe(i) for i in range(4)] == [False, True, False, True]       # interleave_moe_layer_step 2
    assert [len(layer) for layer in m.experts] == [0, 4, 0, 4]
    assert a.moe_block_count == 2 and a.layers_text == "4 layers (2 dense)"
    assert [a.uses_rope(i) for i in range(4)] == [True, True, True, False]      # every 4th block NoPE
    assert a.kv_windows() == [CHUNK, CHUNK, CHUNK, None] and a.chunked == (True, True, True, False)
    assert a.qk_norm and (a.expert_used_count, a.routing.gating, a.routing.normalize) == (1, "sigmoid", False)
    assert m.globals["rope_freqs"].shape == (8,) and m.globals["rope_freqs"].max() > 1.0
    assert "ffn_up_shexp" in m.blocks[1].tensors and "ffn_up" in m.blocks[0].tensors
    assert m.blocks[0]["ffn_up"].shape == (64, 64) and m.blocks[1]["ffn_up_shexp"].shape == (32, 64)


def test_a_file_without_chunked_layers_rotates_all_but_its_last_block(tmp_path) -> None:
    """attention.sliding_window 0 (the converter's mark of all-full-attention models): llama.cpp chunks no
    block and sets the NoPE period to block_count."""
    a = load(rewrite_gguf(F32, tmp_path / "full.gguf", keys={"llama4.attention.sliding_window": 0})).args
    assert a.kv_windows() == [None] * 4 and [a.uses_rope(i) for i in range(4)] == [True, True, True, False]


def test_chunked_attention_sees_only_its_chunk() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((12, 2, 8), (12, 1, 8), (12, 1, 8)))
    positions = np.arange(12)
    got = attention(q, k, v, positions, window=5, chunked=True)
    for p in positions:
        start = p // 5 * 5
        want = attention(q[p:p + 1], k[start:p + 1], v[start:p + 1], np.array([p - start]))
        np.testing.assert_allclose(got[p], want[0], rtol=1e-6, atol=1e-6)


def test_the_graphs_chunk_mask_is_the_rule_of_the_numpy_attention() -> None:
    """Over a ring of 8 slots, a chunked layer's mask shows exactly the slots holding a position of the
    query's chunk, at every position of four chunks."""
    inputs = StepInputs()
    mask = inputs.mask(8, 8, chunked=True)
    for p in range(32):
        inputs.begin(p)
        held = p - (p - np.arange(8)) % 8
        np.testing.assert_array_equal(mask[0] == 0, (held >= p // 8 * 8) & (held <= p))


def test_the_temperature_is_llama_cpps() -> None:
    t = attention_temperature(np.array([0, 8190, 8191, 16383, 24575]), 8192, 0.1)
    np.testing.assert_allclose(t, [1.0, 1.0, 1 + 0.1 * np.log(2), 1 + 0.1 * np.log(3), 1 + 0.1 * np.log(4)],
                               rtol=1e-7)


async def test_decode_graphs_across_the_first_chunk_boundary() -> None:
    """Past position 8191 the chunked blocks see a new chunk and the NoPE block's temperature rises: the
    ggml decode graphs (ring masks, the temperature buffer) give the NumPy reference's logits there."""
    try:
        kernels = open_kernels("ggml")
    except KernelsUnavailable as e:
        pytest.skip(str(e))
    ids = (np.random.default_rng(1).integers(16, 512, CHUNK + 4)).tolist()
    outs = []
    for k in (None, kernels):
        m = load(F32)
        net = build_net(m, MappedExpertSource(m), n_ctx=CHUNK + 256, kernels=k, kv_type="f32")
        await net.prefill(ids[:CHUNK - 2])
        outs.append(np.stack([await net.forward([i]) for i in ids[CHUNK - 2:]]))
        if k is not None:
            assert net.decode_graphs() is not None and net.decode_graphs().steps == 6
    want, got = outs
    np.testing.assert_allclose(got, want, atol=1e-4 * float(np.abs(want).max()))
    kernels.close()


async def _last_rows(stem: str, kernels=None, **changes: object) -> np.ndarray:
    """The engine's logits for the long oracle's last positions (``changes``: ModelArgs fields replaced)."""
    ref = np.load(ORACLE / f"{stem}.long.transformers.npz")
    ids = np.random.default_rng(int(ref["seed"])).integers(16, 512, int(ref["length"])).tolist()
    m = load(FIXTURES / f"{stem}.gguf")
    if changes:
        m.args = replace(m.args, **changes)
    net = build_net(m, MappedExpertSource(m), n_ctx=len(ids) + 8, kernels=kernels, kv_type="f32")
    rows = len(ref["seq0"])
    await net.prefill(ids[:-rows])
    return await net.prefill(ids[-rows:], logits="all")


@pytest.mark.parametrize("stem", ["llama4_f32", "llama4_q8_0"])
async def test_logits_past_the_first_chunk_match_transformers_and_llama_cpp(stem: str) -> None:
    """Positions 8188-8199 of 8200: the chunked blocks start a new chunk at 8192 and the NoPE block's
    temperature steps up at 8191. The NumPy reference gives transformers' logits (dequantised weights)
    and, on F32, llama.cpp's; a pass that ignored the chunks would be far off."""
    got = await _last_rows(stem)
    for kind in ("transformers", "llamacpp") if stem.endswith("_f32") else ("transformers",):
        want = np.load(ORACLE / f"{stem}.long.{kind}.npz")["seq0"]
        assert float(np.abs(got - want).max()) <= 1e-4 * float(np.abs(want).max()), kind
    unchunked = await _last_rows(stem, chunked=(False,) * 4)
    want = np.load(ORACLE / f"{stem}.long.transformers.npz")["seq0"]
    assert float(np.abs(unchunked[4:] - want[4:]).max()) > 1e-2 * float(np.abs(want).max())


async def test_ggml_logits_past_the_first_chunk_are_near_llama_cpps() -> None:
    try:
        kernels = open_kernels("ggml")
    except KernelsUnavailable as e:
        pytest.skip(str(e))
    want = np.load(ORACLE / "llama4_q8_0.long.llamacpp.npz")["seq0"]
    got = await _last_rows("llama4_q8_0", kernels)
    kernels.close()
    # measured 0.13 (1.6% of max|logit|) at every row, before the boundary too: the per-operation pass's
    # NumPy attention over 8200 keys rounds otherwise than ggml's, and Q8_0 activations carry it (families.md)
    assert float(np.abs(got - want).max()) <= 0.05 * float(np.abs(want).max())
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


async def test_plan_figures_are_what_the_engine_allocates() -> None:
    await _plan_figures("llama4_q8_0")


def _drop(name: str):
    return lambda n, a: [] if n == name else [(n, a)]


# (rewrite, phrase of the one-line refusal)
REFUSALS = {
    "no_moe_step": (dict(drop_keys=("llama4.interleave_moe_layer_step",)),
                    "missing metadata key llama4.interleave_moe_layer_step"),
    "moe_step_beyond_blocks": (dict(keys={"llama4.interleave_moe_layer_step": 5}),
                               "interleave_moe_layer_step 5 leaves no block with experts among 4"),
    "no_shared_expert": (dict(tensors=_drop("blk.1.ffn_up_shexp.weight")), "missing tensor blk.1.ffn_up_shexp.weight"),
    "no_dense_ffn": (dict(tensors=_drop("blk.2.ffn_gate.weight")), "missing tensor blk.2.ffn_gate.weight"),
    "rope_freqs_width": (dict(tensors=lambda n, a: [(n, a[:4] if n == "rope_freqs.weight" else a)]),
                         "tensor rope_freqs.weight has shape"),
    "partial_rotation": (dict(keys={"llama4.rope.dimension_count": 8}), "rope dims 8 must be equal"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_llama4_files_that_cannot_run_are_refused_in_one_line(case: str, tmp_path) -> None:
    rewrite, phrase = REFUSALS[case]
    assert_refused_in_one_line(rewrite_gguf(F32, tmp_path / f"{case}_bad.gguf", **rewrite), phrase, tmp_path)
