"""The ggml backend: every GGUF type ggml multiplies against gguf-py's dequantisation, its stated
error (activations rounded as llama.cpp rounds them), and its bit-identity guarantees: byte
address, thread count, graph reuse and batching never change a bit."""
from __future__ import annotations

import asyncio
import ctypes

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFReader, quants

ggml_cpu = pytest.importorskip("colibri_aio.kernels.ggml_cpu", reason="ggml-python is not installed")

from colibri_aio.experts import ExpertWeights  # noqa: E402
from colibri_aio.kernels import quant  # noqa: E402
from colibri_aio.kernels.backend import NumpyKernels  # noqa: E402
from colibri_aio.kernels.qtensor import QTensor  # noqa: E402

from kernel_data import mapped, placed, rel_err  # noqa: E402
from support import FIXTURES, oracle_ids, reference_logits, rewrite_gguf  # noqa: E402

try:
    ggml_cpu.probe()
except ggml_cpu.GgmlUnavailable as e:  # pragma: no cover - a library built for another CPU
    pytest.skip(str(e), allow_module_level=True)

G = ggml_cpu.G
SUPPORTED = ggml_cpu.supported_types()
# Types gguf-py can decode on its own: the reference for every ggml type it knows.
REFERENCE_TYPES = sorted((SUPPORTED & (set(quants._type_traits) | {T.F32, T.F16})), key=lambda t: t.name)
# Relative error of a product (norm of the difference over norm of the float64 product of the same
# dequantised weights): ggml rounds the activation to the type its dot product pairs with.
ACTIVATION_ERROR = {"F32": 1e-6, "F16": 2e-3, "BF16": 1e-2}
# Q8_0 / Q8_K activations: measured 3e-3..9e-3 on these shapes for every quantised type. Against the NumPy
# reference (test_every_type_agrees_with_the_numpy_reference, worst of one position and seven):
# IQ1_S 7.4e-3, IQ1_M 6.9e-3, IQ2_XXS 6.6e-3, IQ2_XS 6.6e-3, IQ2_S 7.1e-3, IQ3_XXS 6.4e-3, IQ3_S 8.4e-3,
# TQ1_0 7.1e-3, TQ2_0 7.1e-3, NVFP4 5.9e-3 (Q4_K 7.3e-3, Q8_0 7.4e-3, IQ4_XS 8.7e-3 for comparison).
QUANTISED_ACTIVATION_ERROR = 2e-2


def ggml_quantize(t: T, data: np.ndarray) -> np.ndarray:
    """float32 ``data`` (rows along the last axis) quantised to ``t`` by ggml itself, as flat bytes
    (an all-ones importance matrix for the types that need one)."""
    data = np.ascontiguousarray(data, np.float32)
    cols = data.shape[-1]
    out = np.zeros(QTensor.nbytes_for(t, data.shape), np.uint8)
    imatrix = np.ones(cols, np.float32)
    gid = int(t)
    G.ggml_quantize_init(gid)
    written = G.ggml_quantize_chunk(
        gid, data.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.ctypes.data, 0, data.size // cols, cols,
        imatrix.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) if G.ggml_quantize_requires_imatrix(gid) else None)
    assert written == out.size
    return out


def quantised(t: T, shape: tuple[int, int], seed: int = 0) -> QTensor:
    """Random N(0, 1) weights of type ``t``, quantised by ggml itself (gguf-py quantises few types)."""
    data = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    if t == T.F32:
        return QTensor(data.view(np.uint8).reshape(-1), t, shape)
    return QTensor(ggml_quantize(t, data), t, shape)


def reference(w: QTensor) -> np.ndarray:
    if w.ggml_type == T.F32:
        return w.data.view(np.float32).reshape(w.shape).astype(np.float64)
    return quants.dequantize(w.data, w.ggml_type).reshape(w.shape).astype(np.float64)


@pytest.fixture(scope="module")
def kernels():
    k = ggml_cpu.GgmlKernels(2)
    yield k
    k.close()


def test_type_table_covers_every_gguf_type_ggml_multiplies() -> None:
    """The classic and K-quant types, the IQ and ternary types, MXFP4 and NVFP4."""
    want = {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K,
            T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4, T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS,
            T.IQ3_S, T.TQ1_0, T.TQ2_0, T.NVFP4}
    assert want <= SUPPORTED
    assert T.I8 not in SUPPORTED and T.F64 not in SUPPORTED  # no CPU dot product for them


def test_every_type_ggml_multiplies_and_gguf_decodes_has_a_numpy_reference() -> None:
    """A file opens on either backend: no type ggml runs is missing from the NumPy kernels, unless
    gguf-py (the reference they are checked against) cannot decode it either."""
    assert set(REFERENCE_TYPES) <= quant.SUPPORTED_TYPES


@pytest.mark.parametrize("t", REFERENCE_TYPES, ids=lambda t: t.name)
def test_dequantize_and_products_match_gguf(t: T, kernels) -> None:
    assert 512 % GGML_QUANT_SIZES[t][0] == 0
    w = quantised(t, (48, 512), seed=int(t))
    ref = reference(w)
    np.testing.assert_allclose(kernels.dequantize(w), ref, rtol=1e-6, atol=1e-7)
    rng = np.random.default_rng(1)
    xs = rng.standard_normal((5, w.cols)).astype(np.float32)
    tol = ACTIVATION_ERROR.get(t.name, QUANTISED_ACTIVATION_ERROR)
    assert rel_err(kernels.linear(w, xs[:1]), xs[:1] @ ref.T) <= tol
    assert rel_err(kernels.linear(w, xs), xs @ ref.T) <= tol


@pytest.mark.parametrize("t", sorted(SUPPORTED & quant.SUPPORTED_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
def test_every_type_agrees_with_the_numpy_reference(t: T, kernels) -> None:
    """Every type the engine supports, on expert-like shapes, one position and a batch: ggml's products
    are the NumPy reference's within the error of rounding the activation (ACTIVATION_ERROR)."""
    w, numpy = quantised(t, (64, 1024), seed=int(t) + 100), NumpyKernels()
    xs = np.random.default_rng(2).standard_normal((7, w.cols)).astype(np.float32)
    tol = ACTIVATION_ERROR.get(t.name, QUANTISED_ACTIVATION_ERROR)
    for x in (xs[:1], xs):
        want = numpy.linear(w, x).astype(np.float64)
        assert rel_err(kernels.linear(w, x), want) <= tol
    np.testing.assert_array_equal(kernels.dequantize(w), numpy.dequantize(w))


# The IQ, ternary and NVFP4 types: a model whose experts are of each opens and runs on both backends.
LATEST_TYPES = [T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.TQ1_0, T.TQ2_0, T.NVFP4]
# x max|logit|, worst position of 16: ggml rounds every activation to 8 bits, which on this random model
# moves logits by 2-3% of the largest (transformers vs llama.cpp on ktiny_iq4_xs: 0.023; NumPy vs ggml
# on it, its experts requantised by ggml to IQ4_XS: 0.023, Q4_K: 0.024, Q2_K: 0.028). Measured here:
# IQ1_S 0.026, IQ1_M 0.026, IQ2_XXS 0.028, IQ2_XS 0.027, IQ2_S 0.031, IQ3_XXS 0.023, IQ3_S 0.027,
# TQ1_0 0.038, TQ2_0 0.038 (ggml quantises both ternary types to the same values), NVFP4 0.022.
MODEL_LOGITS_ERROR = 6e-2


@pytest.mark.parametrize("t", LATEST_TYPES, ids=lambda t: t.name)
def test_a_model_with_experts_of_the_type_runs_alike_on_both_backends(t: T, tmp_path) -> None:
    """ktiny_iq4_xs (every row 256 long) with its expert tensors requantised to ``t`` by ggml: the file
    opens, and the NumPy reference and ggml give the same logits within the activation rounding."""
    src = FIXTURES / "quant_types" / "ktiny_iq4_xs.gguf"
    types = {x.name: x.tensor_type for x in GGUFReader(src).tensors}

    def requantise(name: str, array: np.ndarray) -> list[tuple]:
        if "_exps" not in name:
            return [(name, array, types[name])]
        weights = quants.dequantize(array, types[name])
        return [(name, ggml_quantize(t, weights).reshape(*weights.shape[:-1], -1), t)]

    path = rewrite_gguf(src, tmp_path / f"ktiny_{t.name.lower()}.gguf", tensors=requantise)
    assert {x.tensor_type for x in GGUFReader(path).tensors if "_exps" in x.name} == {t}
    ids = oracle_ids()[0][:16]
    want = asyncio.run(reference_logits(path, ids, split=8, kernels="numpy"))
    got = asyncio.run(reference_logits(path, ids, split=8, kernels="ggml"))
    assert np.isfinite(want).all()
    tol = MODEL_LOGITS_ERROR * float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= tol
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * tol
    np.testing.assert_array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_same_bits_at_any_address_and_thread_count() -> None:
    """Placement (pool slot at odd offsets, a file mapping) and threads 1-4 never change a bit."""
    rng = np.random.default_rng(2)
    ws = [quantised(t, (64, 512), seed=3) for t in (T.Q8_0, T.Q4_K, T.Q6_K, T.F16)]
    x1, x7 = rng.standard_normal((1, 512)).astype(np.float32), rng.standard_normal((7, 512)).astype(np.float32)
    base = ggml_cpu.GgmlKernels(1, parallel_bytes=0)
    want = [(base.linear(w, x1), base.linear(w, x7)) for w in ws]
    for threads in (2, 3, 4):
        k = ggml_cpu.GgmlKernels(threads, parallel_bytes=0)  # every graph on every thread, however small
        for w, (w1, w7) in zip(ws, want):
            for offset in (0, 1, 31, 4095):
                p = placed(w, offset)
                assert np.array_equal(k.linear(p, x1), w1)
                assert np.array_equal(k.linear(p, x7), w7)
        k.close()
    base.close()


def test_same_bits_from_a_file_mapping(tmp_path, kernels) -> None:
    w = quantised(T.Q4_K, (32, 512), seed=4)
    x = np.random.default_rng(3).standard_normal((1, 512)).astype(np.float32)
    assert np.array_equal(kernels.linear(mapped(w, tmp_path / "w.bin"), x), kernels.linear(w, x))


def test_linears_equal_single_products_bit_for_bit(kernels) -> None:
    q, k_, v = quantised(T.Q8_0, (64, 256), 5), quantised(T.Q8_0, (16, 256), 6), quantised(T.Q6_K, (16, 256), 7)
    for n in (1, 4):
        x = np.random.default_rng(n).standard_normal((n, 256)).astype(np.float32)
        together = kernels.linears((q, k_, v), x)
        for w, y in zip((q, k_, v), together):
            assert y.shape == (n, w.rows)
            assert np.array_equal(y, kernels.linear(w, x))


def test_linears_of_weights_that_follow_each_other_equal_single_products_bit_for_bit(kernels) -> None:
    """q, k and v stored one after another run as one product: it must give the bits of three."""
    ws = [quantised(T.Q8_0, (rows, 256), 20 + rows) for rows in (64, 16, 16)]
    block = np.concatenate([w.data for w in ws])
    adjacent, start = [], 0
    for w in ws:
        adjacent.append(QTensor(block[start: start + w.nbytes], w.ggml_type, w.shape))
        start += w.nbytes
    for n in (1, 5):
        x = np.random.default_rng(n).standard_normal((n, 256)).astype(np.float32)
        for w, y in zip(ws, kernels.linears(adjacent, x)):
            assert y.shape == (n, w.rows) and np.array_equal(y, kernels.linear(w, x))


def _expert(t: T, d: int, f: int, seed: int) -> ExpertWeights:
    return ExpertWeights(quantised(t, (f, d), seed), quantised(t, (f, d), seed + 1), quantised(t, (d, f), seed + 2))


def test_an_expert_gives_the_same_bits_alone_or_in_any_batch(kernels) -> None:
    """The scheduler groups experts by what is ready: grouping must not change an expert's output."""
    experts = [_expert(T.Q8_0, 256, 512, 10 * i) for i in range(4)]
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal((n, 256)).astype(np.float32) for n in (1, 3, 1, 2)]
    alone = [kernels.expert_ffns([e], [x])[0] for e, x in zip(experts, xs)]
    together = kernels.expert_ffns(experts, xs)
    backwards = kernels.expert_ffns(experts[::-1], xs[::-1])[::-1]
    for a, b, c in zip(alone, together, backwards):
        assert np.array_equal(a, b) and np.array_equal(a, c)


def _slotted(experts: list[ExpertWeights], slot_nbytes: int, slots: list[int]) -> list[ExpertWeights]:
    """Copies of ``experts`` in the ``slots`` of one buffer, as a buffer pool holds them."""
    pool = np.zeros(slot_nbytes * (max(slots) + 1), np.uint8)
    out = []
    for e, s in zip(experts, slots):
        start, views = s * slot_nbytes, []
        for w in (e.gate, e.up, e.down):
            pool[start: start + w.nbytes] = w.data
            views.append(QTensor(pool[start: start + w.nbytes], w.ggml_type, w.shape))
            start += w.nbytes
        out.append(ExpertWeights(*views))
    return out


@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_K])
def test_experts_in_pool_slots_run_stacked_and_give_the_bits_they_give_alone(kernels, t: T) -> None:
    """Slots one stride apart run as one ggml_mul_mat_id per matrix: no bit may depend on that."""
    experts = [_expert(t, 256, 512, 10 * i) for i in range(5)]
    slot = sum(w.nbytes for w in (experts[0].gate, experts[0].up, experts[0].down)) + 4096
    pooled = _slotted(experts, slot, [7, 2, 30, 3, 11])
    addrs = [(w.gate.data.ctypes.data, w.up.data.ctypes.data, w.down.data.ctypes.data) for w in pooled]
    (stack,) = ggml_cpu.split_stacks(addrs, [1] * 5)
    assert stack.stride == slot and sorted(stack.index) == [0, 1, 5, 9, 28]
    rng = np.random.default_rng(8)
    xs = [rng.standard_normal((n, 256)).astype(np.float32) for n in (1, 4, 2, 1, 3)]
    alone = [kernels.expert_ffns([e], [x])[0] for e, x in zip(experts, xs)]
    for batch, order in ((pooled, range(5)), (pooled[::-1], range(4, -1, -1)), (pooled[:2] + experts[2:], range(5))):
        ys = kernels.expert_ffns(batch, [xs[i] for i in order])
        for i, y in zip(order, ys):
            assert np.array_equal(y, alone[i])


@pytest.mark.parametrize("t", sorted(ggml_cpu.GEMM_TYPES, key=lambda t: t.name))
def test_an_expert_of_several_rows_gives_each_row_the_bits_it_has_alone(kernels, t: T) -> None:
    """Prefill runs an expert's rows together (llamafile's GEMM when ggml has it), decode one at a time:
    a row's output must not depend on that, nor on the path."""
    experts = [_expert(t, 256, 512, 40 + 10 * i) for i in range(3)]
    rng = np.random.default_rng(9)
    xs = [rng.standard_normal((n, 256)).astype(np.float32) for n in (5, 1, 17)]
    together = kernels.expert_ffns(experts, xs)
    for e, x, y in zip(experts, xs, together):
        assert y.shape == x.shape
        rows = np.concatenate([kernels.expert_ffns([e], [x[i: i + 1]])[0] for i in range(len(x))])
        assert np.array_equal(y, rows)
    kernels.expert_gemm = False                      # every expert on ggml_mul_mat_id: the same bits again
    for y, y_stacked in zip(together, kernels.expert_ffns(experts, xs)):
        assert np.array_equal(y, y_stacked)


def test_the_description_says_whether_ggml_has_its_gemm() -> None:
    k = ggml_cpu.GgmlKernels(2)
    assert ("llamafile GEMM" in k.description) and (("no llamafile" in k.description) != ggml_cpu.has_gemm())
    assert k.expert_gemm == ggml_cpu.has_gemm()
    k.close()


def test_expert_ffn_is_swiglu_within_the_stated_error(kernels) -> None:
    e = _expert(T.Q4_K, 256, 512, 20)
    x = np.random.default_rng(7).standard_normal((3, 256)).astype(np.float32)
    want = NumpyKernels().expert_ffns([e], [x])[0]
    assert rel_err(kernels.expert_ffns([e], [x])[0], want.astype(np.float64)) <= 2 * QUANTISED_ACTIVATION_ERROR


def test_a_reused_graph_reads_the_new_weights_and_inputs(kernels) -> None:
    """Graphs are cached by shape; every call must re-point weights, input and output."""
    ws = [quantised(T.Q8_0, (32, 256), seed=s) for s in range(3)]
    xs = [np.random.default_rng(s).standard_normal((1, 256)).astype(np.float32) for s in range(3)]
    first = [kernels.linear(w, x) for w, x in zip(ws, xs)]
    fresh = ggml_cpu.GgmlKernels(2)
    for w, x, y in zip(ws, xs, first):
        assert np.array_equal(fresh.linear(w, x), y)
    assert not np.array_equal(first[0], first[1])
    fresh.close()


def test_outputs_are_fresh_arrays(kernels) -> None:
    w = quantised(T.Q8_0, (32, 256), seed=8)
    x = np.ones((1, 256), np.float32)
    y1 = kernels.linear(w, x)
    keep = y1.copy()
    kernels.linear(w, 2 * x)
    assert np.array_equal(y1, keep)


def test_bad_calls_raise_instead_of_aborting(kernels) -> None:
    w = quantised(T.Q8_0, (32, 256), seed=9)
    with pytest.raises(ValueError, match="columns"):
        kernels.linear(w, np.ones((1, 128), np.float32))
    with pytest.raises(ValueError, match="columns"):
        kernels.linears((w, quantised(T.Q8_0, (32, 512), seed=9)), np.ones((1, 256), np.float32))
    with pytest.raises(ValueError, match="no kernel"):
        kernels.linear(QTensor(np.zeros(32, np.uint8), T.I8, (1, 32)), np.ones((1, 32), np.float32))


def test_a_library_built_for_features_the_cpu_lacks_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(ggml_cpu, "built_features", lambda: ["avx2", "avx512_vnni"])
    monkeypatch.setattr(ggml_cpu.cpu, "flags", lambda: frozenset({"avx", "avx2"}))
    with pytest.raises(ggml_cpu.GgmlUnavailable, match="avx512_vnni"):
        ggml_cpu.probe()


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_activation_gives_non_finite_outputs(kernels, bad: float) -> None:
    """Rounding activations to 8 bits could turn a NaN into plausible numbers; the forward pass must
    see broken weights (a NaN norm) as non-finite values, so the row stays non-finite."""
    w = quantised(T.Q8_0, (32, 256), seed=10)
    x = np.ones((3, 256), np.float32)
    x[1, 5] = bad
    for y in (kernels.linear(w, x), kernels.linears((w, w), x)[1]):
        assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2]]).all()
    (y,) = kernels.expert_ffns([_expert(T.Q8_0, 256, 512, 30)], [x])
    assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2]]).all()


@pytest.mark.parametrize("t", [T.F32, T.Q8_0, T.Q5_0, T.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("positions", [1, 5])
def test_per_head_products_in_one_graph_carry_the_bits_of_one_product_per_head(t: T, positions: int,
                                                                                kernels) -> None:
    """deepseek2's absorbed attn_k_b/attn_v_b: (H, b, a) weights, one 3-D product for all heads, each head's
    rows exactly what a product by that head's matrix alone gives; and the NumPy reference's within rounding."""
    heads, rows, cols = 4, 16, 256
    w = quantised(t, (heads * rows, cols), seed=3)
    w3 = QTensor(w.data, t, (heads, rows, cols))
    x = np.random.default_rng(4).standard_normal((positions, heads, cols)).astype(np.float32)
    got = kernels.head_linears(w3, x)
    assert got.shape == (positions, heads, rows)
    each = np.stack([kernels.linear(w3.row_block(h * rows, (h + 1) * rows), np.ascontiguousarray(x[:, h]))
                     for h in range(heads)], axis=1)
    assert np.array_equal(got, each)
    ref = NumpyKernels().head_linears(w3, x)
    assert rel_err(got, ref) < (1e-6 if t == T.F32 else 2e-2)
    with pytest.raises(ValueError, match="head_linears"):
        kernels.head_linears(w3, x[:, :2])
