"""Quantised kernels against gguf-py's reference dequantisation, and placement invariance.

Test tensors are made by quantising random data with ``gguf.quants.quantize``
where it can (floats, Q8_0, Q4_0); K-quants, which it cannot quantise, are
random but valid raw blocks (finite f16 scales, random quant bits). The
reference is always ``gguf.quants.dequantize(raw) @ x`` in float64.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, quants

from colibri_aio.errors import ModelFormatError
from colibri_aio.kernels import quant
from colibri_aio.kernels.qtensor import QTensor
from colibri_aio.kernels.quant_formats import f16_to_f32
from colibri_aio.kernels.scratch import Scratch

TYPES = sorted(quant.SUPPORTED_TYPES, key=lambda t: t.name)
K_TYPES = {T.Q4_K, T.Q5_K, T.Q6_K}
# Byte offset of each block's f16 scale(s) in the K-quant layouts.
K_SCALE_BYTES = {T.Q4_K: slice(0, 4), T.Q5_K: slice(0, 4), T.Q6_K: slice(208, 210)}


def make_weights(t: T, shape: tuple[int, ...], seed: int = 0) -> QTensor:
    """A valid tensor of type ``t``: quantised random data, or random valid K-quant blocks."""
    rng = np.random.default_rng(seed)
    if t in K_TYPES:
        block, type_size = GGML_QUANT_SIZES[t]
        blocks = rng.integers(0, 256, (int(np.prod(shape)) // block, type_size), dtype=np.uint8)
        n_f16 = (K_SCALE_BYTES[t].stop - K_SCALE_BYTES[t].start) // 2
        scales = (rng.uniform(-1, 1, (blocks.shape[0], n_f16)) * 2e-3).astype(np.float16)
        blocks[:, K_SCALE_BYTES[t]] = scales.view(np.uint8)
        raw = blocks.reshape(-1)
    else:
        a = rng.standard_normal(shape).astype(np.float32)
        raw = quants.quantize(a, t).view(np.uint8).reshape(-1)
    return QTensor(np.ascontiguousarray(raw), t, shape)


def reference(w: QTensor) -> np.ndarray:
    return quants.dequantize(w.data, w.ggml_type).reshape(w.rows, w.cols).astype(np.float64)


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(ours.astype(np.float64) - ref) / np.linalg.norm(ref))


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


def _cols(t: T, blocks: int) -> int:
    """Row length of ``blocks`` blocks (float types count 32 weights as a block)."""
    return max(GGML_QUANT_SIZES[t][0], 32) * blocks


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,blocks", SHAPES)
def test_matvec_matches_reference(t: T, rows: int, blocks: int, small_chunks: None) -> None:
    w = make_weights(t, (rows, _cols(t, blocks)), seed=rows)
    x = np.random.default_rng(1).standard_normal(w.cols).astype(np.float32)
    y = quant.matvec(w, x)
    assert y.dtype == np.float32 and y.shape == (rows,)
    assert rel_err(y, reference(w) @ x) <= 1e-5


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,blocks", SHAPES)
@pytest.mark.parametrize("n_pos", [1, 3, 8, 11])
def test_matmul_matches_reference(t: T, rows: int, blocks: int, n_pos: int, small_chunks: None) -> None:
    w = make_weights(t, (rows, _cols(t, blocks)), seed=rows)
    x = np.random.default_rng(n_pos).standard_normal((n_pos, w.cols)).astype(np.float32)
    y = quant.matmul(w, x)
    assert y.dtype == np.float32 and y.shape == (n_pos, rows)
    assert rel_err(y, x @ reference(w).T) <= 1e-5


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_positive_activations(t: T, small_chunks: None) -> None:
    """All-positive x (as after SwiGLU) makes the -dmin * m term of Q4_K/Q5_K largest: still accurate."""
    w = make_weights(t, (33, _cols(t, 2)), seed=11)
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
    w = make_weights(t, (2, 3, 2 * GGML_QUANT_SIZES[t][0] if t in K_TYPES else 64), seed=5)
    out = quant.dequantize(w)
    assert out.dtype == np.float32 and out.shape == w.shape
    np.testing.assert_array_equal(out.reshape(w.rows, w.cols), reference(w).astype(np.float32))


def _placed(w: QTensor, offset: int) -> QTensor:
    """The same bytes at ``offset`` inside a larger, page-aligned uint8 buffer (like a pool slot)."""
    slot = np.zeros(offset + w.nbytes + 8192, dtype=np.uint8)
    start = (-slot.ctypes.data) % 4096
    view = slot[start + offset: start + offset + w.nbytes]
    view[:] = w.data
    return QTensor(view, w.ggml_type, w.shape)


def _mapped(w: QTensor, path) -> QTensor:
    """The same bytes in a file mapping at a 32-byte (GGUF-style) offset."""
    with open(path, "wb") as f:
        f.write(b"\0" * 96 + w.data.tobytes())
    return QTensor(np.memmap(path, np.uint8, "r", offset=96, shape=(w.nbytes,)), w.ggml_type, w.shape)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_results_do_not_depend_on_where_the_bytes_live(t: T, tmp_path, small_chunks: None) -> None:
    w = make_weights(t, (37, 2 * GGML_QUANT_SIZES[t][0] if t in K_TYPES else 96), seed=6)
    rng = np.random.default_rng(7)
    x, xs = rng.standard_normal(w.cols).astype(np.float32), rng.standard_normal((8, w.cols)).astype(np.float32)
    places = [_placed(w, off) for off in (0, 32, 64 + 32, 4096 + 96)] + [_mapped(w, tmp_path / "w.bin")]
    # x misaligned too: a float32 view at an odd 4-byte offset of a bigger buffer.
    x_odd = np.zeros(w.cols + 3, np.float32)[3:]
    x_odd[:] = x
    want_v, want_m, want_d = quant.matvec(w, x), quant.matmul(w, xs), quant.dequantize(w)
    for p in places:
        assert np.array_equal(quant.matvec(p, x), want_v)
        assert np.array_equal(quant.matvec(p, x_odd), want_v)
        assert np.array_equal(quant.matmul(p, xs), want_m)
        assert np.array_equal(quant.dequantize(p), want_d)


@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_K, T.Q6_K, T.F32], ids=lambda t: t.name)
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
    block, type_size = GGML_QUANT_SIZES[T.Q2_K]
    w = QTensor(np.zeros(4 * type_size, np.uint8), T.Q2_K, (4, block))
    for call in (lambda: quant.dequantize(w), lambda: quant.matvec(w, np.zeros(block, np.float32)),
                 lambda: quant.matmul(w, np.zeros((2, block), np.float32))):
        with pytest.raises(ModelFormatError, match="Q2_K"):
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
