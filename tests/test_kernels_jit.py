"""The compiled (numba) kernels against gguf-py's dequantisation, their bit-identity guarantees,
both matmul paths (fused and BLAS), and the backend dispatcher's choices and fallbacks.

Reference: ``gguf.quants.dequantize(raw) @ x`` in float64. Test tensors are
quantised random data (floats, Q8_0, Q4_0) or random valid K-quant blocks.
Every kernel is compiled once per process (and cached on disk by numba), so
the many cases below cost little beyond the first.
"""
from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

pytest.importorskip("numba", reason="numba is not installed: the compiled kernels are optional")

from colibri_aio.kernels import backend, jit, quant  # noqa: E402
from colibri_aio.kernels.qtensor import QTensor  # noqa: E402

from kernel_data import make_weights, mapped, placed, reference, rel_err  # noqa: E402

TYPES = sorted(jit.SUPPORTED_TYPES, key=lambda t: t.name)








def cols_of(t: T, blocks: int) -> int:
    """``blocks`` blocks of the type (floats count 32 weights as a block)."""
    return max(GGML_QUANT_SIZES[t][0], 32) * blocks


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of a few rows, so small tensors cross chunk boundaries and use both threads."""
    monkeypatch.setattr(jit, "CHUNK_WEIGHTS", 1024)
    monkeypatch.setattr(jit, "BLAS_CHUNK_WEIGHTS", 1024)
    monkeypatch.setattr(jit, "BLAS_SMALL_MACS", 4096)
    monkeypatch.setattr(jit, "BLAS_MAX_CHUNK_WEIGHTS", 2048)


@pytest.fixture
def restore_jit():
    """Put the thread count, parallel mode and matmul path back after a test changes them."""
    threads, mode, path = jit.get_num_threads(), jit._parallel, jit.get_matmul()
    yield
    jit.set_num_threads(threads)
    jit.set_parallel(mode)
    jit.set_matmul(path)


@pytest.fixture(params=jit.MATMUL_PATHS)
def matmul_path(request: pytest.FixtureRequest, restore_jit) -> str:
    """Run a test with each matmul path."""
    jit.set_matmul(request.param)
    return request.param


@pytest.fixture
def restore_backend():
    """Put the dispatcher's choice back after a test changes it."""
    state = (backend._requested, backend._jit, backend._reason)
    yield
    backend._use(*state)


# --- agreement with the reference ---

@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 17, 97])
@pytest.mark.parametrize("blocks", [1, 3])
def test_matvec_and_matmul_match_reference(t: T, rows: int, blocks: int, small_chunks: None,
                                           matmul_path: str) -> None:
    w = make_weights(t, (rows, cols_of(t, blocks)), seed=rows + blocks)
    ref = reference(w)
    rng = np.random.default_rng(rows)
    x = rng.standard_normal(w.cols).astype(np.float32)
    y = jit.matvec(w, x)
    assert y.dtype == np.float32 and y.shape == (rows,)
    assert rel_err(y, ref @ x) <= 1e-5
    for n_pos in (1, 3, jit.BLAS_MIN_POSITIONS, 8, 33):
        xs = rng.standard_normal((n_pos, w.cols)).astype(np.float32)
        ys = jit.matmul(w, xs)
        assert ys.dtype == np.float32 and ys.shape == (n_pos, rows)
        assert rel_err(ys, xs @ ref.T) <= 1e-5


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_positive_activations(t: T, matmul_path: str) -> None:
    """All-positive x (as after SwiGLU) makes Q4_K/Q5_K's -dmin * m term largest: still accurate."""
    w = make_weights(t, (33, cols_of(t, 2)), seed=11)
    rng = np.random.default_rng(12)
    x, xs = np.abs(rng.standard_normal(w.cols)), np.abs(rng.standard_normal((9, w.cols)))
    x, xs = x.astype(np.float32), xs.astype(np.float32)
    assert rel_err(jit.matvec(w, x), reference(w) @ x) <= 1e-5
    assert rel_err(jit.matmul(w, xs), xs @ reference(w).T) <= 1e-5


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf_reference(t: T, small_chunks: None) -> None:
    w = make_weights(t, (2, 3, cols_of(t, 2)), seed=5)
    out = jit.dequantize(w)
    assert out.dtype == np.float32 and out.shape == w.shape
    np.testing.assert_array_equal(out.reshape(w.rows, w.cols), reference(w).astype(np.float32))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_fused_matmul_rows_equal_matvec_bit_for_bit(t: T, small_chunks: None, restore_jit) -> None:
    """With the fused path, prefill and decode of the same position give the same bits."""
    jit.set_matmul("fused")
    w = make_weights(t, (19, cols_of(t, 2)), seed=13)
    xs = np.random.default_rng(14).standard_normal((11, w.cols)).astype(np.float32)
    ys = jit.matmul(w, xs)
    for i in range(xs.shape[0]):
        assert np.array_equal(ys[i], jit.matvec(w, xs[i]))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_blas_matmul_rows_are_as_accurate_as_matvec(t: T, small_chunks: None, restore_jit) -> None:
    """With the BLAS path each row is within float32 rounding of the reference, like matvec,
    though not necessarily the same bits."""
    jit.set_matmul("blas")
    w = make_weights(t, (19, cols_of(t, 2)), seed=13)
    ref = reference(w)
    xs = np.random.default_rng(14).standard_normal((11, w.cols)).astype(np.float32)
    ys = jit.matmul(w, xs)
    for i in range(xs.shape[0]):
        assert rel_err(ys[i], ref @ xs[i]) <= 1e-5
        assert rel_err(jit.matvec(w, xs[i]), ref @ xs[i]) <= 1e-5


@pytest.mark.parametrize("n_pos", [1, 2, jit.BLAS_MIN_POSITIONS - 1])
def test_few_positions_stay_on_the_fused_kernels(n_pos: int, small_chunks: None, restore_jit) -> None:
    """Decode (one position) and batches below BLAS_MIN_POSITIONS keep matvec's bits on the BLAS path."""
    jit.set_matmul("blas")
    w = make_weights(T.Q8_0, (19, 256), seed=17)
    xs = np.random.default_rng(18).standard_normal((n_pos, w.cols)).astype(np.float32)
    ys = jit.matmul(w, xs)
    for i in range(n_pos):
        assert np.array_equal(ys[i], jit.matvec(w, xs[i]))


def test_blas_scratch_is_per_chunk_not_per_matrix(restore_jit) -> None:
    """The BLAS path decodes a chunk of rows at a time: its float32 scratch is bounded by the
    chunk, never a float32 copy of the whole matrix."""
    from colibri_aio.kernels.scratch import thread_scratch

    jit.set_matmul("blas")
    jit.set_num_threads(1)  # every chunk on this thread, so its scratch is the one to inspect
    w = make_weights(T.Q8_0, (4096, 256), seed=19)
    xs = np.random.default_rng(20).standard_normal((9, w.cols)).astype(np.float32)
    assert rel_err(jit.matmul(w, xs), xs @ reference(w).T) <= 1e-5
    chunk_bytes = 4 * jit._blas_step(xs.shape[0], w.cols) * w.cols
    assert chunk_bytes < 4 * w.rows * w.cols // 8
    assert thread_scratch()._buffers["blas_w"].nbytes <= 2 * chunk_bytes


def test_matmul_path_is_chosen_by_name_and_environment(restore_jit, monkeypatch) -> None:
    with pytest.raises(ValueError, match="blas, fused"):
        jit.set_matmul("gemm")
    monkeypatch.setenv("COLIBRI_MATMUL", "fused")
    assert jit._initial_matmul() == "fused"
    monkeypatch.setenv("COLIBRI_MATMUL", "gemm")
    with pytest.warns(RuntimeWarning, match="gemm"):
        assert jit._initial_matmul() == jit.DEFAULT_MATMUL


# --- bit-identity: placement, threads, repetition ---





@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_results_do_not_depend_on_where_the_bytes_live(t: T, tmp_path, small_chunks: None,
                                                       matmul_path: str) -> None:
    w = make_weights(t, (37, cols_of(t, 2)), seed=6)
    rng = np.random.default_rng(7)
    x, xs = rng.standard_normal(w.cols).astype(np.float32), rng.standard_normal((8, w.cols)).astype(np.float32)
    x_odd = np.zeros(w.cols + 3, np.float32)[3:]  # x at a 12-byte offset
    x_odd[:] = x
    xs_odd = np.zeros(xs.size + 3, np.float32)[3:].reshape(xs.shape)
    xs_odd[:] = xs
    want = jit.matvec(w, x), jit.matmul(w, xs), jit.dequantize(w)
    places = [placed(w, off) for off in (0, 1, 32, 64 + 32, 4096 + 96)] + [mapped(w, tmp_path / "w.bin")]
    for p in places:
        assert np.array_equal(jit.matvec(p, x), want[0])
        assert np.array_equal(jit.matvec(p, x_odd), want[0])
        assert np.array_equal(jit.matmul(p, xs), want[1])
        assert np.array_equal(jit.matmul(p, xs_odd), want[1])
        assert np.array_equal(jit.dequantize(p), want[2])


@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_results_do_not_depend_on_threads_chunks_or_repetition(t: T, matmul_path: str, monkeypatch) -> None:
    """The fused kernels compute a row whole, so not even their chunk size changes a bit; the BLAS
    path's chunk grid is fixed by the row length, so thread count and scheduling do not."""
    monkeypatch.setattr(jit, "BLAS_SMALL_MACS", 9 * 512 * 8)  # 8 chunks of 8 rows, taken by every thread
    w = make_weights(t, (61, 512), seed=8)
    rng = np.random.default_rng(9)
    x, xs = rng.standard_normal(512).astype(np.float32), rng.standard_normal((9, 512)).astype(np.float32)
    jit.set_num_threads(1)
    want_v, want_m = jit.matvec(w, x), jit.matmul(w, xs)
    for n, chunk in ((2, 1024), (3, 512), (2, 1 << 18), (1, 4096)):
        jit.set_num_threads(n)
        monkeypatch.setattr(jit, "CHUNK_WEIGHTS", chunk)
        for _ in range(2):
            assert np.array_equal(jit.matvec(w, x), want_v)
            assert np.array_equal(jit.matmul(w, xs), want_m)


def test_prange_mode_gives_the_same_bits(restore_jit, small_chunks: None) -> None:
    """numba's own thread pool runs the same row chunks: same results as Python threads."""
    for t in (T.Q8_0, T.Q4_K):
        w = make_weights(t, (45, 512), seed=10)
        rng = np.random.default_rng(10)
        x, xs = rng.standard_normal(512).astype(np.float32), rng.standard_normal((5, 512)).astype(np.float32)
        jit.set_parallel("pool")
        want = jit.matvec(w, x), jit.matmul(w, xs)
        jit.set_parallel("prange")
        assert np.array_equal(jit.matvec(w, x), want[0])
        assert np.array_equal(jit.matmul(w, xs), want[1])


# --- the int8-activation candidate ---

def test_int8_activation_candidate_is_close_but_not_exact() -> None:
    """llama.cpp-style int8 x: error ~1e-3..1e-2 relative, far above the f32 kernels' 1e-7."""
    w = make_weights(T.Q8_0, (64, 1024), seed=15)
    x = np.random.default_rng(16).standard_normal(1024).astype(np.float32)
    ref = reference(w) @ x
    err = rel_err(jit.matvec_q8(w, x), ref)
    assert 1e-5 < err < 2e-2
    assert rel_err(jit.matvec(w, x), ref) <= 1e-5
    with pytest.raises(TypeError, match="Q8_0"):
        jit.matvec_q8(make_weights(T.Q4_0, (2, 64)), np.zeros(64, np.float32))


# --- refusals ---

def test_wrong_x_shape_and_unsupported_type_are_refused() -> None:
    w = make_weights(T.Q8_0, (4, 64))
    with pytest.raises(ValueError, match="cols=64"):
        jit.matvec(w, np.zeros(32, np.float32))
    with pytest.raises(ValueError, match="cols=64"):
        jit.matmul(w, np.zeros(64, np.float32))
    assert jit.matmul(w, np.zeros((0, 64), np.float32)).shape == (0, 4)
    block, type_size = GGML_QUANT_SIZES[T.Q2_K]
    q2 = QTensor(np.zeros(4 * type_size, np.uint8), T.Q2_K, (4, block))
    with pytest.raises(TypeError, match="Q2_K"):
        jit.matvec(q2, np.zeros(block, np.float32))


def test_warm_up_reports_its_time() -> None:
    seconds = jit.warm_up((T.Q8_0,))
    assert 0.0 <= seconds < 600


# --- the dispatcher ---

def test_backend_names_and_routing(restore_backend) -> None:
    w, f = make_weights(T.Q8_0, (9, 64), seed=1), make_weights(T.F32, (9, 64), seed=1)
    x = np.random.default_rng(2).standard_normal(64).astype(np.float32)
    backend.set_backend("numpy")
    assert backend.backend_name() == "numpy" and "NumPy" in backend.backend_reason()
    assert np.array_equal(backend.matvec(w, x), quant.matvec(w, x))
    backend.set_backend("numba")
    assert backend.backend_name() == "numba" and "numba" in backend.backend_reason()
    assert np.array_equal(backend.matvec(w, x), jit.matvec(w, x))
    backend.set_backend("auto")
    assert backend.backend_name() == "numba"
    for op, args in (("matvec", (x,)), ("matmul", (x[None].repeat(3, 0),)), ("dequantize", ())):
        for t in (w, f):
            chosen = jit if t.ggml_type in backend.NUMBA_FASTER[op] else quant
            assert np.array_equal(getattr(backend, op)(t, *args), getattr(chosen, op)(t, *args))
    with pytest.raises(ValueError, match="auto, numpy, numba"):
        backend.set_backend("fast")


def test_backend_types_without_a_compiled_kernel_use_numpy(restore_backend) -> None:
    backend.set_backend("numba")
    q2 = make_weights(T.Q2_K, (4, 256), seed=3)
    x = np.random.default_rng(4).standard_normal(256).astype(np.float32)
    assert np.array_equal(backend.matvec(q2, x), quant.matvec(q2, x))
    assert backend.warm_up((T.Q2_K, T.MXFP4)) == 0.0  # nothing compiled for them, nothing raised
    assert backend.warm_up((T.Q2_K, T.Q8_0)) >= 0.0


def test_backend_falls_back_to_numpy_without_numba(restore_backend, monkeypatch) -> None:
    """numba missing: the import of the compiled kernels fails, NumPy is chosen, the reason says so."""
    monkeypatch.setitem(sys.modules, "numba", None)
    monkeypatch.setitem(sys.modules, "colibri_aio.kernels.jit", None)
    for name in ("auto", "numba"):
        backend.set_backend(name)
        assert backend.backend_name() == "numpy"
        assert "numba unavailable" in backend.backend_reason()
    w = make_weights(T.Q8_0, (5, 64))
    x = np.ones(64, np.float32)
    assert np.array_equal(backend.matvec(w, x), quant.matvec(w, x))
    assert backend.warm_up() == 0.0


def test_backend_module_imports_without_numba(monkeypatch) -> None:
    """A fresh import of the dispatcher with numba unimportable does not raise."""
    monkeypatch.setitem(sys.modules, "numba", None)
    monkeypatch.setitem(sys.modules, "colibri_aio.kernels.jit", None)
    monkeypatch.delitem(sys.modules, "colibri_aio.kernels.backend")
    fresh = importlib.import_module("colibri_aio.kernels.backend")
    assert fresh is not backend
    assert fresh.backend_name() == "numpy" and "numba unavailable" in fresh.backend_reason()


def test_backend_falls_back_when_a_kernel_fails_to_compile(restore_backend, monkeypatch) -> None:
    import numba.core.errors

    def broken(w, x):
        raise numba.core.errors.TypingError("simulated compile failure")

    backend.set_backend("numba")
    monkeypatch.setattr(jit, "matvec", broken)
    w = make_weights(T.Q8_0, (5, 64))
    x = np.ones(64, np.float32)
    assert np.array_equal(backend.matvec(w, x), quant.matvec(w, x))
    assert backend.backend_name() == "numpy"
    assert "failed to compile" in backend.backend_reason()


def test_bad_environment_name_is_noted_not_raised(restore_backend, monkeypatch) -> None:
    monkeypatch.setenv("COLIBRI_KERNELS", "turbo")
    backend._initial()
    assert "turbo" in backend.backend_reason()
    assert backend.backend_name() in ("numpy", "numba")


def test_auto_choices_cite_a_receipt_that_exists() -> None:
    from pathlib import Path

    receipt = Path(__file__).resolve().parents[1] / backend.RECEIPT
    assert receipt.is_file(), f"{backend.RECEIPT} is cited by the auto backend but missing"
    text = receipt.read_text()
    for op, types in backend.NUMBA_FASTER.items():
        for t in types:
            assert f"| {t.name} | {op} |" in text, f"{t.name} {op} is adopted without a measurement"
