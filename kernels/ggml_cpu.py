"""Products on ggml's CPU kernels (through ggml-python), over memory we own: the fast backend.

ggml serves here as a library of kernels, not as a framework. A context made
with ``no_alloc`` holds tensor headers only; every header's ``data`` points
at our memory (trunk arrays, buffer-pool slots, activations), so no weight is
ever copied, and ggml never allocates anything we did not give it.

A call builds (once) or reuses a small graph: :meth:`GgmlKernels.linears`
puts several products that share one input in one graph (q/k/v; weights
that follow each other in memory as one product), :meth:`GgmlKernels.expert_ffns`
a whole batch of expert FFNs as llama.cpp runs a layer's experts: one
``ggml_mul_mat_id`` per matrix over the experts seen as one 3-D tensor (pool
slots one stride apart), one row per (expert, position) cell. Graphs are
cached by their *signature* (types, shapes, positions), not by the weights:
the q/k/v graph of layer 0 serves every layer, the graph of eight cells every
batch of eight. A call only re-points the leaves' ``data`` (weights, input,
output; a stack's stride) and runs
``ggml_graph_compute``; each ctypes call here costs 0.1-2 us, a graph launch
~5 us (evidence/ggml_overhead_*.md).

Numerics are llama.cpp's, not the NumPy reference's: ggml quantises the
activation to the weight type's partner (Q8_0 for Q8_0/Q4_0, Q8_K for the
K-quants, F16 for F16 weights, BF16 for BF16) before each product, and its
SiLU uses a fast exp. The relative error against float32 products of the same
weights is ~1e-3..1e-2 (tests/test_kernels_ggml.py states it per type).

Bit-identity (design invariant 1) holds within this backend: ggml computes
each output row whole, by one thread, with unaligned loads, and splits the
activation's quantisation on block boundaries, so neither the thread count
nor the byte address of the weights changes a bit; an expert's output does
not depend on which other experts share its graph or its stack (every
(expert, position) cell is its own vec_dot products). A product of one
position takes ggml's vec_dot path and one of several positions, when ggml
is built with it (GGML_LLAMAFILE), llamafile's tiled GEMM, as in llama.cpp:
for the :data:`GEMM_TYPES` its rows carry vec_dot's bits (a prefill row is
the row decoded alone), for float weights a prefill row may differ in its
last bits. The GEMM is what makes prefill fast: it loads a block of weights
once for several positions, where vec_dot (and so ``ggml_mul_mat_id``, which
llama.cpp runs for experts) loads it once per position; experts of several
rows therefore run as one ``ggml_mul_mat`` each (:meth:`GgmlKernels._expert_gemms`).

The one exception to "no copies": a net's resident matrices (attention, the
output head: :meth:`GgmlKernels.resident`, at load) of a type ggml repacks on
this CPU (Q4_0, Q4_K, IQ4_NL, MXFP4 on AVX2; 8 rows at a time) get a copy in
ggml's CPU_REPACK layout, as llama.cpp loads them, whose GEMV/GEMM reach the
memory's bandwidth where vec_dot is compute-bound on those types
(evidence/roofline_*). The leaf of such a matrix carries the copy's buffer
type and traits (:meth:`Graph.weight`) and every address lookup of the
original's bytes gives the copy's (:class:`_Addresses`), so every graph reads
the copy. Its products take vec_dot's integer dot products and sum them in
another order (~1e-7 of a product's norm); placement still changes no bit.
Routed experts of the types whose repack is a plain interleave (Q4_0, IQ4_NL,
MXFP4: :data:`PACKED_EXPERT_TYPES`) can be repacked too
(``COLIBRI_GGML_REPACK_EXPERTS``): as they land, by the expert source
(:class:`ExpertPacker`), or once, into a file the reader then reads
(``repack``): every one of them, wherever it lands, so the layout, and the
bits, never depend on the cache. Their QTensors say
so (``packed``), and their stacks carry the repacked traits.

ggml-python builds ggml from source at install with ``GGML_NATIVE`` on
(``-march=native``): the instruction set is chosen at build time, for the
machine that built it. :func:`probe` refuses a library built for features
this CPU lacks, instead of letting it die on an illegal instruction.
"""
from __future__ import annotations

import ctypes
import functools
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

import ggml.ggml as G  # ggml-python; this module is only imported when the ggml backend is asked for

from colibri_aio import cpu
from colibri_aio.settings import Settings
from colibri_aio.kernels.qtensor import FFNWeights, QTensor

__all__ = ["GEMM_TYPES", "Graph", "GgmlKernels", "GgmlUnavailable", "Mat", "Stack", "aligned_buffer", "has_gemm", "probe",
           "split_stacks", "supported_types", "version", "ExpertPacker", "PACKED_EXPERT_TYPES"]

# Features ggml reports as compiled in (ggml_cpu_has_*) and the /proc/cpuinfo flag each needs.
_ISA_FLAGS = {"sse3": "pni", "ssse3": "ssse3", "avx": "avx", "avx2": "avx2", "f16c": "f16c", "fma": "fma",
              "bmi2": "bmi2", "avx_vnni": "avx_vnni", "avx512": "avx512f", "avx512_vbmi": "avx512vbmi",
              "avx512_vnni": "avx512_vnni", "avx512_bf16": "avx512_bf16", "amx_int8": "amx_int8"}

_ALIGN = 64                      # byte alignment of the activation buffers we hand to ggml
_GRAPH_NODES = 4096              # capacity of one graph (a batch of 128 experts is 512 nodes)
_TEMPLATES = 256                 # graphs kept per backend (least recently used dropped)
_ADDRESSES = 1 << 15             # array addresses remembered (see _Addresses)
_STACK_WORK = 32 << 20          # bytes of ggml_mul_mat_id bookkeeping one stack of experts may need (split_stacks)
PARALLEL_BYTES = 1 << 18         # graphs with fewer weight bytes run on one thread (GgmlKernels)
# A/B switches (bench_decode.py arms such as ``ggml@COLIBRI_GGML_STEP=layers``); the defaults are the
# measured winners. (A persistent ggml threadpool gave no decode gain on the decode graphs, ~17 launches a
# token: 24.8 vs 25.4 tok/s without, evidence/decode_20261202T012629Z.md; so ggml starts and joins its
# threads per graph, and the threadpool arm is gone.)
# step: "graph" runs a decode step whose experts are all resident as one graph (arch/decode_graphs.py),
# "layers" as two graphs per block and one for the head.
# prefill: "graphs" runs a prompt's positions together on the decode graphs, block by block (spans,
# arch/decode_graphs.py); "ops" one kernel call per operation with NumPy's trunk ops between them.
# repack: resident matrices of a type ggml can repack on this CPU are copied once, at load, into ggml's
# CPU_REPACK layout (several rows interleaved, as llama.cpp loads them) and multiplied by its GEMV/GEMM
# there (:meth:`GgmlKernels.resident`); "off" multiplies the file's bytes with vec_dot (prefill x1.12 on,
# decode x1.03, evidence/decode_20261202T040605Z.md, roofline_20261202T040511Z.md).
# (Decode attention widens an f16 cache with ggml_get_rows, a whole row at a time, the bits of ggml_cast's
# element by element: 18.4 vs 16.5 tok/s after 2048 positions of context, evidence/decode_20261202T040458Z.md;
# the cast arm is gone.)
# (The switches themselves, their variables, values and defaults (the measured winners), are
# colibri_aio/settings.py's ``ggml_*``; a backend reads them from the Settings it is given.)
# Weight types llamafile's GEMM multiplies on x86 (tinyBLAS_Q0_AVX) and whose products there carry the bits of
# ggml's vec_dot, row for row (tests/test_kernels_ggml.py): an expert with several positions runs on it.
# (IQ4_NL runs there too, but with other bits than vec_dot's: left out.)
GEMM_TYPES = frozenset({GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q5_0})


class GgmlUnavailable(RuntimeError):
    """ggml-python cannot serve on this machine; the message says why."""

    keep_verdict = True  # it follows from the CPU and the build: a probe that meets it need not run again


def version() -> str:
    """ggml's own version string, and ggml-python's."""
    fn = G.lib.ggml_version
    fn.restype = ctypes.c_char_p
    import ggml
    return f"ggml {fn().decode()} (ggml-python {ggml.__version__})"


def built_features() -> list[str]:
    """The x86 features the library was compiled for (ggml_cpu_has_* are compile-time answers)."""
    return [f for f in _ISA_FLAGS if getattr(G, f"ggml_cpu_has_{f}", lambda: 0)()]


def probe(repack: bool = True) -> str:
    """Check that ggml can run here; returns a one-line description (``repack``: whether resident matrices are
    repacked), raises GgmlUnavailable."""
    flags = cpu.flags()  # CPUID's answer: an emulated CPU's, not the host's /proc/cpuinfo
    if flags:
        missing = [f for f in built_features() if _ISA_FLAGS[f] not in flags]
        if missing:
            raise GgmlUnavailable(f"ggml-python was built for {', '.join(missing)}, which this CPU lacks "
                                  f"(reinstall it on this machine: pip install --force-reinstall --no-binary "
                                  f":all: ggml-python)")
    gemm = "llamafile GEMM" if has_gemm() else ("no llamafile GEMM: prefill runs ggml's vec_dot products "
                                                "(build ggml-python with GGML_LLAMAFILE=ON, see README)")
    return f"{version()}, built for {'/'.join(built_features()) or 'generic x86'}, {gemm}, {repacking(repack)}"


def repacking(repack: bool = True) -> str:
    """Whether resident matrices are repacked (``COLIBRI_GGML_REPACK``), and which types can be here."""
    types = repack_types()
    if not types:
        return "no repacked weights (ggml has no CPU_REPACK layout for any type on this CPU)"
    names = "/".join(sorted(t.name for t in types))
    if not repack:
        return f"resident {names} weights not repacked (COLIBRI_GGML_REPACK=off)"
    return f"resident {names} weights repacked (CPU_REPACK)"


def has_gemm() -> bool:
    """Whether ggml was built with llamafile's tiled GEMM (GGML_LLAMAFILE): products of two or more positions
    by a weight of a :data:`GEMM_TYPES` type then run on it instead of one vec_dot per (row, position)."""
    return bool(G.ggml_cpu_has_llamafile())


# --- types ---

def _ggml_type(t: GGMLQuantizationType) -> int | None:
    """ggml's type id for a GGUF type when ggml's CPU backend can multiply by it, else None.

    GGUF stores ggml's own enum, so the ids agree; a type counts only if ggml
    knows it by the same name, agrees on its block geometry and has a CPU
    dot product (the integer and F64 types have none).
    """
    gid = getattr(G, f"GGML_TYPE_{t.name}", None)
    if gid is None or gid != int(t) or t not in GGML_QUANT_SIZES:
        return None
    block, type_size = GGML_QUANT_SIZES[t]
    if G.ggml_blck_size(gid) != block or G.ggml_type_size(gid) != type_size:
        return None
    if not G.ggml_get_type_traits_cpu(gid).contents.vec_dot:
        return None
    if t != GGMLQuantizationType.F32 and not G.ggml_get_type_traits(gid).contents.to_float:
        return None
    return gid


def supported_types() -> frozenset[GGMLQuantizationType]:
    """Every GGUF type ggml's CPU kernels multiply (ggml 0.15: F32, F16, BF16, all Q*, IQ*, TQ*, MXFP4...)."""
    return frozenset(t for t in GGMLQuantizationType if _ggml_type(t) is not None)


def _keep_non_finite(x: np.ndarray, ys: list[np.ndarray]) -> None:
    """Rows of ``x`` holding a NaN or an infinity give NaN rows in every ``ys`` (in place), as a float
    product would: rounding the activation to 8 bits can turn them into finite numbers, and the
    forward pass must see broken weights as non-finite values, never as plausible logits."""
    bad = ~np.isfinite(x).all(axis=1)
    if bad.any():
        for y in ys:
            y[bad] = np.nan


# --- repacked weights ---

@functools.cache
def _repack_buffer_type() -> int | None:
    """ggml's CPU_REPACK buffer type, among the CPU device's extra buffer types; None if the library has none."""
    reg = G.ggml_backend_cpu_reg()
    fn = G.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not fn:
        return None
    bufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fn)(G.ggml_backend_reg_dev_get(reg, 0))
    i = 0
    while bufts and bufts[i]:
        if G.ggml_backend_buft_name(bufts[i]) == b"CPU_REPACK":
            return bufts[i]
        i += 1
    return None


_MARK_KEEP: list[tuple[object, object]] = []    # the probes' contexts and buffers, alive for the process


def _repack_mark(gid: int, rows: int) -> tuple[int, int] | None:
    """What a leaf standing for a repacked (rows, .) matrix of type ``gid`` carries: (buffer, extra), or
    None when ggml has no repacked layout for it on this CPU.

    ggml runs a product on its repacked kernels when the weight's ``buffer`` belongs to the CPU_REPACK type
    and its ``extra`` names the layout's traits; both are the same for every matrix of one type whose row
    count has the same residue (the layouts interleave 4, 8 or 16 rows), so one small probe tensor, made
    in that buffer type, answers for all of them (ggml itself picks the layout, for this CPU)."""
    return _repack_probe(gid, rows % 16)


@functools.cache
def _repack_probe(gid: int, residue: int) -> tuple[int, int] | None:
    """:func:`_repack_mark` for the row counts of one residue modulo 16, from a probe tensor kept alive."""
    buft = _repack_buffer_type()
    if buft is None:
        return None
    ctx = G.ggml_init(G.ggml_init_params(mem_size=2 * G.ggml_tensor_overhead(), mem_buffer=None, no_alloc=True))
    t = G.ggml_new_tensor_2d(ctx, gid, G.ggml_blck_size(gid), 16 + residue)
    buf = G.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft)
    if buf and t.contents.extra:
        _MARK_KEEP.append((ctx, buf))
        return t.contents.buffer, t.contents.extra
    if buf:
        G.ggml_backend_buffer_free(buf)
    G.ggml_free(ctx)
    return None


def _mark_repacked(t: "ctypes._Pointer[ctypes.Structure]", gid: int, rows: int) -> None:
    """Give the header ``t`` (``rows`` rows of type ``gid``) what makes ggml read its bytes as repacked
    (:func:`_repack_mark`); ValueError when ggml has no repacked layout for it here."""
    mark = _repack_mark(gid, rows)
    if mark is None:
        raise ValueError(f"ggml type {gid} has no repacked layout for {rows} rows")
    t.contents.buffer, t.contents.extra = mark


def repack_types() -> frozenset[GGMLQuantizationType]:
    """The types whose matrices (of a row count that is a multiple of 16) ggml repacks on this CPU."""
    return frozenset(t for t in supported_types() if _repack_mark(int(t), 16) is not None)


# Expert types whose repacked layout is a plain interleave of the file's blocks: ggml repacks them at
# ~24-27 GB/s on one core from memory in cache (Q4_0, MXFP4, 0.9-4.4 MB matrices); Q4_K and Q2_K repack their
# scales too, at ~1.45 GB/s (Q4_K) (both one-off measurements on one matrix shape each, not receipts), so
# only ``COLIBRI_GGML_REPACK_EXPERTS=all`` repacks them. Repacking as experts land is off by default (``auto``
# reads them repacked only from a ``repack`` file, which costs nothing at a cold start:
# evidence/first_token_20261207T170216Z.md; README "Repacked experts"): with every expert resident it pays
# (gpt-oss MXFP4 decode x1.08, prefill x1.81, evidence/decode_20261207T155411Z.md), but each expert that
# lands pays for it, from memory that is not in cache and into fresh pages, so a cold start's first 64 tokens
# ran at 0.42 of the file layout's rate (evidence/first_token_20261207T155853Z.md) and a decode streamed
# through 32 slots a layer at 0.86 (evidence/decode_20261207T160214Z.md).
PACKED_EXPERT_TYPES = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.IQ4_NL,
                                 GGMLQuantizationType.MXFP4})


class ExpertPacker:
    """Routed experts' matrices put into ggml's CPU_REPACK layout as they land, as llama.cpp loads them.

    ggml multiplies a repacked matrix with GEMV kernels that read 8 interleaved rows at once
    (``ggml_gemv_mxfp4_8x8_q8_0``...), where the file's layout takes one vec_dot per row. Its products sum in
    another order than vec_dot's, so repacking is all or nothing for an expert type: every expert of a type
    this packer :meth:`packs` is repacked wherever it lands (a pool slot, in place; a copy beside the page
    cache), so logits do not depend on the cache size, the I/O backend or which experts were resident. The
    repacked bytes have the file's size. The decision depends only on the type, the row count and this
    CPU's repacked layouts (and ``COLIBRI_GGML_REPACK_EXPERTS``), never on timing.
    """

    def __init__(self, types: Iterable[GGMLQuantizationType] = PACKED_EXPERT_TYPES) -> None:
        self.types = frozenset(t for t in types if _ggml_type(t) is not None)
        self._scratch = np.empty(0, np.uint8)
        self._headers: dict[tuple[int, int, int], ctypes.Structure] = {}
        self._ctx: object = None
        self._room = 0                                     # headers the current context still holds
        self._lock = threading.Lock()

    def packs(self, ggml_type: GGMLQuantizationType, rows: int) -> bool:
        """Whether an expert matrix of this type and row count is repacked (ggml has a layout for it here)."""
        return ggml_type in self.types and _repack_mark(int(ggml_type), rows) is not None

    def pack(self, w: QTensor, out: np.ndarray | None = None) -> QTensor:
        """``w`` in the repacked layout, written to ``out`` (the same number of bytes; None: over ``w``'s own
        bytes, through a scratch copy, as a pool slot is repacked in place); ``w`` itself when it is already
        packed or of a type or row count that is not repacked."""
        if w.packed or len(w.shape) != 2 or not self.packs(w.ggml_type, w.rows):
            return w
        with self._lock:      # one header per shape and one scratch buffer: callers on other threads wait
            return self._pack(w, out)

    def _pack(self, w: QTensor, out: np.ndarray | None) -> QTensor:
        if out is None:
            if self._scratch.size < w.nbytes:
                self._scratch = np.empty(w.nbytes, np.uint8)
            src = self._scratch[:w.nbytes]
            np.copyto(src, w.data)
            out = w.data
        else:
            if out.size != w.nbytes or out.dtype != np.uint8 or not out.flags.c_contiguous:
                raise ValueError(f"pack: {out.size} bytes for a matrix of {w.nbytes}")
            src = w.data if w.data.flags.c_contiguous else np.ascontiguousarray(w.data)
        header = self._header(int(w.ggml_type), w.rows, w.cols)
        header.contents.data = out.ctypes.data
        _drop_debug_logs()
        G.ggml_backend_tensor_set(header, src.ctypes.data, 0, w.nbytes)         # the repack buffer's set: repacks
        return QTensor(out, w.ggml_type, w.shape, packed=True)

    def _header(self, gid: int, rows: int, cols: int) -> ctypes.Structure:
        """A tensor header of this type and shape carrying the repacked layout's buffer and traits, its data
        pointed at each destination in turn (one header per shape, in a context of our own)."""
        key = (gid, rows, cols)
        t = self._headers.get(key)
        if t is None:
            if self._room == 0:
                self._ctx = G.ggml_init(G.ggml_init_params(mem_size=64 * G.ggml_tensor_overhead(), mem_buffer=None,
                                                           no_alloc=True))
                _MARK_KEEP.append((self._ctx, None))      # alive for the process, as the probes' contexts
                self._room = 64
            self._room -= 1
            t = G.ggml_new_tensor_2d(self._ctx, gid, cols, rows)
            _mark_repacked(t, gid, rows)
            self._headers[key] = t
        return t


def expert_packer_for(mode: str | None) -> ExpertPacker | None:
    """The packer of ``COLIBRI_GGML_REPACK_EXPERTS=mode`` on this CPU (on: :data:`PACKED_EXPERT_TYPES`; all: every
    type ggml repacks here); None when it is off or nothing would be repacked."""
    if mode not in ("on", "all"):      # off; auto repacks nothing as it lands (engine/repacked_file.py)
        return None
    types = repack_types() if mode == "all" else repack_types() & PACKED_EXPERT_TYPES
    return ExpertPacker(types) if types else None


_LOG_FILTER: list[tuple[object, object, object]] = []   # the installed filter and the logger it passes to
_LOG_LOCK = threading.Lock()


def _drop_debug_logs() -> None:
    """From now on ggml's debug messages are dropped (repacking logs a line per matrix) and the others are
    passed on to the logger set before. Installed once for the process and never swapped back: a filter
    swapped in and out by two threads at once (two engines' kernels loading, a packer beside them) could
    leave ggml calling one that is already freed."""
    with _LOG_LOCK:
        if _LOG_FILTER:
            return
        prev, user = G.ggml_log_callback(), ctypes.c_void_p()
        G.ggml_log_get(ctypes.byref(prev), ctypes.byref(user))

        def keep(level: int, text: bytes, _: object) -> None:
            if level not in (G.GGML_LOG_LEVEL_DEBUG, G.GGML_LOG_LEVEL_CONT) and prev:
                prev(level, text, user)

        quiet = G.ggml_log_callback(keep)
        _LOG_FILTER.append((quiet, prev, user))
        G.ggml_log_set(quiet, None)


@dataclass(slots=True)
class _Packed:
    """Matrices copied into ggml's repacked layout: one ggml context and buffer for a call of
    :meth:`GgmlKernels.resident`, and the original arrays (kept so their addresses cannot be reused
    while the copies stand for them)."""

    ctx: object
    buffer: object
    originals: list[np.ndarray]
    nbytes: int


# --- memory ---

class _Addresses:
    """Addresses of arrays we have seen, by identity: ``ndarray.ctypes.data`` costs ~1-2 us a call.

    Weights are the same objects call after call (trunk tensors, a cached
    expert's views), so their address is looked up, not recomputed. An entry
    holds the array itself, so its id cannot be reused while remembered; the
    table is emptied when it is full.

    ``moved``: the bytes of a matrix that has a repacked copy, by (address,
    size), give the copy's address: every leaf pointed at that matrix reads
    the copy (:meth:`GgmlKernels.resident`).
    """

    def __init__(self, moved: dict[tuple[int, int], int], capacity: int = _ADDRESSES) -> None:
        self._known: dict[int, tuple[np.ndarray, int]] = {}
        self._moved = moved
        self._capacity = capacity

    def __call__(self, a: np.ndarray) -> int:
        hit = self._known.get(id(a))
        if hit is not None:
            return hit[1]
        if len(self._known) >= self._capacity:
            self._known.clear()
        addr = a.ctypes.data
        if self._moved:
            addr = self._moved.get((addr, a.nbytes), addr)
        self._known[id(a)] = (a, addr)
        return addr

    def forget(self) -> None:
        """Empty the table (matrices have just been repacked: their addresses change)."""
        self._known.clear()


def aligned_buffer(nbytes: int) -> tuple[np.ndarray, int]:
    """A zeroed byte buffer of at least ``nbytes`` starting on an _ALIGN boundary, and its address."""
    raw = np.zeros(max(nbytes, 1) + _ALIGN, np.uint8)
    start = (-raw.ctypes.data) % _ALIGN
    buf = raw[start:start + max(nbytes, 1)]
    return buf, buf.ctypes.data


def _float_buffer(n: int) -> tuple[np.ndarray, int]:
    buf, addr = aligned_buffer(4 * n)
    return buf.view(np.float32), addr


# --- graphs ---

class Graph:
    """One ggml graph, built once: a context of tensor headers, a plan, its intermediates' memory.

    ``inputs`` are the leaves re-pointed at every call, in the order the
    caller gives addresses; ``outputs`` the result nodes, re-pointed at
    memory the caller gives. Every other node gets a fixed place in
    ``_arena`` when the graph is built.
    """

    def __init__(self, n_tensors: int, n_nodes: int = _GRAPH_NODES) -> None:
        n_tensors += 8
        size = n_tensors * G.ggml_tensor_overhead() + G.ggml_graph_overhead_custom(n_nodes, False)
        self.ctx = G.ggml_init(G.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=True))
        if not self.ctx:
            raise MemoryError("ggml_init failed")
        self.gf = G.ggml_new_graph_custom(self.ctx, n_nodes, False)
        self.inputs: list[ctypes.Structure] = []
        self.outputs: list[ctypes.Structure] = []
        self.stacks: list[ctypes.Structure] = []
        self.plan: G.ggml_cplan | None = None
        self.views: list[tuple[ctypes.Structure, ctypes.Structure]] = []
        self.work_size = 0
        self.arena_size = 0
        self._arena: np.ndarray | None = None
        self._places: list[tuple[ctypes.Structure, int]] = []
        self._fixed_views: list[tuple[ctypes.Structure, ctypes.Structure]] = []   # views of intermediates

    def leaf(self, gid: int, cols: int, rows: int, depth: int = 1) -> ctypes.Structure:
        """A (depth, rows, cols) tensor whose data is given at every call."""
        t = G.ggml_new_tensor_3d(self.ctx, gid, cols, rows, depth)
        self.inputs.append(t.contents)
        return t

    def weight(self, m: "Mat") -> ctypes.Structure:
        """A leaf for the matrix ``m``; when ``m`` is repacked it carries what makes ggml multiply by it on
        the repacked kernels (:func:`_repack_mark`), and must be pointed at the repacked copy."""
        t = self.leaf(m.gid, m.cols, m.rows)
        if m.packed:
            _mark_repacked(t, m.gid, m.rows)
        return t

    def stack(self, gid: int, cols: int, rows: int, depth: int, packed: bool = False) -> ctypes.Structure:
        """``depth`` (rows, cols) matrices ``stride`` bytes apart: the stride as well as the data is
        given at every call (:meth:`set_stride`). ``packed``: the matrices are in the repacked layout
        (:class:`ExpertPacker`), and ``ggml_mul_mat_id`` by the stack runs on its GEMV."""
        t = self.leaf(gid, cols, rows, depth)
        if packed:
            _mark_repacked(t, gid, rows)
        self.stacks.append(t.contents)
        return t

    def set_stride(self, stack: ctypes.Structure, stride: int) -> None:
        stack.nb[2] = stride
        stack.nb[3] = stride * stack.ne[2]

    def finish(self, outputs: Sequence, n_threads: int, effects: Sequence = (),
               own_arena: bool = True) -> None:
        """Expand the graph from ``effects`` (nodes run first for what they write into leaves' memory, such
        as a KV cache row) then ``outputs``, give every intermediate a place, and plan it.

        ``own_arena`` False: the intermediates get their places in memory the caller gives at every
        call (:meth:`place`, ``arena_size`` bytes), so that graphs run one after another share it.
        A view's data follows its source: set once here when the source is an intermediate, and at
        every call (:meth:`refresh_views`) when it goes back to a leaf or an output, which are re-pointed.
        """
        for t in effects:
            G.ggml_build_forward_expand(self.gf, t)
        for t in outputs:
            G.ggml_build_forward_expand(self.gf, t)
            self.outputs.append(t.contents)
        out_ids = {ctypes.addressof(o) for o in self.outputs}
        moving = {ctypes.addressof(t) for t in self.inputs} | out_ids
        views: list[ctypes.Structure] = []
        self._places, offset = [], 0
        for i in range(G.ggml_graph_n_nodes(self.gf)):
            node = G.ggml_graph_node(self.gf, i).contents
            if node.view_src:
                views.append(node)
                continue
            if ctypes.addressof(node) in out_ids or node.data:
                continue
            self._places.append((node, offset))
            offset += -(-G.ggml_nbytes(ctypes.pointer(node)) // _ALIGN) * _ALIGN
        self.arena_size = offset
        self.views, self._fixed_views = [], []
        for node in views:                     # in graph order
            src = node.view_src.contents
            if ctypes.addressof(src) in moving:
                moving.add(ctypes.addressof(node))
                self.views.append((node, src))
            else:
                self._fixed_views.append((node, src))
        if own_arena:
            self._arena, base = aligned_buffer(offset)
            self.place(base)
        self.refresh_views()
        self.plan = G.ggml_graph_plan(self.gf, n_threads, None)  # no threadpool: threads per graph
        self._plan_ref = ctypes.byref(self.plan)
        self.work_size = self.plan.work_size

    def place(self, base: int) -> None:
        """Put the intermediates at ``base`` (``arena_size`` bytes, _ALIGN-aligned), and their views."""
        for node, off in self._places:
            node.data = base + off
        for node, src in self._fixed_views:
            node.data = (src.data or 0) + node.view_offs

    def refresh_views(self) -> None:
        """Point the views of re-pointed tensors at their sources' memory of this call."""
        for node, src in self.views:
            node.data = (src.data or 0) + node.view_offs

    def run(self, work: "ctypes._Pointer[ctypes.c_uint8]") -> None:
        self.plan.work_data = work
        status = G.ggml_graph_compute(self.gf, self._plan_ref)
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute failed: {G.ggml_status_to_string(status).decode()}")

    def free(self) -> None:
        if self.ctx:
            G.ggml_free(self.ctx)
            self.ctx = None


@dataclass(frozen=True, slots=True)
class Mat:
    """The signature of one weight in a graph: ggml type, rows, cols, and whether its leaf reads a repacked
    copy (:meth:`GgmlKernels.resident`)."""

    gid: int
    rows: int
    cols: int
    packed: bool = False

    @property
    def nbytes(self) -> int:
        return G.ggml_row_size(self.gid, self.cols) * self.rows


@dataclass(frozen=True, slots=True)
class Stack:
    """Experts of one batch seen as one 3-D tensor per matrix: matrix ``index[i]`` of the stack whose
    first gate, up and down matrices start at ``base`` and follow each other ``stride`` bytes apart is
    member ``i`` (a position in the batch); ``depth`` matrices (a power of two, so that graphs repeat)."""

    members: tuple[int, ...]
    base: tuple[int, int, int]
    stride: int
    index: tuple[int, ...]
    depth: int


def split_stacks(addrs: Sequence[tuple[int, int, int]], rows: Sequence[int]) -> list[Stack]:
    """Split a batch of experts (their gate, up, down addresses; rows routed to each) into stacks.

    Experts join one stack while their up and down matrices sit at the same
    offsets from their gate and the stack's index span keeps ggml_mul_mat_id's
    bookkeeping (depth x (cells + 1) x 8 bytes) under _STACK_WORK; the stride
    is the gcd of the gate addresses' distances (slots of one buffer pool, or
    experts of one stacked GGUF tensor, are one stride apart).
    """
    stacks: list[Stack] = []
    group: list[int] = []

    def close() -> None:
        first = addrs[group[0]][0]
        stride = 0
        for m in group:
            stride = math.gcd(stride, addrs[m][0] - first)
        stride = stride or 1
        index = tuple((addrs[m][0] - first) // stride for m in group)
        stacks.append(Stack(tuple(group), addrs[group[0]], stride, index, 1 << max(index).bit_length()))

    offsets, gcd, cells = None, 0, 0
    for m in sorted(range(len(addrs)), key=lambda i: addrs[i][0]):
        g, u, d = addrs[m]
        if group:
            first = addrs[group[0]][0]
            new_gcd = math.gcd(gcd, g - first)
            depth = 1 << ((g - first) // new_gcd).bit_length()
            if (u - g, d - g) == offsets and depth * (cells + rows[m] + 1) * 8 <= _STACK_WORK:
                group.append(m)
                gcd, cells = new_gcd, cells + rows[m]
                continue
            close()
        group, offsets, gcd, cells = [m], (u - g, d - g), 0, rows[m]
    if group:
        close()
    return stacks


_ACTIVATIONS: dict[str, Callable] = {"swiglu": lambda ctx, g, u: G.ggml_swiglu_split(ctx, g, u)}


class GgmlKernels:
    """The ggml backend of one engine: its graphs, work buffer and threads.

    A graph whose weights are smaller than ``parallel_bytes`` runs on one
    thread: waking the others costs more than they save (and on a loaded
    machine a thread that is descheduled stalls the rest at every node).
    Thread count never changes a bit, so this is a speed choice only.

    One call at a time (a lock makes concurrent calls wait); two engines
    each have their own.
    """

    name = "ggml"

    def __init__(self, n_threads: int = 2, *, settings: Settings | None = None, parallel_bytes: int = PARALLEL_BYTES,
                 repack: bool | None = None) -> None:
        """``settings``: the engine's (None: read now); ``repack``: whether :meth:`resident` repacks (None:
        ``COLIBRI_GGML_REPACK``)."""
        self.settings = settings if settings is not None else Settings.read()
        self.repack = self.settings.on("ggml_repack") if repack is None else repack
        self.description = probe(self.repack)
        self.reason = self.description
        self.n_threads = n_threads
        self.parallel_bytes = parallel_bytes
        self._types: dict[GGMLQuantizationType, int] = {t: gid for t in GGMLQuantizationType
                                                         if (gid := _ggml_type(t)) is not None}
        self._type_of = {gid: t for t, gid in self._types.items()}
        # Experts of several rows on llamafile's GEMM (_expert_gemms); COLIBRI_GGML_EXPERT_GEMM=0 keeps every
        # expert on ggml_mul_mat_id (the A/B of evidence/prefill_ab_*).
        self.expert_gemm = has_gemm() and self.settings.get("ggml_expert_gemm") != "0"
        self._graphs: OrderedDict[tuple, Graph] = OrderedDict()
        self._moved: dict[tuple[int, int], int] = {}     # a repacked matrix's (address, size) -> its copy's
        self._packed_at: set[int] = set()                  # the copies' addresses
        self._packs: list[_Packed] = []
        # address(array): where a graph finds an array's bytes (a repacked copy's, for a repacked matrix)
        self.address = _Addresses(self._moved)
        self._work, self._work_ptr = self._work_buffer(1 << 20)
        self._scratch, _ = aligned_buffer(0)           # the intermediates of _expert_gemms' graphs
        self._lock = threading.Lock()
        self._rows_alike: dict[tuple[int, bool], bool] = {}   # rows_alike's measurements
        self._cells_alike: dict[tuple[int, bool], bool] = {}  # cells_alike's
        self._probes: list[QTensor] = []                        # the repacked matrices they measured
        # Routed experts of the PACKED_EXPERT_TYPES repacked as they land (COLIBRI_GGML_REPACK_EXPERTS); the
        # expert source does it with this packer (expert_packer).
        self.packer = expert_packer_for(self.settings.get("ggml_repack_experts"))
        if self.packer is not None:
            names = "/".join(sorted(t.name for t in self.packer.types))
            self.description += f", routed {names} experts repacked as they land"
            self.reason = self.description

    # --- the interface the forward pass calls ---

    @property
    def types(self) -> frozenset[GGMLQuantizationType]:
        return frozenset(self._types)

    def resident(self, ws: Iterable[QTensor | None]) -> int:
        """Matrices that stay in memory while this backend serves them (a net's trunk): each one of a type
        and row count ggml has a repacked layout for on this CPU (Q4_0, Q4_K, IQ4_NL, MXFP4 on AVX2; a
        multiple of 8 rows) gets a copy in that layout, made here once (``ggml_backend_tensor_set`` into a
        CPU_REPACK buffer repacks), and every product by it from now on, in every graph, reads the copy.
        The originals stay as they are (other readers, such as the embedding lookup, read them): the copies
        cost their bytes again, returned here (:attr:`packed_nbytes` in all). Matrices seen before, and
        every matrix when ``COLIBRI_GGML_REPACK=off``, are left alone."""
        buft = _repack_buffer_type()
        if not self.repack or buft is None:
            return 0
        todo: dict[tuple[int, int], tuple[QTensor, int]] = {}
        for w in ws:
            if w is None or len(w.shape) != 2 or w.ggml_type not in self._types:
                continue
            gid = self._types[w.ggml_type]
            key = (w.data.ctypes.data, w.nbytes)
            if _repack_mark(gid, w.rows) is not None and key not in self._moved:
                todo[key] = (w, gid)
        if not todo:
            return 0
        ctx = G.ggml_init(G.ggml_init_params(mem_size=(len(todo) + 1) * G.ggml_tensor_overhead(), mem_buffer=None,
                                             no_alloc=True))
        tensors = [G.ggml_new_tensor_2d(ctx, gid, w.cols, w.rows) for w, gid in todo.values()]
        buf = G.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft)
        if not buf:
            G.ggml_free(ctx)
            raise MemoryError(f"no memory for {len(todo)} repacked matrices")
        originals, nbytes = [], 0
        _drop_debug_logs()
        with self._lock:
            for (key, (w, _)), t in zip(todo.items(), tensors):
                data = w.data if w.data.flags.c_contiguous else np.ascontiguousarray(w.data)
                G.ggml_backend_tensor_set(t, data.ctypes.data, 0, w.nbytes)     # repacks into the copy
                self._moved[key] = t.contents.data
                self._packed_at.add(t.contents.data)
                originals.append(w.data)
                nbytes += w.nbytes
            self._packs.append(_Packed(ctx, buf, originals, nbytes))
            self.address.forget()
        return nbytes

    def expert_packer(self) -> ExpertPacker | None:
        """What repacks routed experts as they land, for the expert source; None when they keep the file's
        layout (``COLIBRI_GGML_REPACK_EXPERTS=off``, or no repacked layout on this CPU)."""
        return self.packer

    def expert_mat(self, r: object, packed: bool) -> Mat:
        """The signature of a routed expert's matrix ``r`` (an ExpertLocation's range: ggml_type, shape) as the
        expert source delivers it (``packed``: in the repacked layout, the source's word)."""
        rows, cols = r.shape                                       # type: ignore[attr-defined]
        return Mat(self._gid(r), rows, cols, packed)               # type: ignore[arg-type]

    @property
    def packed_nbytes(self) -> int:
        """Bytes of every repacked copy this backend holds (:meth:`resident`)."""
        return sum(p.nbytes for p in self._packs)

    def linear(self, w: QTensor, x: np.ndarray) -> np.ndarray:
        """``x @ W.T``: x (T, cols) float32 -> (T, rows) float32."""
        return self._linears((w,), x)[0]

    def linears(self, ws: Sequence[QTensor], x: np.ndarray) -> list[np.ndarray]:
        """Several products on one input in one graph: [x @ W.T for W in ws]."""
        return self._linears(ws, x)

    def _linears(self, ws: Sequence[QTensor], x: np.ndarray) -> list[np.ndarray]:
        """Weights that follow each other in memory with one type (a block's q, k and v as a GGUF stores
        them) run as one product over their rows together: one graph node, one pass of the threads."""
        x = self._input(x, ws[0].cols)
        t = x.shape[0]
        mats = [self.mat(w) for w in ws]
        for m in mats:
            if m.cols != mats[0].cols:
                raise ValueError(f"linears: weights of {m.cols} and {mats[0].cols} columns share one input")
        addr = self.address
        addrs = [addr(w.data) for w in ws]
        runs: list[list[int]] = []                      # indices of ws whose bytes follow each other
        for i, (w, m) in enumerate(zip(ws, mats)):
            # Repacked copies follow each other as the originals do (one buffer, in order): rows interleave
            # within groups of 8 of one matrix, so two copies one after the other are the copy of both.
            if runs and (m.gid, m.packed) == (mats[i - 1].gid, mats[i - 1].packed) \
                    and addrs[i - 1] + ws[i - 1].nbytes == addrs[i]:
                runs[-1].append(i)
            else:
                runs.append([i])
        fused = tuple(Mat(mats[r[0]].gid, sum(mats[i].rows for i in r), mats[r[0]].cols, mats[r[0]].packed)
                      for r in runs)
        sizes = [t * m.rows for m in fused]
        out = self._call(("linears", fused, t), 2 * len(fused) + 1, lambda g: self._build_linears(g, fused, t),
                         [addrs[r[0]] for r in runs] + [x.ctypes.data], sizes, sum(m.nbytes for m in fused))
        ys: list[np.ndarray] = []
        start = 0
        for r, m in zip(runs, fused):
            y = out[start: start + t * m.rows].reshape(t, m.rows)
            start += t * m.rows
            col = 0
            for i in r:
                ys.append(y[:, col: col + mats[i].rows])
                col += mats[i].rows
        _keep_non_finite(x, ys)
        return ys

    def head_linears(self, w: QTensor, x: np.ndarray) -> np.ndarray:
        """Per-head products in one graph: ``w`` (H, b, a) as one 3-D weight, x (T, H, a) -> (T, H, b). Each
        head's rows take the dot products :meth:`linear` takes on ``w[h]`` (the same bits), in one pass."""
        heads, rows, cols = w.shape
        if x.ndim != 3 or x.shape[1:] != (heads, cols):
            raise ValueError(f"head_linears: input of shape {x.shape} for per-head weights {w.shape}")
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=np.float32)
        t, gid = x.shape[0], self._gid(w)
        mat = Mat(gid, heads * rows, cols, False)
        out = self._call(("head_linears", mat, heads, t), 8, lambda g: self._build_head_linears(g, mat, heads, t),
                         [self.address(w.data), x.ctypes.data], [t * heads * rows], mat.nbytes)
        y = out.reshape(t, heads, rows)
        _keep_non_finite(x, [y])
        return y

    @staticmethod
    def _build_head_linears(g: Graph, m: Mat, heads: int, t: int) -> list:
        ctx, rows = g.ctx, m.rows // heads
        w = G.ggml_reshape_3d(ctx, g.weight(m), m.cols, rows, heads)                 # (a, b, H)
        x = g.leaf(G.GGML_TYPE_F32, m.cols, heads, t)                                # (a, H, T): x (T, H, a)
        y = G.ggml_mul_mat(ctx, w, G.ggml_cont(ctx, G.ggml_permute(ctx, x, 0, 2, 1, 3)))   # (b, T, H)
        return [G.ggml_cont(ctx, G.ggml_permute(ctx, y, 0, 2, 1, 3))]               # (b, H, T): (T, H, b)

    def expert_ffns(self, experts: Sequence[FFNWeights], xs: Sequence[np.ndarray],
                    activation: str = "swiglu") -> list[np.ndarray]:
        """``down(act(gate x, up x))`` for each expert on its own rows.

        ``xs[i]``: (n_i, D) float32, the positions routed to ``experts[i]``;
        returns (n_i, D) each. Experts of one row (decode) run in one graph:
        experts whose matrices lie at one stride from each other (buffer-pool
        slots, a GGUF's stacked tensors) as one ``ggml_mul_mat_id`` per
        matrix, as llama.cpp runs a layer's experts (:func:`split_stacks`); the
        others one stack each. Every (expert, row) is one dot product either
        way, so how experts are stacked never changes a bit. Experts of
        several rows (prefill) of a :data:`GEMM_TYPES` type run on llamafile's
        GEMM when ggml has it (:meth:`_expert_gemms`), whose products carry
        the same bits as the vec_dot ones.
        """
        if activation not in _ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}")
        gate = down = None
        addr, addrs, inputs = self.address, [], []
        for e, x in zip(experts, xs, strict=True):
            g, d = self.mat(e.gate), self.mat(e.down)
            if self.mat(e.up) != g or d.cols != g.rows or d.rows != g.cols:
                raise ValueError(f"expert FFN shapes gate {e.gate.shape}, up {e.up.shape}, down {e.down.shape} "
                                 "do not chain")
            if gate is None:
                gate, down = g, d
            elif (g, d) != (gate, down):
                raise ValueError("experts of one batch have different types or shapes")
            inputs.append(self._input(x, g.cols))
            addrs.append((addr(e.gate.data), addr(e.up.data), addr(e.down.data)))
        if gate is None:
            return []
        # Repacked experts stay on ggml_mul_mat_id (its repacked GEMV, row by row, whatever the rows: the bits
        # of a row do not depend on how many rows share the product).
        gemm = self.on_gemm(gate, down)
        on_gemm = [gemm and x.shape[0] >= 2 for x in inputs]
        ys: list[np.ndarray] = [inputs[0]] * len(experts)
        for path, run in ((True, self._expert_gemms), (False, self._expert_stacks)):
            members = [m for m, p in enumerate(on_gemm) if p == path]
            if members:
                outs = run([addrs[m] for m in members], [inputs[m] for m in members], gate, down, activation)
                for m, y in zip(members, outs):
                    ys[m] = y
        return ys

    def on_gemm(self, gate: Mat, down: Mat) -> bool:
        """Whether experts of these matrices run their rows on llamafile's GEMM when they have several
        (:meth:`expert_ffns`): a :data:`GEMM_TYPES` type in the file's layout, ggml built with it, and
        ``COLIBRI_GGML_EXPERT_GEMM`` on."""
        return self.expert_gemm and not (gate.packed or down.packed) and self._type_of.get(gate.gid) in GEMM_TYPES

    def _expert_stacks(self, addrs: list[tuple[int, int, int]], inputs: list[np.ndarray], gate: Mat, down: Mat,
                       activation: str) -> list[np.ndarray]:
        """Experts as ``ggml_mul_mat_id`` stacks (:func:`split_stacks`), one graph; every (expert, row) cell is its
        own vec_dot products."""
        counts = [x.shape[0] for x in inputs]
        stacks = split_stacks(addrs, counts)
        order = [m for st in stacks for m in st.members]
        x = np.concatenate([inputs[m] for m in order]) if len(order) > 1 else inputs[0]
        index = np.concatenate([np.repeat(np.asarray(st.index, np.int32), [counts[m] for m in st.members])
                                for st in stacks])
        sizes = [sum(counts[m] for m in st.members) for st in stacks]
        key = ("moe", activation, gate, down, tuple((n, st.depth) for n, st in zip(sizes, stacks)))
        calls, x_addr, i_addr = [], x.ctypes.data, index.ctypes.data
        for st, n in zip(stacks, sizes):
            calls.append((st, x_addr, i_addr))
            x_addr += 4 * n * gate.cols
            i_addr += 4 * n
        out = self._call(key, 9 * len(stacks), lambda gr: self._build_moe(gr, gate, down, sizes, stacks, activation),
                         [a for st, xa, ia in calls for a in (*st.base, xa, ia)], [n * down.rows for n in sizes],
                         len(addrs) * (2 * gate.nbytes + down.nbytes),
                         strides=[st.stride for st in stacks for _ in range(3)])
        ys: list[np.ndarray] = [out] * len(addrs)
        start = 0
        for m in order:
            ys[m] = out[start: start + counts[m] * down.rows].reshape(counts[m], down.rows)
            start += counts[m] * down.rows
        _keep_non_finite(x, [out.reshape(-1, down.rows)])  # the output's rows are x's, one for one
        return ys

    def _expert_gemms(self, addrs: list[tuple[int, int, int]], inputs: list[np.ndarray], gate: Mat, down: Mat,
                      activation: str) -> list[np.ndarray]:
        """Experts of two or more rows each, one graph launch per expert: ``ggml_mul_mat`` of its matrices by
        all its rows runs on llamafile's tiled GEMM, which reuses each weight block it loads across the rows
        (``ggml_mul_mat_id`` takes one vec_dot per (row, cell) and reloads the weights for every cell).
        A graph serves every expert with the same number of rows; all of them keep their intermediates
        (gate, up, activation: rows x 3 x F floats) in one scratch buffer, not one each."""
        n_all = sum(x.shape[0] for x in inputs)
        out = np.empty(n_all * down.rows, np.float32)
        out_addr, start, ys = out.ctypes.data, 0, []
        weight_bytes = 2 * gate.nbytes + down.nbytes
        with self._lock:
            for (g, u, d), x in zip(addrs, inputs):
                n = x.shape[0]
                key = ("gemm", activation, gate, down, n)
                graph = self.graph(key, 4, lambda gr: self._build_gemm(gr, gate, down, n, activation),
                                   weight_bytes, own_arena=False)
                if graph.arena_size > self._scratch.size:
                    self._scratch, _ = aligned_buffer(graph.arena_size)
                graph.place(self._scratch.ctypes.data)
                for leaf, a in zip(graph.inputs, (g, u, x.ctypes.data, d)):
                    leaf.data = a
                graph.outputs[0].data = out_addr
                graph.run(self._work_ptr)
                ys.append(out[start: start + n * down.rows].reshape(n, down.rows))
                out_addr += 4 * n * down.rows
                start += n * down.rows
        for x, y in zip(inputs, ys):
            _keep_non_finite(x, [y])
        return ys

    def dequantize(self, w: QTensor) -> np.ndarray:
        """All weights of ``w`` as a new float32 array of shape ``w.shape`` (ggml's to_float, one thread)."""
        gid = self._gid(w)
        if w.ggml_type == GGMLQuantizationType.F32:
            return w.data.view(np.float32).reshape(w.shape).copy()
        out = np.empty(w.shape, np.float32)
        data = np.ascontiguousarray(w.data)
        G.ggml_get_type_traits(gid).contents.to_float(
            ctypes.c_void_p(data.ctypes.data), out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.size)
        return out

    def close(self) -> None:
        """Free every graph's ggml context."""
        with self._lock:
            for g in self._graphs.values():
                g.free()
            self._graphs.clear()
            for p in self._packs:
                G.ggml_backend_buffer_free(p.buffer)
                G.ggml_free(p.ctx)
            self._packs.clear()
            self._moved.clear()
            self._packed_at.clear()
            self.address.forget()

    def rows_alike(self, m: Mat) -> bool:
        """Whether a product by a matrix of ``m``'s type (and packing) over several rows gives each row the
        bits that row's product alone gives, on this library and CPU: measured once per signature on random
        weights and rows, 5 and 8 of them (llamafile's GEMM and the repacked GEMM take over from the one-row
        kernels at 2 and 4 rows; measured: floats and IQ4_NL on llamafile's GEMM, repacked Q4_K and Q2_K
        differ, the others agree). A batched decode step multiplies the rows of several sequences together
        only where this holds, so a sequence's logits never depend on the others in its step."""
        key = (m.gid, m.packed)
        known = self._rows_alike.get(key)
        if known is None:
            known = self._rows_alike[key] = self._probe_rows_alike(m)
        return known

    def _probe_rows_alike(self, m: Mat) -> bool:
        t = self._type_of.get(m.gid)
        if t is None:
            return False
        rows, cols = 64, 256
        rng = np.random.default_rng(7)
        raw = self._random_matrix(m.gid, t, rows, cols, rng)
        if raw is None:
            return False
        w = QTensor(raw, t, (rows, cols))
        if m.packed:
            self._probes.append(w)               # its copy lives as long as the backend
            if not self.resident([w]) or not self.mat(w).packed:
                return False
        x = rng.standard_normal((8, cols)).astype(np.float32)
        for n in (5, 8):
            together = self.linear(w, x[:n])
            alone = np.concatenate([self.linear(w, x[i: i + 1]) for i in range(n)])
            if not np.array_equal(together, alone):
                return False
        return True

    def cells_alike(self, m: Mat) -> bool:
        """Whether ``ggml_mul_mat_id`` over experts of ``m``'s type and layout (file's or repacked) gives each
        (expert, row) cell the bits that cell alone gives, whatever other cells and rows share the product:
        measured once per type on two random experts and eight rows, together and one at a time. A batched
        decode step runs every row's experts in one product where this holds
        (:meth:`DecodeGraphs.expert_cells`), and row by row where it does not."""
        known = self._cells_alike.get((m.gid, m.packed))
        if known is None:
            known = self._cells_alike[(m.gid, m.packed)] = self._probe_cells_alike(m)
        return known

    def _probe_cells_alike(self, m: Mat) -> bool:
        t = self._type_of.get(m.gid)
        if t is None:
            return False
        n = 256
        rng = np.random.default_rng(5)
        mats = [self._random_matrix(m.gid, t, n, n, rng) for _ in range(6)]   # two experts' gate, up, down
        if any(raw is None for raw in mats):
            return False
        pool = np.concatenate(mats)                   # expert 1 one stride (three matrices) after expert 0
        size = mats[0].size
        if m.packed:                                  # as an expert source delivers them: repacked in place
            if self.packer is None:
                return False
            for j in range(6):
                self.packer.pack(QTensor(pool[j * size: (j + 1) * size], t, (n, n)))
        base = self.address(pool)
        addrs = [tuple(base + (3 * e + j) * size for j in range(3)) for e in range(2)]
        mat = Mat(m.gid, n, n, m.packed)
        x = rng.standard_normal((8, n)).astype(np.float32)
        together = self._expert_stacks(addrs, [x[:5], x[5:]], mat, mat, "swiglu")   # type: ignore[arg-type]
        for e, (rows, ys) in enumerate(((x[:5], together[0]), (x[5:], together[1]))):
            for i in range(len(rows)):
                (alone,) = self._expert_stacks([addrs[e]], [rows[i: i + 1]], mat, mat, "swiglu")  # type: ignore[list-item]
                if not np.array_equal(ys[i: i + 1], alone):
                    return False
        return True

    @staticmethod
    def _random_matrix(gid: int, t: GGMLQuantizationType, rows: int, cols: int,
                       rng: np.random.Generator) -> np.ndarray | None:
        """A (rows, cols) matrix of random weights in type ``t``'s bytes; None when ggml cannot write it."""
        data = rng.standard_normal((rows, cols)).astype(np.float32)
        if t == GGMLQuantizationType.F32:
            return data.view(np.uint8).reshape(-1)
        raw = np.zeros(QTensor.nbytes_for(t, (rows, cols)), np.uint8)
        imatrix = np.ones(cols, np.float32)
        G.ggml_quantize_init(gid)
        written = G.ggml_quantize_chunk(
            gid, data.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), raw.ctypes.data, 0, rows, cols,
            imatrix.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) if G.ggml_quantize_requires_imatrix(gid) else None)
        return raw if written == raw.size else None

    # --- helpers ---

    def _gid(self, w: QTensor) -> int:
        gid = self._types.get(w.ggml_type)
        if gid is None:
            name = getattr(w.ggml_type, "name", str(w.ggml_type))
            raise ValueError(f"ggml's CPU backend has no kernel for {name}")
        return gid

    def mat(self, w: QTensor) -> Mat:
        """``w``'s signature in a graph (type, shape, whether its leaf reads a repacked copy); ``w`` may also be any object with a ggml_type and a shape (an expert's ranges)."""
        if len(w.shape) != 2:
            raise ValueError(f"expected a matrix, got shape {w.shape}")
        if isinstance(w, QTensor) and w.packed:
            return Mat(self._gid(w), w.shape[0], w.shape[1], True)
        packed = bool(self._packed_at) and isinstance(w, QTensor) and self.address(w.data) in self._packed_at
        return Mat(self._gid(w), w.shape[0], w.shape[1], packed)

    @staticmethod
    def _input(x: np.ndarray, cols: int) -> np.ndarray:
        if x.ndim != 2 or x.shape[1] != cols:
            raise ValueError(f"input of shape {x.shape} for weights of {cols} columns")
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=np.float32)
        return x

    @staticmethod
    def _work_buffer(nbytes: int) -> tuple[np.ndarray, "ctypes._Pointer[ctypes.c_uint8]"]:
        buf, addr = aligned_buffer(nbytes)
        return buf, ctypes.cast(addr, ctypes.POINTER(ctypes.c_uint8))

    def _call(self, key: tuple, n_tensors: int, build: Callable[[Graph], list], addrs: list[int],
              sizes: list[int], weight_bytes: int, strides: Sequence[int] = ()) -> np.ndarray:
        """Run the graph ``key`` (built on first use) on ``addrs`` (and its stacks on ``strides``); its
        outputs, ``sizes`` floats each, land one after another in the returned array."""
        out = np.empty(sum(sizes), np.float32)
        out_addr = out.ctypes.data
        with self._lock:
            graph = self.graph(key, n_tensors, build, weight_bytes)
            for leaf, a in zip(graph.inputs, addrs):
                leaf.data = a
            for stack, stride in zip(graph.stacks, strides):
                graph.set_stride(stack, stride)
            for node, n in zip(graph.outputs, sizes):
                node.data = out_addr
                out_addr += 4 * n
            self.run(graph)
        return out

    def graph(self, key: tuple, n_tensors: int, build: Callable[[Graph], list | tuple[list, list]],
              weight_bytes: int, own_arena: bool = True, n_nodes: int = _GRAPH_NODES) -> Graph:
        """The graph ``key``, built by ``build`` on first use (it returns the outputs, or the outputs and
        the effects); the caller holds :attr:`lock`, points the leaves and runs it with :meth:`run`.
        ``own_arena=False``: its intermediates go where the caller places them (:meth:`Graph.place`).
        ``n_nodes``: its capacity in nodes (and in leaves)."""
        graph = self._graphs.get(key)
        if graph is None:
            return self._new_graph(key, n_tensors, build, weight_bytes, own_arena, n_nodes)
        self._graphs.move_to_end(key)
        return graph

    @property
    def lock(self) -> threading.Lock:
        """Held around building, re-pointing and running one graph (one call at a time)."""
        return self._lock

    def run(self, graph: Graph) -> None:
        """Compute ``graph`` whose leaves and outputs the caller has pointed (under :attr:`lock`)."""
        graph.refresh_views()
        graph.run(self._work_ptr)

    def _new_graph(self, key: tuple, n_tensors: int, build: Callable[[Graph], list | tuple[list, list]],
                   weight_bytes: int, own_arena: bool = True, n_nodes: int = _GRAPH_NODES) -> Graph:
        graph = Graph(n_tensors, n_nodes)
        built = build(graph)
        outputs, effects = built if isinstance(built, tuple) else (built, ())
        self.finish_graph(graph, outputs, weight_bytes, effects, own_arena)
        self._graphs[key] = graph
        if len(self._graphs) > _TEMPLATES:
            self._graphs.popitem(last=False)[1].free()
        return graph

    def finish_graph(self, graph: Graph, outputs: Sequence, weight_bytes: int, effects: Sequence = (),
                     own_arena: bool = True) -> None:
        """Plan ``graph`` (:meth:`Graph.finish`) on this backend's threads, one thread when it multiplies by
        fewer than ``parallel_bytes`` of weights; the work buffer grows to what it needs."""
        threads = self.n_threads if weight_bytes >= self.parallel_bytes else 1
        graph.finish(outputs, threads, effects, own_arena)
        if graph.work_size > self._work.size:
            self._work, self._work_ptr = self._work_buffer(graph.work_size)

    @staticmethod
    def _build_linears(g: Graph, mats: Sequence[Mat], t: int) -> list:
        ws = [g.weight(m) for m in mats]
        x = g.leaf(G.GGML_TYPE_F32, mats[0].cols, t)
        return [G.ggml_mul_mat(g.ctx, w, x) for w in ws]

    @staticmethod
    def _build_gemm(g: Graph, gate: Mat, down: Mat, n: int, activation: str) -> list:
        wg, wu = g.leaf(gate.gid, gate.cols, gate.rows), g.leaf(gate.gid, gate.cols, gate.rows)
        x = g.leaf(G.GGML_TYPE_F32, gate.cols, n)                    # leaves in the order _expert_gemms gives
        wd = g.leaf(down.gid, down.cols, down.rows)
        h = _ACTIVATIONS[activation](g.ctx, G.ggml_mul_mat(g.ctx, wg, x), G.ggml_mul_mat(g.ctx, wu, x))
        return [G.ggml_mul_mat(g.ctx, wd, h)]

    @staticmethod
    def _build_moe(g: Graph, gate: Mat, down: Mat, sizes: list[int], stacks: list["Stack"],
                   activation: str) -> list:
        act = _ACTIVATIONS[activation]
        outs = []
        for n, st in zip(sizes, stacks):  # leaves in the order expert_ffns gives addresses: gate, up, down, x, ids
            wg, wu = (g.stack(gate.gid, gate.cols, gate.rows, st.depth, gate.packed) for _ in range(2))
            wd = g.stack(down.gid, down.cols, down.rows, st.depth, down.packed)
            x = g.leaf(G.GGML_TYPE_F32, gate.cols, 1, n)        # one row per (expert, position) cell
            ids = g.leaf(G.GGML_TYPE_I32, 1, n)                  # the cell's matrix in the stack
            h = act(g.ctx, G.ggml_mul_mat_id(g.ctx, wg, x, ids), G.ggml_mul_mat_id(g.ctx, wu, x, ids))
            outs.append(G.ggml_mul_mat_id(g.ctx, wd, h, ids))
        return outs


def self_test() -> str:
    """Multiply by a Q8_0, a Q4_0 and an F32 matrix on ggml, one and several positions, and check the products
    against NumPy: the ggml probe's child (a CPU that lacks an instruction the library was built with dies here,
    in the child, not in the engine). Returns the backend's one-line description."""
    from gguf import quants

    kernels = GgmlKernels(2)
    rng = np.random.default_rng(0)
    for t in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.F32):
        dense = rng.standard_normal((64, 256)).astype(np.float32)
        raw = quants.quantize(dense, t).view(np.uint8).reshape(-1)
        w = QTensor(np.ascontiguousarray(raw), t, (64, 256))
        exact = quants.dequantize(raw, t).reshape(64, 256)
        for positions in (1, 8):
            x = rng.standard_normal((positions, 256)).astype(np.float32)
            want = x @ exact.T
            got = kernels.linear(w, x)
            error = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            if not error < 0.05:  # activations are rounded to 8 bits: ~1e-2 at most
                raise GgmlUnavailable(f"ggml's {t.name} product is wrong here (relative error {error:.3g})")
    return kernels.description
