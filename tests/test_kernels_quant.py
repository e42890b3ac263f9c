"""Quantised kernels against gguf-py's reference dequantisation, and placement invariance.

Test tensors are made by quantising random data with ``gguf.quants.quantize``
where it can (floats, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4, TQ1_0, TQ2_0); the
K-quants, the IQ types and NVFP4, which it cannot quantise, are random but valid
raw blocks (finite f16 scales, random quant bits). The reference is always
``gguf.quants.dequantize(raw) @ x`` in float64; ggml's own ``to_float`` (through
ggml-python, where installed) checks that reference in turn, bit for bit.
"""
from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, quants

from colibri_aio.errors import ModelFormatError
from colibri_aio.kernels import quant
from colibri_aio.kernels.qtensor import QTensor
from colibri_aio.kernels.quant_formats import f16_to_f32
from colibri_aio.kernels.scratch import Scratch

from kernel_data import cols_for, make_weights, mapped, placed, random_bytes, reference, rel_err

TYPES = sorted(quant.SUPPORTED_TYPES, key=lambda t: t.name)
QUANTISED = [t for t in TYPES if t not in (T.F32, T.F16, T.BF16)]


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of a few rows and scale batches of a few chunks, so small tensors cross every boundary."""
    monkeypatch.setattr(quant, "MATVEC_CHUNK_WEIGHTS", 1024)
    monkeypatch.setattr(quant, "MATMUL_CHUNK_WEIGHTS", 1024)
    monkeypatch.setattr(quant, "SCALE_BATCH_BYTES", 2048)


@pytest.fixture
def threads():
    """Restore the kernel thread count after a test changes it."""
    before = quant.get_num_threads()
    yield quant.set_num_threads
    quant.set_num_threads(before)


SHAPES = [(1, 1), (3, 1), (17, 3), (97, 2)]  # (rows, blocks per row)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,blocks", SHAPES)
def test_matvec_matches_reference(t: T, rows: int, blocks: int, small_chunks: None) -> None:
    w = make_weights(t, (rows, cols_for(t, blocks)), seed=rows)
    x = np.random.default_rng(1).standard_normal(w.cols).astype(np.float32)
    y = quant.matvec(w, x)
    assert y.dtype == np.float32 and y.shape == (rows,)
    assert rel_err(y, reference(w) @ x) <= 1e-5


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,blocks", SHAPES)
@pytest.mark.parametrize("n_pos", [1, 3, 8, 11])
def test_matmul_matches_reference(t: T, rows: int, blocks: int, n_pos: int, small_chunks: None) -> None:
    w = make_weights(t, (rows, cols_for(t, blocks)), seed=rows)
    x = np.random.default_rng(n_pos).standard_normal((n_pos, w.cols)).astype(np.float32)
    y = quant.matmul(w, x)
    assert y.dtype == np.float32 and y.shape == (n_pos, rows)
    assert rel_err(y, x @ reference(w).T) <= 1e-5


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_positive_activations(t: T, small_chunks: None) -> None:
    """All-positive x (as after SwiGLU) makes the -dmin * m term of Q4_K/Q5_K largest: still accurate."""
    w = make_weights(t, (33, cols_for(t, 2)), seed=11)
    rng = np.random.default_rng(12)
    x, xs = np.abs(rng.standard_normal(w.cols)).astype(np.float32), np.abs(rng.standard_normal((4, w.cols))).astype(np.float32)
    assert rel_err(quant.matvec(w, x), reference(w) @ x) <= 1e-5
    assert rel_err(quant.matmul(w, xs), xs @ reference(w).T) <= 1e-5


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_default_chunking_on_an_expert_sized_matrix(t: T) -> None:
    """Several real chunks and both workers, at the default chunk size."""
    w = make_weights(t, (300, 1024), seed=3)
    rng = np.random.default_rng(4)
    x, xs = rng.standard_normal(1024).astype(np.float32), rng.standard_normal((5, 1024)).astype(np.float32)
    ref = reference(w)
    assert rel_err(quant.matvec(w, x), ref @ x) <= 1e-5
    assert rel_err(quant.matmul(w, xs), xs @ ref.T) <= 1e-5


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf_reference(t: T, small_chunks: None) -> None:
    w = make_weights(t, (2, 3, cols_for(t, 2)), seed=5)
    out = quant.dequantize(w)
    assert out.dtype == np.float32 and out.shape == w.shape
    np.testing.assert_array_equal(out.reshape(w.rows, w.cols), reference(w).astype(np.float32))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.filterwarnings("ignore:(overflow|invalid value):RuntimeWarning")  # inf and NaN, on purpose
def test_dequantize_of_every_bit_pattern_equals_gguf(t: T, small_chunks: None) -> None:
    """Random bytes everywhere, scales included: subnormal, huge, infinite and NaN scales decode as gguf's."""
    w = random_bytes(t, (41, cols_for(t, 3)), seed=13)
    np.testing.assert_array_equal(quant.dequantize(w), reference(w).astype(np.float32))


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")  # 2^127 * 12 is inf, in gguf's too
def test_mxfp4_scales_cover_every_exponent() -> None:
    """One block per E8M0 exponent 0..255 (subnormal halves at 0 and 1, 2^127 at 255), every nibble."""
    block, type_size = GGML_QUANT_SIZES[T.MXFP4]
    raw = np.empty((256, type_size), np.uint8)
    raw[:, 0] = np.arange(256)
    raw[:, 1:] = np.arange(16, dtype=np.uint8) * 17  # nibble pairs (0,0), (1,1) ... (15,15)
    w = QTensor(raw.reshape(-1), T.MXFP4, (8, 32 * block))
    np.testing.assert_array_equal(quant.dequantize(w), reference(w).astype(np.float32))


@pytest.mark.parametrize("t", [T.IQ1_S, T.IQ1_M], ids=lambda t: t.name)
@pytest.mark.filterwarnings("ignore:(overflow|invalid value):RuntimeWarning")
def test_iq1_infinite_and_signed_zero_scales_decode_as_gguf(t: T) -> None:
    """ggml computes dl * (grid + delta): with an infinite dl a zero grid value gives an infinity, not the
    NaN that dl * grid + dl * delta would; with a zero dl the sign is that of the product."""
    block, type_size = GGML_QUANT_SIZES[t]
    d = np.repeat(np.array([0x7C00, 0xFC00, 0x7E00, 0x8000, 0x0000, 0x0001, 0x7BFF], np.uint16), 4)
    raw = np.random.default_rng(17).integers(0, 256, (d.size, type_size), dtype=np.uint8)
    if t == T.IQ1_S:
        raw[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    else:  # the f16 is the top nibbles of the four u16 at bytes 48-55, low nibble first
        sc = raw[:, 48:56].view(np.uint16)
        sc &= np.uint16(0x0FFF)
        sc |= ((d[:, None] >> np.array([0, 4, 8, 12], np.uint16)) & np.uint16(0xF)) << np.uint16(12)
    w = QTensor(raw.reshape(-1), t, (7, 4 * block))
    ours, want = quant.dequantize(w), reference(w).astype(np.float32)
    assert np.isinf(want).any()
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(want))
    finite_or_inf = ~np.isnan(want)
    np.testing.assert_array_equal(ours.view(np.uint32)[finite_or_inf], want.view(np.uint32)[finite_or_inf])


@pytest.mark.parametrize("t", QUANTISED, ids=lambda t: t.name)
def test_dequantize_is_bit_identical_to_gguf_and_ggml(t: T) -> None:
    """Ours, gguf-py's reference and ggml's C dequantisation (``to_float`` of its type traits) give the
    same float32 bits (signed zeros included) on valid random blocks."""
    ggml = pytest.importorskip("ggml", reason="ggml-python checks the gguf-py reference against ggml's C code")
    w = make_weights(t, (7, cols_for(t, 2)), seed=14)
    out = np.empty(w.rows * w.cols, np.float32)
    traits = ggml.ggml_get_type_traits(int(t)).contents
    traits.to_float(w.data.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                    out.size)
    ref = quants.dequantize(w.data, t).reshape(w.rows, w.cols)
    assert ref.dtype == np.float32 and np.isfinite(ref).all()
    np.testing.assert_array_equal(out.reshape(w.rows, w.cols).view(np.uint32), ref.view(np.uint32))
    np.testing.assert_array_equal(quant.dequantize(w).view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_results_do_not_depend_on_where_the_bytes_live(t: T, tmp_path, small_chunks: None) -> None:
    w = make_weights(t, (37, cols_for(t, 3)), seed=6)
    rng = np.random.default_rng(7)
    x, xs = rng.standard_normal(w.cols).astype(np.float32), rng.standard_normal((8, w.cols)).astype(np.float32)
    places = [placed(w, off) for off in (0, 32, 64 + 32, 4096 + 96)] + [mapped(w, tmp_path / "w.bin")]
    # x misaligned too: a float32 view at an odd 4-byte offset of a bigger buffer.
    x_odd = np.zeros(w.cols + 3, np.float32)[3:]
    x_odd[:] = x
    want_v, want_m, want_d = quant.matvec(w, x), quant.matmul(w, xs), quant.dequantize(w)
    for p in places:
        assert np.array_equal(quant.matvec(p, x), want_v)
        assert np.array_equal(quant.matvec(p, x_odd), want_v)
        assert np.array_equal(quant.matmul(p, xs), want_m)
        assert np.array_equal(quant.dequantize(p), want_d)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_every_byte_offset_gives_the_same_bits(t: T, small_chunks: None) -> None:
    """An expert slice may start at any byte of a slot (blocks of 17, 22 or 110 bytes put fields anywhere)."""
    w = make_weights(t, (9, cols_for(t, 2)), seed=15)
    rng = np.random.default_rng(16)
    x, xs = rng.standard_normal(w.cols).astype(np.float32), rng.standard_normal((3, w.cols)).astype(np.float32)
    want_v, want_m, want_d = quant.matvec(w, x), quant.matmul(w, xs), quant.dequantize(w)
    for off in range(1, 33):
        p = placed(w, off)
        assert np.array_equal(quant.matvec(p, x), want_v), off
        assert np.array_equal(quant.matmul(p, xs), want_m), off
        assert np.array_equal(quant.dequantize(p), want_d), off


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_results_do_not_depend_on_thread_count_or_repetition(t: T, threads, small_chunks: None) -> None:
    w = make_weights(t, (61, 512), seed=8)
    rng = np.random.default_rng(9)
    x, xs = rng.standard_normal(512).astype(np.float32), rng.standard_normal((3, 512)).astype(np.float32)
    threads(1)
    want_v, want_m = quant.matvec(w, x), quant.matmul(w, xs)
    for n in (2, 3, 2):
        threads(n)
        for _ in range(2):
            assert np.array_equal(quant.matvec(w, x), want_v)
            assert np.array_equal(quant.matmul(w, xs), want_m)


def test_f16_decoding_is_exact_for_every_bit_pattern() -> None:
    """Normals, subnormals, signed zeros, infinities and NaN payloads, against NumPy's own conversion."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = f16_to_f32(bits, np.empty(bits.shape, np.float32), Scratch())
    want = bits.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))


def test_unsupported_type_is_a_model_format_error() -> None:
    """F64: a type GGUF files carry but neither backend multiplies (ggml's CPU has no F64 dot product)."""
    w = QTensor(np.zeros(4 * 32 * 8, np.uint8), T.F64, (4, 32))
    for call in (lambda: quant.dequantize(w), lambda: quant.matvec(w, np.zeros(32, np.float32)),
                 lambda: quant.matmul(w, np.zeros((2, 32), np.float32))):
        with pytest.raises(ModelFormatError, match="F64"):
            call()


def test_wrong_x_shape_is_refused() -> None:
    w = make_weights(T.Q8_0, (4, 64))
    with pytest.raises(ValueError, match="cols=64"):
        quant.matvec(w, np.zeros(32, np.float32))
    with pytest.raises(ValueError, match="cols=64"):
        quant.matmul(w, np.zeros(64, np.float32))


def test_matmul_of_no_positions_is_empty() -> None:
    w = make_weights(T.Q4_0, (4, 64))
    assert quant.matmul(w, np.zeros((0, 64), np.float32)).shape == (0, 4)


def test_a_failing_chunk_reaches_the_caller(threads, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error in a worker thread propagates; nothing is swallowed."""
    threads(2)
    w = make_weights(T.Q8_0, (64, 64))
    fmt = quant.FORMATS[T.Q8_0]
    calls = []

    def failing_prepare(raw: np.ndarray, index):
        calls.append(raw.shape[0])
        if len(calls) == 2:
            raise RuntimeError("boom")
        return fmt.prepare(raw, index)

    monkeypatch.setattr(quant, "FORMATS", {T.Q8_0: dataclasses.replace(fmt, prepare=failing_prepare)})
    monkeypatch.setattr(quant, "MATVEC_CHUNK_WEIGHTS", 64)
    monkeypatch.setattr(quant, "SCALE_BATCH_BYTES", 64)
    with pytest.raises(RuntimeError, match="boom"):
        quant.matvec(w, np.zeros(64, np.float32))
