"""Decode steps on whole ggml graphs traced from each family's description (arch/decode_graphs.py,
kernels/ggml_graph.py).

With a float32 KV cache the graphs compute what the per-operation ggml path
computes, with ggml's RMSNorm, RoPE and attention in place of NumPy's: on F32
weights the logits agree to their summation order (1e-5 x max|logit|); on Q8_0
weights an activation that lands on the other side of a rounding boundary moves
them by up to ~3e-4 x max|logit| (measured; held to 1e-3, the ggml backend's
tolerance against llama.cpp on these fixtures). With the default f16 cache the
graphs widen keys and values to float32 as the per-operation path does (within
3e-3 x max|logit| of it, measured 0 to 1.6e-3). With COLIBRI_GGML_ATTENTION=f16
attention rounds as llama.cpp's flash attention does (queries to f16 against
f16 keys, values summed in f16): held to llama.cpp's own decode with that cache. Placement never changes a bit (tests/test_engine_placement.py runs the
ggml backend through these graphs, experts in one batch and in several).

Every other family (olmoe: q/k RMSNorm over the whole projection; qwen2moe: q/k/v biases, a gated shared
expert; mixtral: NORMAL RoPE; deepseek2: MLA over a latent cache, YaRN, dense blocks, sigmoid routing with
groups; glm4moe: partial RoPE, a selection bias, scaled weights; gpt-oss: sinks, sliding-window rings,
biased clamped-SwiGLU experts) runs the same description the per-operation pass runs, and is held to the
same tolerances against that pass (measured 0 on the quantised fixtures but minimaxm2's and deepseek2's,
ATTENTION_FLIP_VS_PER_OPERATION) and against llama.cpp. minimax-m2 (olmoe's q/k norms over the whole projection, partial NEOX RoPE, sigmoid routing with a
selection bias, renormalised) runs olmoe's description.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import struct
import sys

import numpy as np
import pytest

from colibri_aio import Engine, NonFiniteError
from colibri_aio.gguf.header import GGUFHeader
from colibri_aio.kernels.backend import Kernels, NumpyKernels

from colibri_aio.arch import build_net
from colibri_aio.engine.mapped_source import MappedExpertSource
from colibri_aio.gguf.model import load

from support import AVX512, FIXTURES, ORACLE, fixture, oracle_ids, oracle_tolerance, teacher_forced
from test_arch_qwen3moe import _net, ggml  # noqa: F401 (ggml: the module's kernels, a fixture)

sys.path.insert(0, str(FIXTURES.parent / "tools"))
import make_synthetic_gguf  # noqa: E402

# Against llama.cpp's logits, x max|logit|. Its decode with an F16 cache and flash attention
# (fixtures/oracle/*.llamacpp_f16_decode.npz): the graphs round as it does, bit for bit on tiny_f32 and
# tiny_q8_0 (measured 0); on tiny_q4_k 2.4e-2..2.8e-2 (its K-quant products differ from this ggml build's
# in a few rows, measured 1.1e-2 with a float32 cache, and f16 keys move routing near-ties further).
# With a float32 cache against the float32 oracle (*.llamacpp.npz): the Q8_0 fixtures bit for bit.
F16_CACHE_VS_PER_OPERATION = 3e-3
F16_DECODE_EXACT = 1e-6
F16_DECODE_Q4_K = 5e-2
F32_VS_LLAMACPP_Q8 = 1e-6
F32_WEIGHTS_VS_LLAMACPP = 1e-5
# qwen3next_f32: its gated DeltaNet RMS-norms each head's output, whose first positions are one q·k of two
# L2-normed, nearly orthogonal vectors: the last bits of any summation order show there. Measured: the
# graphs 2.4e-5 from llama.cpp, which is itself 4.7e-5 from transformers.
F32_WEIGHTS_VS_LLAMACPP_BY_NAME = {"qwen3next_f32": 5e-5}
# minimaxm2_q8_0 with a float32 cache: the per-operation pass's NumPy attention of one query rounds its last
# bits otherwise than the graphs' (which give llama.cpp's logits bit for bit); at position 19 one such bit of
# layer 0's attention output (< 1e-5) lands on a Q8_0 code boundary of attn_output's input, and the cache
# carries it on: measured 1.43e-2 x max|logit| from there (positions 0-18: 0; with an f16 cache within 3e-3).
# deepseek2's absorbed MLA products run on attn_k_b/attn_v_b's Q8_0 bytes, as llama.cpp runs them, so attn_v_b
# rounds each head's attention mix to Q8_0: a last-bit difference of the per-operation pass's NumPy attention
# there moves a code, and the latent cache carries it on. On the sequence here the graphs give llama.cpp's
# logits bit for bit (deepseek2_q8_0) or within 9.2e-3 (deepseek2lite_q8_0's 26 blocks; the per-operation pass
# 5.8e-2, where both were 8.9e-2 off with float32 lifts); graphs against that pass, measured: deepseek2_q8_0
# 1.37e-2 from position 17 (f16 cache 0), deepseek2lite_q8_0 5.9e-2 from position 2 (f16 cache 3.3e-2).
# On the family oracle's sequences every path gives llama.cpp's logits bit for bit.
# qwen3moeyarn_q8_0 with a float32 cache: as minimaxm2_q8_0, 0 up to position 20, then 1.51e-2 from position 21
# (not the YaRN tables: NumPy's equal ggml's float32 ones there to the same logits; f16 cache within 3e-3).
# hunyuanmoe_q8_0 with a float32 cache: one such bit moves one Q8_0 code of attn_output's input at position 6
# alone (past the cache, so nothing carries on): measured 8.2e-3 there, 0 at every other position.
ATTENTION_FLIP_VS_PER_OPERATION = {("minimaxm2_q8_0", "f32"): 2e-2, ("deepseek2_q8_0", "f32"): 2e-2,
                                   ("deepseek2lite_q8_0", "f32"): 8e-2, ("deepseek2lite_q8_0", "f16"): 5e-2,
                                   ("qwen3moeyarn_q8_0", "f32"): 2e-2, ("hunyuanmoe_q8_0", "f32"): 2e-2}
# Without AVX-512 (AMD EPYC, AVX2): minimaxm2_q8_0's moved code sends a near-tie of its sigmoid routing the other
# way, and the rest of the sequence follows another expert: measured 0.54 x max|logit| (argmax still held where
# clear of that margin).
OTHER_CPU_FLIP_VS_PER_OPERATION = {("minimaxm2_q8_0", "f32"): 0.6}
# Every family fixture beyond qwen3moe's tiny_*, each of whose decode steps runs on graphs traced from its
# description: F32 and a quantised fixture each.
FAMILY_NAMES = ("olmoe", "qwen2moe", "mixtral", "deepseek2", "deepseek2lite", "glm4moe", "gptoss", "minimaxm2",
                "llama4", "qwen3next", "dots1", "ernie45moe", "hunyuanmoe", "bailingmoe2", "qwen3moeyarn", "mixtrallinear")   # the last two: YaRN and linear RoPE scaling
FAMILIES = [f"{family}_{kind}" for family in FAMILY_NAMES
            for kind in ("f32", "mxfp4" if family == "gptoss" else "q8_0")]


def _family_net(name: str, kernels: Kernels, kv_type: str = "f32"):
    """The family's own net (build_net picks it from the file's architecture)."""
    model = load(fixture(f"{name}.gguf"))
    return build_net(model, MappedExpertSource(model), kernels=kernels, kv_type=kv_type)


def _per_operation(monkeypatch, name: str, ggml: Kernels, ids: list[int], kv_type: str = "f32") -> np.ndarray:
    monkeypatch.setenv("COLIBRI_GGML_GRAPHS", "off")
    net = _family_net(name, ggml, kv_type)
    assert net.decode_graphs() is None
    got = teacher_forced(net, ids, decode=True)
    monkeypatch.delenv("COLIBRI_GGML_GRAPHS")
    return got


def test_only_the_ggml_backend_decodes_on_graphs(ggml: Kernels) -> None:
    assert _net("tiny_q8_0", NumpyKernels()).decode_graphs() is None
    assert _net("tiny_q8_0", ggml).decode_graphs() is not None


@pytest.mark.parametrize("name", ["tiny_q8_0", "colibri-tiny-q8_0"])
def test_q8_0_decode_on_graphs_matches_the_per_operation_path(monkeypatch, name: str, ggml: Kernels) -> None:
    ids = oracle_ids()[0]
    net = _net(name, ggml)
    got = teacher_forced(net, ids, decode=True)
    assert net.decode_graphs().steps == len(ids)                # every step ran on the graphs
    want = _per_operation(monkeypatch, name, ggml, ids)
    assert float(np.abs(got - want).max()) <= 1e-3 * float(np.abs(want).max())
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_f32_decode_on_graphs_matches_the_per_operation_path(monkeypatch, ggml: Kernels) -> None:
    ids = oracle_ids()[0]
    got = teacher_forced(_net("tiny_f32", ggml), ids, decode=True)
    want = _per_operation(monkeypatch, "tiny_f32", ggml, ids)
    assert float(np.abs(got - want).max()) <= 1e-5 * float(np.abs(want).max())


@pytest.mark.parametrize("name", ["tiny_f32", "tiny_q8_0", "colibri-tiny-q8_0"])
def test_f16_cache_on_graphs_matches_the_per_operation_path(monkeypatch, name: str, ggml: Kernels) -> None:
    ids = oracle_ids()[0]
    net = _net(name, ggml, "f16")
    got = teacher_forced(net, ids, decode=True)
    assert net.decode_graphs().steps == len(ids)
    want = _per_operation(monkeypatch, name, ggml, ids, "f16")
    assert float(np.abs(got - want).max()) <= F16_CACHE_VS_PER_OPERATION * float(np.abs(want).max())


@pytest.mark.parametrize("name", ["tiny_q8_0", "qwen2moe_q8_0"])   # qwen2moe: with its shared expert
def test_one_product_per_expert_gives_the_stacked_bits(monkeypatch, ggml: Kernels, name: str) -> None:
    """The A/B switch COLIBRI_GGML_EXPERTS=each (one product per expert instead of ggml_mul_mat_id)."""
    ids = [t % load(fixture(f"{name}.gguf")).args.vocab_size for t in oracle_ids()[1]]
    net = _family_net(name, ggml)
    want = teacher_forced(net, ids, decode=True)
    assert net.decode_graphs().steps == len(ids)
    monkeypatch.setenv("COLIBRI_GGML_EXPERTS", "each")
    assert np.array_equal(teacher_forced(_family_net(name, ggml), ids, decode=True), want)


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_family_decode_on_graphs_matches_the_per_operation_path(monkeypatch, name: str, kv_type: str,
                                                                ggml: Kernels) -> None:
    ids = [t % load(fixture(f"{name}.gguf")).args.vocab_size for t in oracle_ids()[0]]
    net = _family_net(name, ggml, kv_type)
    got = teacher_forced(net, ids, decode=True)
    assert net.decode_graphs().steps == len(ids)                # not one step left on the per-operation path
    want = _per_operation(monkeypatch, name, ggml, ids, kv_type)
    rel = F16_CACHE_VS_PER_OPERATION if kv_type == "f16" else 1e-5 if name.endswith("_f32") else 1e-3
    rel = ATTENTION_FLIP_VS_PER_OPERATION.get((name, kv_type), rel)
    if not AVX512:  # the flips above were measured on the AVX-512 host; on others they fall elsewhere
        rel = OTHER_CPU_FLIP_VS_PER_OPERATION.get((name, kv_type), rel)
    tol = rel * float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= tol
    _same_argmax_where_clear(got, want, tol)


def _same_argmax_where_clear(got: np.ndarray, want: np.ndarray, tol: float) -> None:
    """The same token wherever the reference's best two logits are further apart than twice ``tol``."""
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * tol
    np.testing.assert_array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


@pytest.mark.parametrize("shape", ["tiny-olmoe", "tiny-qwen2moe", "tiny-mixtral"])
def test_family_decode_on_graphs_with_one_qkv_product(monkeypatch, tmp_path, shape: str, ggml: Kernels) -> None:
    """tools/make_synthetic_gguf.py writes attn_q, attn_k and attn_v one after another (the layout the
    fixtures lack): the graphs' single q/k/v product, seen as q, k and v, then biases or the whole-width
    q/k norm. Against the per-operation path with the default f16 cache (measured 0 on each shape)."""
    path = tmp_path / f"{shape}.gguf"
    make_synthetic_gguf.main(["--shape", shape, "--type", "q8_0", "--out", str(path), "--quiet"])
    model = load(path)
    ids = list(range(3, 40, 3))
    net = build_net(model, MappedExpertSource(model), kernels=ggml)
    got = teacher_forced(net, ids, decode=True)
    assert net.decode_graphs().fused_products and net.decode_graphs().steps == len(ids)
    monkeypatch.setenv("COLIBRI_GGML_GRAPHS", "off")
    want = teacher_forced(build_net(model, MappedExpertSource(model), kernels=ggml), ids, decode=True)
    assert float(np.abs(got - want).max()) <= 1e-3 * float(np.abs(want).max())
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("name", FAMILIES)
def test_family_decode_on_graphs_against_llamacpp(name: str, ggml: Kernels) -> None:
    """llama.cpp's decode with a float32 cache: the Q8_0 fixtures bit for bit, F32 to its summation order."""
    ref = np.load(ORACLE / f"{name}.llamacpp.npz")
    ids = json.loads((ORACLE / "family_ids.json").read_text())["sequences"]
    tol = (F32_WEIGHTS_VS_LLAMACPP_BY_NAME.get(name, F32_WEIGHTS_VS_LLAMACPP) if name.endswith("_f32")
           else oracle_tolerance(F32_VS_LLAMACPP_Q8, 1e-2))   # without AVX-512: deepseek2lite_q8_0 6.5e-3
    for key in sorted(ref.files):
        want = ref[key]
        seq = ids[int(key[3:])][: want.shape[0]]
        net = _family_net(name, ggml)
        got = teacher_forced(net, seq, decode=True)
        assert net.decode_graphs().steps == len(seq)
        assert float(np.abs(got - want).max()) <= tol * float(np.abs(want).max()), key


def test_widening_the_cache_over_the_whole_context_matches_the_per_operation_path(monkeypatch, ggml: Kernels) -> None:
    """The graphs widen the f16 cache by rows (ggml_get_rows; the ggml_cast arm that gave the same bits lost its
    A/B and is gone): over the whole context (every key of the bucket, the last steps with none masked) the
    logits are the per-operation path's."""
    net = _net("tiny_q8_0", ggml, "f16")
    ids = np.random.default_rng(0).integers(3, 2000, net.n_ctx).tolist()
    got = teacher_forced(net, ids, decode=True)
    assert net.decode_graphs().steps == len(ids)
    monkeypatch.setenv("COLIBRI_GGML_GRAPHS", "off")
    want = teacher_forced(_net("tiny_q8_0", ggml, "f16"), ids, decode=True)
    assert float(np.abs(got - want).max()) <= F16_CACHE_VS_PER_OPERATION * float(np.abs(want).max())
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("name,kv_type,oracle,tol", [
    ("tiny_f32", "f16", "llamacpp_f16_decode", F16_DECODE_EXACT),
    ("tiny_q8_0", "f16", "llamacpp_f16_decode", F16_DECODE_EXACT),
    ("tiny_q4_k", "f16", "llamacpp_f16_decode", F16_DECODE_Q4_K),
    ("tiny_q8_0", "f32", "llamacpp", F32_VS_LLAMACPP_Q8),
    ("colibri-tiny-q8_0", "f32", "llamacpp", F32_VS_LLAMACPP_Q8)])
def test_decode_on_graphs_against_llamacpp(monkeypatch, name: str, kv_type: str, oracle: str, tol: float,
                                           ggml: Kernels) -> None:
    if oracle == "llamacpp_f16_decode":
        monkeypatch.setenv("COLIBRI_GGML_ATTENTION", "f16")
    ref = np.load(FIXTURES / "oracle" / f"{name}.{oracle}.npz")
    ids = oracle_ids()
    for key in sorted(ref.files):
        want = ref[key]
        seq = ids[int(key[3:])][: want.shape[0]]
        net = _net(name, ggml, kv_type)
        got = teacher_forced(net, seq, decode=True)
        assert net.decode_graphs().steps == len(seq)
        # Without AVX-512: tiny_f32's f16 decode measured 7.2e-5, colibri-tiny-q8_0's f32 3.1e-4.
        assert float(np.abs(got - want).max()) <= oracle_tolerance(tol, 1e-3) * float(np.abs(want).max()), key


def test_rewind_and_continue_on_graphs_gives_the_bits_of_a_fresh_run(ggml: Kernels) -> None:
    ids = oracle_ids()[0]
    net = _net("tiny_q8_0", ggml, "f16")
    want = teacher_forced(net, ids, decode=True)

    async def rewound() -> np.ndarray:
        net.reset()
        for t in ids + ids[:5]:               # run past the point, then rewind to it
            await net.forward([t])
        net.rewind(len(ids) - 4)
        return np.stack([await net.forward([t]) for t in ids[-4:]])

    assert np.array_equal(asyncio.run(rewound()), want[-4:])


@pytest.mark.parametrize("tensor,value,where", [
    ("blk.0.attn_q.weight", struct.pack("<H", 0x7C00), "layer 0 attention"),          # +inf scale
    ("blk.1.ffn_gate_inp.weight", struct.pack("<f", float("nan")), "layer 1 router"),
])
async def test_a_non_finite_value_in_a_graph_step_is_named_by_the_per_operation_pass(
        tmp_path, ggml: Kernels, tensor: str, value: bytes, where: str) -> None:
    broken = tmp_path / "broken.gguf"
    shutil.copyfile(fixture("tiny_q8_0.gguf"), broken)
    t = next(t for t in GGUFHeader(broken).tensors if t.name == tensor)
    with open(broken, "r+b") as f:
        f.seek(t.data_offset)
        f.write(value)
    async with await Engine.open(broken, io="pread", kernels="ggml") as engine:
        assert engine.net.decode_graphs() is not None
        with pytest.raises(NonFiniteError, match=where):
            await engine.net.forward([5])


# --- one graph per decode step when every chosen expert is resident in the pool ---

PASSES = 3  # the first reads the experts; by the end of the second the one-graph guess is back (> 18 clean steps)


async def _engine_run(name: str, ids: list[int], kv_type: str, per_layer: int, **placement) -> tuple[np.ndarray, Engine]:
    """Decode ``ids`` PASSES times from an empty context (later passes find what the first read), one token at
    a time, on the ggml backend with ``per_layer`` cache slots per layer: every step's logits, and the engine."""
    async with await Engine.open(fixture(f"{name}.gguf"), io="uring", kernels="ggml", kv_type=kv_type,
                                 cache_per_layer=per_layer, **placement) as engine:
        rows = []
        for _ in range(PASSES):
            engine.net.reset()
            rows += [await engine.net.forward([t]) for t in ids]
    return np.stack(rows), engine


@pytest.mark.parametrize("name", ["tiny_f32", "tiny_f16"])     # fixtures whose experts sit alike in their slots
@pytest.mark.parametrize("kv_type", ["f32", "f16"])
async def test_a_step_as_one_graph_gives_the_bits_of_the_per_block_graphs(monkeypatch, name: str, kv_type: str,
                                                                        ggml: Kernels) -> None:
    ids = oracle_ids()[2]
    monkeypatch.setenv("COLIBRI_GGML_STEP", "layers")
    want, engine = await _engine_run(name, ids, kv_type, 10**6)
    assert engine.net.one_graph_steps == 0
    monkeypatch.setenv("COLIBRI_GGML_STEP", "graph")
    got, engine = await _engine_run(name, ids, kv_type, 10**6)
    assert engine.net.one_graph_steps >= len(ids)           # the last pass at least: all resident
    assert np.array_equal(got, want)
    # One slot per layer: nearly every step misses, is run again block by block, gives the same bits.
    got, engine = await _engine_run(name, ids, kv_type, 1)
    assert engine.net.one_graph_misses >= 1 and engine.net.one_graph_misses < len(ids)
    assert np.array_equal(got, want)


async def test_a_step_as_one_graph_against_llamacpp(monkeypatch, ggml: Kernels) -> None:
    """llama.cpp's own decode with an f16 cache (tiny_f32: bit for bit on the per-block graphs)."""
    monkeypatch.setenv("COLIBRI_GGML_ATTENTION", "f16")
    ref = np.load(FIXTURES / "oracle" / "tiny_f32.llamacpp_f16_decode.npz")
    ids = oracle_ids()
    for key in sorted(ref.files):
        want = ref[key]
        seq = ids[int(key[3:])][: want.shape[0]]
        got, engine = await _engine_run("tiny_f32", seq, "f16", 10**6)
        assert engine.net.one_graph_steps >= len(seq)
        tol = oracle_tolerance(F16_DECODE_EXACT, 1e-3) * float(np.abs(want).max())   # as tiny_f32's f16 decode
        for one_pass in np.split(got, PASSES):
            assert float(np.abs(one_pass - want).max()) <= tol, key


async def test_the_scheduler_counts_a_one_graph_step_as_its_per_block_steps(monkeypatch, ggml: Kernels) -> None:
    """Hits, recency, use counts and usage after the same steps, whichever way they ran (no prefetch: a
    one-graph step gives no hints, there being nothing to read)."""
    ids = oracle_ids()[2]
    state = []
    for step in ("layers", "graph"):
        monkeypatch.setenv("COLIBRI_GGML_STEP", step)
        _, engine = await _engine_run("tiny_f32", ids, "f32", 10**6, prefetch="off")
        p = engine.source.policy
        c = p.cache
        state.append((c.stats, p.stats, [list(g) for g in c._groups.values()], dict(c._uses), dict(c._crf),
                      p.usage.counts.tolist()))
        assert (engine.net.one_graph_steps >= len(ids)) == (step == "graph")
    assert state[0] == state[1]


@pytest.mark.parametrize("name", [f"{family}_f32" for family in FAMILY_NAMES])
async def test_a_family_step_as_one_graph_gives_the_bits_of_the_per_block_graphs(monkeypatch, name: str,
                                                                               ggml: Kernels) -> None:
    """Every family runs a step as one graph from its description (shared experts, dense blocks, MLA,
    sinks and sliding windows, biased experts included), with the bits of its per-block graphs."""
    ids = [t % load(fixture(f"{name}.gguf")).args.vocab_size for t in oracle_ids()[2]]
    monkeypatch.setenv("COLIBRI_GGML_STEP", "layers")
    want, _ = await _engine_run(name, ids, "f32", 10**6)
    monkeypatch.setenv("COLIBRI_GGML_STEP", "graph")
    got, engine = await _engine_run(name, ids, "f32", 10**6)
    assert engine.net.one_graph_steps >= len(ids)
    assert np.array_equal(got, want)
