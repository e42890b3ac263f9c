"""Kernel backends: which implementation runs an engine's products.

An engine owns one :class:`Kernels` object, made by :func:`open_kernels`
when it starts; the forward pass calls only the operations below, which
know nothing of any model family:

    linear(w, x)             x (T, cols) -> (T, rows)              one product
    linears(ws, x)           [x @ W.T for W in ws]                 several products on one input
    expert_ffns(es, xs, act) [down(act(gate x, up x)) per expert]  a batch of routed expert FFNs
    dequantize(w)            (rows, cols) float32                  e.g. embedding rows

Backends (``--kernels``):

* ``ggml``: ggml's CPU kernels (:mod:`.ggml_cpu`, ggml-python), the ones
  llama.cpp runs; products batched into cached graphs. Activations are
  rounded to 8 bits before each quantised product, as llama.cpp does.
* ``numpy``: the reference (:mod:`.quant`); float32 products of the exact
  dequantised weights, and the backend the oracle tests check exactly.
* ``auto`` (default): ggml when it loads on this machine, else NumPy, with
  the reason in :attr:`Kernels.reason` (the engine's start line and
  ``doctor`` print it). ggml was faster on every type and shape measured:
  see :data:`RECEIPT`.

The numba kernels of earlier versions are gone: ggml beat them on every
type and shape (same receipt), and every type a backend carries must be
written, tested and kept for it; ggml ships every GGUF type already.

Backends differ in their last bits (and ggml by its rounding of
activations); within one backend, placement never changes a bit.
"""
from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np
from gguf import GGMLQuantizationType

from colibri_aio import probes
from colibri_aio.kernels import quant
from colibri_aio.kernels.ops import swiglu
from colibri_aio.kernels.qtensor import FFNWeights, QTensor
from colibri_aio.kernels.threads import get_num_threads
from colibri_aio.settings import Settings

__all__ = ["NAMES", "RECEIPT", "FFNWeights", "Kernels", "KernelsUnavailable", "NumpyKernels", "open_kernels"]

NAMES = ("auto", "ggml", "numpy")
RECEIPT = "evidence/kernels_backends_*.md"


class KernelsUnavailable(RuntimeError):
    """A backend asked for by name cannot run here; the message says why (``verdict``: the probe's, if one failed)."""

    def __init__(self, message: str, verdict: probes.Verdict | None = None) -> None:
        super().__init__(message)
        self.verdict = verdict


class Kernels(Protocol):
    """What the forward pass asks of a backend (module docstring)."""

    name: str
    reason: str

    @property
    def types(self) -> frozenset[GGMLQuantizationType]:
        """The GGUF types this backend multiplies by."""

    def linear(self, w: QTensor, x: np.ndarray) -> np.ndarray: ...

    def linears(self, ws: Sequence[QTensor], x: np.ndarray) -> list[np.ndarray]: ...

    def head_linears(self, w: QTensor, x: np.ndarray) -> np.ndarray:
        """Per-head products: ``w`` (H, b, a), x (T, H, a) -> (T, H, b), head h's rows by ``w[h]``."""

    def expert_ffns(self, experts: Sequence[FFNWeights], xs: Sequence[np.ndarray],
                    activation: str = "swiglu") -> list[np.ndarray]: ...

    def dequantize(self, w: QTensor) -> np.ndarray: ...

    def resident(self, ws: Iterable[QTensor | None]) -> int:
        """Matrices that stay in memory as long as this backend serves them (a net's trunk): the backend may
        keep a copy of them in a layout of its own; returns the bytes such copies take."""

    def expert_packer(self) -> object | None:
        """What puts routed experts into a layout of this backend's own as they land (``packs(type, rows)``,
        ``pack(w, out=None)``), for the expert source; None: they are multiplied in the file's layout."""

    def close(self) -> None: ...


_ACTIVATIONS = {"swiglu": swiglu}


class NumpyKernels:
    """The reference: :mod:`.quant` on the shared kernel thread pool, one product at a time."""

    name = "numpy"

    def __init__(self, reason: str = "NumPy kernels requested") -> None:
        self.reason = reason

    @property
    def types(self) -> frozenset[GGMLQuantizationType]:
        return quant.SUPPORTED_TYPES

    def linear(self, w: QTensor, x: np.ndarray) -> np.ndarray:
        """x (T, cols) -> (T, rows); one position takes the matvec kernel, more the matmul one."""
        if x.shape[0] == 1:
            return quant.matvec(w, x[0])[None, :]
        return quant.matmul(w, x)

    def linears(self, ws: Sequence[QTensor], x: np.ndarray) -> list[np.ndarray]:
        return [self.linear(w, x) for w in ws]

    def head_linears(self, w: QTensor, x: np.ndarray) -> np.ndarray:
        b = w.shape[1]
        return np.stack([self.linear(w.row_block(h * b, (h + 1) * b), np.ascontiguousarray(x[:, h]))
                         for h in range(w.shape[0])], axis=1)

    def expert_ffns(self, experts: Sequence[FFNWeights], xs: Sequence[np.ndarray],
                    activation: str = "swiglu") -> list[np.ndarray]:
        act = _ACTIVATIONS[activation]
        return [self.linear(e.down, act(self.linear(e.gate, x), self.linear(e.up, x))) for e, x in zip(experts, xs)]

    def dequantize(self, w: QTensor) -> np.ndarray:
        return quant.dequantize(w)

    def resident(self, ws: Iterable[QTensor | None]) -> int:
        """The reference multiplies the file's bytes: no copy."""
        return 0

    def expert_packer(self) -> None:
        """The reference multiplies the file's bytes: experts keep the file's layout."""
        return None

    def close(self) -> None:
        """Nothing to free: the thread pool is shared."""


def _ggml(n_threads: int, settings: Settings | None) -> Kernels:
    """The ggml backend; KernelsUnavailable with the reason if ggml-python is missing or unusable here.

    ggml is compiled code: a child process tries it first (:mod:`colibri_aio.probes`), so a build this CPU
    cannot run (SIGILL) costs the child, not the engine."""
    if importlib.util.find_spec("ggml") is None:
        raise KernelsUnavailable("ggml-python is not installed")
    found = probes.verdict("ggml")
    if not found.ok:
        raise KernelsUnavailable(found.line(), found)
    try:
        mod = importlib.import_module("colibri_aio.kernels.ggml_cpu")
    except Exception as e:  # ImportError, or the shared library failing to load
        raise KernelsUnavailable(f"ggml-python unavailable ({type(e).__name__}: {e})") from e
    try:
        kernels = mod.GgmlKernels(n_threads, settings=settings)
    except mod.GgmlUnavailable as e:
        raise KernelsUnavailable(str(e)) from e
    kernels.reason = f"{kernels.description}; {n_threads} threads"
    return kernels


def open_kernels(name: str = "auto", *, n_threads: int | None = None, settings: Settings | None = None) -> Kernels:
    """The backend ``name`` (one of :data:`NAMES`) for one engine, with its ``settings`` (None: read now).

    ``auto`` falls back to NumPy when ggml cannot run, keeping the reason;
    ``ggml`` asked for by name raises :class:`KernelsUnavailable` instead.
    """
    if name not in NAMES:
        raise ValueError(f"unknown kernels {name!r}: choose one of {', '.join(NAMES)}")
    threads = n_threads or (settings.kernel_threads if settings is not None else get_num_threads())
    if name == "numpy":
        return NumpyKernels()
    try:
        kernels = _ggml(threads, settings)
    except KernelsUnavailable as e:
        if name == "ggml":
            raise
        if e.verdict is not None:  # an installed ggml that cannot run here: worth a warning, once
            probes.warn_fallback(e.verdict, "computing with the NumPy kernels")
        return NumpyKernels(f"{e}: NumPy kernels instead")
    if name == "auto":
        kernels.reason += f"; faster than NumPy on every type and shape measured ({RECEIPT})"
    return kernels
