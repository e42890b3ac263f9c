"""Resident matrices in ggml's repacked layout (GgmlKernels.resident, COLIBRI_GGML_REPACK).

A matrix of a type ggml repacks on this CPU (Q4_0, Q4_K, IQ4_NL, MXFP4 on AVX2;
Q2_K with AVX-512) and a multiple of 8 rows gets an interleaved copy, and every
product by it reads the copy on ggml's repacked GEMV/GEMM. Those kernels take
the same integer dot products as vec_dot in another order of their float sums:
a product differs from vec_dot's by ~1e-7 of its norm (measured 0.9e-7..2.5e-7),
held here to 1e-5. A whole net then moves by as little (1e-7 x max|logit| on
tiny_q4_0 and tiny_iq4_nl, held to 1e-5), except where that moves a routing near-tie
across: the second oracle sequence changes its experts at one position (tiny_q4_k
decoded: 2.4e-2 x max|logit|, within the ggml backend's 3e-2 against llama.cpp;
tiny_iq4_nl in prefill: 9e-3), so the nets are compared on the first.

Against llama.cpp (fixtures/oracle, llama-cpp-python 0.3.x, which repacks Q4_0 and
IQ4_NL at load but multiplied tiny_q4_k's Q4_K on vec_dot), max|diff| x max|logit|,
repack off -> on: tiny_q4_0 decode 1.1e-7 -> 0 (prefill 5.2e-3 both), tiny_iq4_nl
7e-8..1.5e-7 -> 0, ktiny_q2_k 3.1e-7 both, tiny_q4_k 5.6e-7 -> 2.4e-2 (the near-tie
above). Against transformers nothing moves in the digits quoted by the oracle
tests (tiny_q4_k 0.20, tiny_q4_0 0.89, tiny_iq4_nl 4.2e-2, ktiny_q2_k 2.5e-2: the
weights' own quantisation error).
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

ggml_cpu = pytest.importorskip("colibri_aio.kernels.ggml_cpu", reason="ggml-python is not installed")

from colibri_aio.arch.qwen3moe import Qwen3MoE  # noqa: E402
from colibri_aio.engine.mapped_source import MappedExpertSource  # noqa: E402
from colibri_aio.gguf.model import load  # noqa: E402

from kernel_data import rel_err  # noqa: E402
from support import fixture, oracle_ids, teacher_forced  # noqa: E402
from test_kernels_ggml import quantised  # noqa: E402

REPACKED = sorted(ggml_cpu.repack_types(), key=lambda t: t.name)
PRODUCT_TOL = 1e-5   # repacked vs vec_dot product, relative to its norm
NET_TOL = 1e-5       # x max|logit|, nets without a routing near-tie


@pytest.fixture
def kernels():
    plain, packing = ggml_cpu.GgmlKernels(2, repack=False), ggml_cpu.GgmlKernels(2, repack=True)
    yield plain, packing
    plain.close()
    packing.close()


def _bytes_at(addr: int, n: int) -> np.ndarray:
    return np.frombuffer((ctypes.c_uint8 * n).from_address(addr), np.uint8).copy()


def test_the_repackable_types_are_ggml_s_on_avx2() -> None:
    if not ggml_cpu.G.ggml_cpu_has_avx2():
        pytest.skip("ggml repacks these types on AVX2")
    assert {T.Q4_0, T.Q4_K, T.IQ4_NL, T.MXFP4} <= set(REPACKED)
    assert T.Q8_0 not in REPACKED and T.Q6_K not in REPACKED


@pytest.mark.parametrize("t", REPACKED, ids=lambda t: t.name)
@pytest.mark.parametrize("positions", [1, 5])
def test_each_repackable_type_is_multiplied_on_its_repacked_copy(kernels, t: T, positions: int) -> None:
    plain, packing = kernels
    w = quantised(t, (64, 512), seed=5)
    x = np.random.default_rng(6).standard_normal((positions, 512)).astype(np.float32)
    assert packing.resident([w]) == w.nbytes == packing.packed_nbytes
    mat = packing.mat(w)
    assert mat.packed
    copy = packing.address(w.data)
    assert copy != w.data.ctypes.data
    assert not np.array_equal(_bytes_at(copy, w.nbytes), w.data)     # interleaved: vec_dot would read garbage
    got, want = packing.linear(w, x), plain.linear(w, x)
    leaf = packing._graphs[("linears", (mat,), positions)].inputs[0]
    assert leaf.buffer and leaf.extra and leaf.data == copy           # what sends ggml to the repacked kernels
    assert rel_err(got, want) <= PRODUCT_TOL


def test_a_matrix_whose_rows_are_not_a_multiple_of_8_keeps_vec_dot(kernels) -> None:
    plain, packing = kernels
    w, x = quantised(T.Q4_0, (20, 512), seed=7), np.ones((1, 512), np.float32)
    assert packing.resident([w]) == 0
    assert not packing.mat(w).packed and packing.address(w.data) == w.data.ctypes.data
    assert np.array_equal(packing.linear(w, x), plain.linear(w, x))


def test_repacked_matrices_that_follow_each_other_run_as_one_product(kernels) -> None:
    """q, k and v stored one after another keep that order as copies: one fused product, the bits of three."""
    _, packing = kernels
    qkv = quantised(T.Q4_0, (64 + 32 + 32, 512), seed=8)
    q, k, v = qkv.row_block(0, 64), qkv.row_block(64, 96), qkv.row_block(96, 128)
    assert packing.resident([q, k, v]) == qkv.nbytes
    x = np.random.default_rng(9).standard_normal((1, 512)).astype(np.float32)
    fused = packing.linears([q, k, v], x)
    assert ("linears", (ggml_cpu.Mat(int(T.Q4_0), 128, 512, True),), 1) in packing._graphs
    for y, w in zip(fused, (q, k, v)):
        assert np.array_equal(y, packing.linear(w, x))


def test_repack_off_leaves_every_matrix_as_it_is(monkeypatch) -> None:
    monkeypatch.setenv("COLIBRI_GGML_REPACK", "off")
    k = ggml_cpu.GgmlKernels(2)
    try:
        assert "COLIBRI_GGML_REPACK=off" in k.description
        assert k.resident([quantised(T.Q4_0, (64, 512))]) == 0 and k.packed_nbytes == 0
    finally:
        k.close()


@pytest.mark.parametrize("name", ["tiny_q4_0", "quant_types/tiny_iq4_nl"])
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_a_net_on_repacked_weights_gives_nearly_the_logits_of_vec_dot(kernels, name: str, decode: bool) -> None:
    model = load(fixture(f"{name}.gguf"))
    logits = []
    for k in kernels:
        net = Qwen3MoE(model, MappedExpertSource(model), kernels=k, kv_type="f32")
        logits.append(teacher_forced(net, oracle_ids()[0], decode=decode))   # [1] meets a routing near-tie
    assert net.repacked_nbytes > 0
    graphs = net.decode_graphs()
    assert graphs is not None and graphs.steps == (len(oracle_ids()[0]) if decode else 0)
    assert net.kernels.mat(model.blocks[0].attn_q).packed   # of the fixture's type: every graph's leaf reads the copy
    plain, packed = logits
    assert float(np.abs(packed - plain).max()) <= NET_TOL * float(np.abs(plain).max())
