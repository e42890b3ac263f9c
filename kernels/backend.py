"""Which kernels run a product: the compiled (numba) ones where they measured faster, else NumPy.

The forward pass calls :func:`matvec`, :func:`matmul` and :func:`dequantize`
here (same signatures as :mod:`.quant`). The backend is chosen once, by
:func:`set_backend` or the ``COLIBRI_KERNELS`` environment variable:

* ``"numpy"``: always :mod:`.quant` (the reference implementation);
* ``"numba"``: :mod:`.jit` for every type it has a kernel for, NumPy for the rest;
* ``"auto"`` (default): :mod:`.jit` only for the (operation, type) pairs in
  :data:`NUMBA_FASTER`, i.e. where the A/B receipt showed it faster; NumPy
  elsewhere and whenever numba cannot be imported or a kernel fails to compile.

Nothing here raises because numba is missing or broken: the backend falls
back to NumPy and :func:`backend_reason` says why. The numba and NumPy
kernels sum in different orders, so switching backend changes low bits of the
results; within one backend, placement never does (invariant 1).
"""
from __future__ import annotations

import importlib
import os
import threading
from types import ModuleType

import numpy as np
from gguf import GGMLQuantizationType as T

from colibri_aio.kernels import quant, threads
from colibri_aio.kernels.qtensor import QTensor

__all__ = ["NAMES", "NUMBA_FASTER", "RECEIPT", "matvec", "matmul", "dequantize", "set_backend",
           "backend_name", "backend_reason", "warm_up", "set_num_threads"]

NAMES = ("auto", "numpy", "numba")

# Where the compiled kernels beat the NumPy ones (ratio of medians, both on
# 2 threads, every shape measured: experts 768x2048 and 2048x768, attention
# 4096x2048, 512x2048 and 2048x4096, output head 151936x2048 for matvec).
# RECEIPT has every type and shape; two narrower re-runs (Q8_0/Q4_K/Q6_K) are
# evidence/kernels_jit_20261129T183851Z.md and kernels_jit_20261129T184314Z.md.
#   matvec: Q8_0 x4.3-9.8, Q4_K x3.1-8.8, Q6_K x7.2-18.8, Q4_0 x8.9-10.8, Q5_K x5.9-6.2
#   matmul (8 positions): Q8_0 x1.3-3.4, Q4_K x1.2-1.8, Q6_K x2.0-3.8, Q4_0 x2.1-2.5,
#     except one run's 768x2048 (Q8_0 x0.68, Q4_K x0.73 by wall clock while the
#     numba arm got under half a core; per CPU-second numba was ahead there too).
# Not adopted: Q5_K matmul (x0.98 on 2048x768), F16/BF16 (x0.3-1.05; F32 is
# BLAS), dequantize (not on a hot path; not measured).
RECEIPT = "evidence/kernels_jit_20261129T182904Z.md"
NUMBA_FASTER: dict[str, frozenset[T]] = {
    "matvec": frozenset({T.Q8_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K}),
    "matmul": frozenset({T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K}),
    "dequantize": frozenset(),
}

_lock = threading.Lock()
_requested = "numpy"
_jit: ModuleType | None = None      # the compiled kernels, when in use
_reason = "not chosen yet"


def _load_jit() -> ModuleType:
    """Import the compiled kernels (numba is imported there); ImportError if numba is missing."""
    return importlib.import_module("colibri_aio.kernels.jit")


def _use(name: str, jit: ModuleType | None, reason: str) -> None:
    global _requested, _jit, _reason
    _requested, _jit, _reason = name, jit, reason


def set_backend(name: str) -> None:
    """Choose the kernels: ``"auto"``, ``"numpy"`` or ``"numba"`` (see the module docstring)."""
    if name not in NAMES:
        raise ValueError(f"unknown kernel backend {name!r}: choose one of {', '.join(NAMES)}")
    with _lock:
        if name == "numpy":
            _use(name, None, "NumPy kernels requested")
            return
        try:
            jit = _load_jit()
        except Exception as e:  # ImportError, or numba failing to initialise on this platform
            _use(name, None, f"numba unavailable ({type(e).__name__}: {e}); NumPy kernels")
            return
        if name == "numba":
            _use(name, jit, f"numba {jit.numba_version()} requested: compiled kernels for "
                            f"{_types(jit.SUPPORTED_TYPES)}, NumPy for other types")
        else:
            _use(name, jit, f"numba {jit.numba_version()} where it measured faster ({RECEIPT}): "
                            + "; ".join(f"{op} {_types(ts) or 'none'}" for op, ts in NUMBA_FASTER.items())
                            + "; NumPy elsewhere")


def _types(ts: frozenset[T]) -> str:
    return ",".join(sorted(t.name for t in ts))


def backend_name() -> str:
    """``"numba"`` when compiled kernels run for at least one type, else ``"numpy"``."""
    return "numpy" if _jit is None else "numba"


def backend_reason() -> str:
    """One line: what runs and why (including why numba is not used, if it is not), and the matmul path."""
    jit = _jit
    if jit is None:
        return _reason
    return f"{_reason}; matmul of {jit.BLAS_MIN_POSITIONS}+ positions: {jit.get_matmul()}"


def _fallback(e: Exception) -> None:
    """A compiled kernel failed to compile: NumPy from now on, with the reason kept."""
    with _lock:
        if _jit is not None:
            _use(_requested, None, f"numba kernels failed to compile ({type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''}); NumPy kernels")


def _compiled(op: str, w: QTensor) -> ModuleType | None:
    """The jit module if it should run ``op`` on ``w``'s type, else None."""
    jit = _jit
    if jit is None or w.ggml_type not in jit.SUPPORTED_TYPES:
        return None
    if _requested == "auto" and w.ggml_type not in NUMBA_FASTER[op]:
        return None
    return jit


def _run(op: str, w: QTensor, *args: np.ndarray) -> np.ndarray:
    jit = _compiled(op, w)
    if jit is not None:
        try:
            return getattr(jit, op)(w, *args)
        except jit.numba.core.errors.NumbaError as e:
            _fallback(e)
    return getattr(quant, op)(w, *args)


def matvec(w: QTensor, x: np.ndarray) -> np.ndarray:
    """``W @ x`` for one position: x (cols,) float32 -> (rows,) float32."""
    return _run("matvec", w, x)


def matmul(w: QTensor, x: np.ndarray) -> np.ndarray:
    """``x @ W.T`` for a batch of positions: x (T, cols) float32 -> (T, rows) float32."""
    return _run("matmul", w, x)


def dequantize(w: QTensor) -> np.ndarray:
    """All weights of ``w`` as a new float32 array of shape ``w.shape``."""
    return _run("dequantize", w)


def warm_up(types: tuple[T, ...] | None = None) -> float:
    """Compile or load from numba's on-disk cache every kernel in use; seconds spent (0 for NumPy).

    Call once at start so that the first token pays no compilation. A failure
    to compile switches to NumPy (see :func:`backend_reason`) instead of raising.
    """
    jit = _jit
    if jit is None:
        return 0.0
    if types is not None:  # types with no compiled kernel run on NumPy: nothing to compile
        types = tuple(t for t in types if t in jit.SUPPORTED_TYPES)
        if not types:
            return 0.0
    try:
        return jit.warm_up(types)
    except jit.numba.core.errors.NumbaError as e:
        _fallback(e)
        return 0.0


def set_num_threads(n: int) -> None:
    """Threads per kernel call, for both backends."""
    threads.set_num_threads(n)  # one pool serves both backends


def _initial() -> None:
    """The backend named by COLIBRI_KERNELS (default auto); a bad name is noted, not raised, at import."""
    name = os.environ.get("COLIBRI_KERNELS", "auto")
    if name in NAMES:
        set_backend(name)
    else:
        set_backend("auto")
        _use("auto", _jit, f"COLIBRI_KERNELS={name!r} is not one of {', '.join(NAMES)}; auto: {_reason}")


_initial()
