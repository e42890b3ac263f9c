"""Load a qwen3moe GGUF: metadata into :class:`ModelArgs`, the dense trunk into RAM,
and every routed expert as three byte ranges for the I/O layer.

Everything that can be wrong with a file is checked here, once, and refused
with a :class:`~colibri_aio.errors.ModelFormatError` whose message is one line
that names the problem.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from colibri_aio.errors import ModelFormatError
from colibri_aio.gguf.header import GGUFHeader
from colibri_aio.io.bulk import BulkStats, read_ranges
from colibri_aio.io.modelfile import FileIdentity
from colibri_aio.experts import ExpertLocation, TensorRange
from colibri_aio.kernels.qtensor import QTensor
from colibri_aio.kernels.quant import SUPPORTED_TYPES, dequantize

SUPPORTED_ARCHITECTURES = ("qwen3moe",)

Progress = Callable[[str, int, int], None]  # (step, done, total)


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """Hyper-parameters of a qwen3moe model, named as in its GGUF keys."""

    architecture: str
    vocab_size: int
    context_length: int
    embedding_length: int
    block_count: int
    head_count: int
    head_count_kv: int
    key_length: int
    value_length: int
    rope_freq_base: float
    rms_eps: float
    expert_count: int
    expert_used_count: int
    expert_feed_forward_length: int
    tied_output: bool


@dataclass(frozen=True, slots=True)
class BlockWeights:
    """The resident weights of one transformer block (everything but the routed experts)."""

    attn_norm: np.ndarray      # (D,)
    attn_q: QTensor            # (H*d, D)
    attn_k: QTensor            # (Hkv*d, D)
    attn_v: QTensor            # (Hkv*d, D)
    attn_q_norm: np.ndarray    # (d,)
    attn_k_norm: np.ndarray    # (d,)
    attn_output: QTensor       # (D, H*d)
    ffn_norm: np.ndarray       # (D,)
    ffn_gate_inp: np.ndarray   # (E, D) router, float32


@dataclass(slots=True)
class Model:
    """A loaded GGUF: args, resident trunk, expert byte ranges, tokenizer metadata."""

    path: Path
    identity: FileIdentity
    args: ModelArgs
    token_embd: QTensor                  # (vocab, D)
    output_norm: np.ndarray              # (D,)
    output: QTensor                      # (vocab, D); token_embd when tied
    blocks: list[BlockWeights]
    experts: list[list[ExpertLocation]]  # [layer][expert]
    reader: GGUFHeader                   # metadata (tokenizer, chat template)
    trunk_read: BulkStats | None = None  # how the resident trunk was read (None: views of the file)

    @property
    def trunk_nbytes(self) -> int:
        mats = [self.token_embd] + ([] if self.args.tied_output else [self.output])
        mats += [m for b in self.blocks for m in (b.attn_q, b.attn_k, b.attn_v, b.attn_output)]
        vecs = [b.ffn_gate_inp for b in self.blocks]
        return sum(m.nbytes for m in mats) + sum(v.nbytes for v in vecs)

    @property
    def expert_nbytes_max(self) -> int:
        return max(loc.nbytes for layer in self.experts for loc in layer)

    def expert(self, layer: int, expert: int) -> ExpertLocation:
        return self.experts[layer][expert]


def _open_reader(path: Path) -> GGUFHeader:
    if not path.is_file():
        raise ModelFormatError(f"{path}: no such model file")
    return GGUFHeader(path)


def _field(reader: GGUFHeader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_args(reader: GGUFHeader, path: Path) -> ModelArgs:
    """ModelArgs from the metadata; refuses unknown architectures and inconsistent keys."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFormatError(
            f"{path}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelFormatError(f"{path}: missing metadata key {arch}.{key}")
        return value

    head_count, embd = int(need("attention.head_count")), int(need("embedding_length"))
    key_length = int(_field(reader, f"{arch}.attention.key_length", embd // head_count))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    args = ModelArgs(
        architecture=arch,
        vocab_size=len(tokens.value) if tokens is not None else _tensor_rows(reader, "token_embd.weight", path),
        context_length=int(need("context_length")),
        embedding_length=embd,
        block_count=int(need("block_count")),
        head_count=head_count,
        head_count_kv=int(_field(reader, f"{arch}.attention.head_count_kv", head_count)),
        key_length=key_length,
        value_length=int(_field(reader, f"{arch}.attention.value_length", key_length)),
        # Qwen3 uses 1e6; llama.cpp falls back to 1e4 when the key is absent, and so do we.
        rope_freq_base=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(need("attention.layer_norm_rms_epsilon")),
        expert_count=int(need("expert_count")),
        expert_used_count=int(need("expert_used_count")),
        expert_feed_forward_length=int(need("expert_feed_forward_length")),
        tied_output="output.weight" not in names,
    )
    _check_args(args, path)
    return args


def _tensor_rows(reader: GGUFHeader, name: str, path: Path) -> int:
    for t in reader.tensors:
        if t.name == name:
            return int(t.shape[-1])
    raise ModelFormatError(f"{path}: missing tensor {name}")


def _check_args(a: ModelArgs, path: Path) -> None:
    if a.expert_used_count > a.expert_count:
        raise ModelFormatError(
            f"{path}: expert_used_count {a.expert_used_count} > expert_count {a.expert_count}")
    if min(a.expert_used_count, a.block_count, a.head_count, a.head_count_kv, a.key_length) < 1:
        raise ModelFormatError(f"{path}: a size in the metadata is zero or negative")
    if a.head_count % a.head_count_kv:
        raise ModelFormatError(
            f"{path}: head_count {a.head_count} is not a multiple of head_count_kv {a.head_count_kv}")
    if a.key_length != a.value_length or a.key_length % 2:
        raise ModelFormatError(
            f"{path}: key_length {a.key_length} and value_length {a.value_length} must be equal and even")


def is_routed_expert(name: str) -> bool:
    """Whether tensor ``name`` holds routed experts (``blk.N.ffn_*_exps.*``): streamed, never resident."""
    return "_exps." in name


class _Tensors:
    """Checked access to the file's tensors: presence, type, shape, bytes within the file."""

    def __init__(self, reader: GGUFHeader, path: Path, args: ModelArgs, copy: bool,
                 progress: Progress | None = None) -> None:
        self.by_name = {t.name: t for t in reader.tensors}
        self.path, self.args, self.copy = path, args, copy
        self.file_size = path.stat().st_size
        self.raw = np.memmap(path, dtype=np.uint8, mode="r")
        self.copies: dict[str, np.ndarray] = {}
        self.read_stats: BulkStats | None = None
        if copy:
            self._read_trunk(progress)

    def _read_trunk(self, progress: Progress | None) -> None:
        """Every tensor but the routed experts, read at once with large aligned reads.

        Not through the mmap: mapped file pages count in RSS, and copying
        through them would hold the trunk twice at peak. Tensors that reach
        past the end of the file are left to :meth:`get`, which names them.
        """
        wanted = [t for t in self.by_name.values()
                  if not is_routed_expert(t.name) and t.data_offset + t.n_bytes <= self.file_size]
        report = None if progress is None else (lambda done, total: progress("load trunk", done, total))
        data, self.read_stats = read_ranges(self.path, [(t.data_offset, t.n_bytes) for t in wanted],
                                            progress=report)
        self.copies = {t.name: d for t, d in zip(wanted, data)}

    def get(self, name: str, shape: tuple[int, ...]):
        t = self.by_name.get(name)
        if t is None:
            hint = ""
            if name.startswith("blk."):
                hint = f" (block_count says {self.args.block_count} blocks)"
            raise ModelFormatError(f"{self.path}: missing tensor {name}{hint}")
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ModelFormatError(f"{self.path}: tensor {name} has unsupported type {t.tensor_type.name} "
                                   f"(this engine runs {', '.join(sorted(s.name for s in SUPPORTED_TYPES))})")
        got = tuple(int(n) for n in reversed(t.shape.tolist()))
        if got != shape:
            raise ModelFormatError(f"{self.path}: tensor {name} has shape {got}, expected {shape} from the metadata")
        if t.data_offset + t.n_bytes > self.file_size:
            raise ModelFormatError(
                f"{self.path}: tensor {name} ends at byte {t.data_offset + t.n_bytes} "
                f"but the file has {self.file_size} (truncated)")
        return t

    def resident(self, name: str, shape: tuple[int, ...]) -> QTensor:
        """A copy in RAM (the trunk must not depend on the page cache), or a view of the file when
        only the model's description is wanted."""
        t = self.get(name, shape)
        if not self.copy:
            return QTensor(self.raw[t.data_offset: t.data_offset + t.n_bytes], t.tensor_type, shape)
        return QTensor(self.copies[name], t.tensor_type, shape)

    def vector(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        return dequantize(self.resident(name, shape)).astype(np.float32, copy=False)


def _block(ts: _Tensors, i: int) -> BlockWeights:
    a = ts.args
    d, e, h, hkv, k = a.embedding_length, a.expert_count, a.head_count, a.head_count_kv, a.key_length
    p = f"blk.{i}."
    return BlockWeights(
        attn_norm=ts.vector(p + "attn_norm.weight", (d,)),
        attn_q=ts.resident(p + "attn_q.weight", (h * k, d)),
        attn_k=ts.resident(p + "attn_k.weight", (hkv * k, d)),
        attn_v=ts.resident(p + "attn_v.weight", (hkv * k, d)),
        attn_q_norm=ts.vector(p + "attn_q_norm.weight", (k,)),
        attn_k_norm=ts.vector(p + "attn_k_norm.weight", (k,)),
        attn_output=ts.resident(p + "attn_output.weight", (d, h * k)),
        ffn_norm=ts.vector(p + "ffn_norm.weight", (d,)),
        ffn_gate_inp=ts.vector(p + "ffn_gate_inp.weight", (e, d)),
    )


def _expert_locations(ts: _Tensors, i: int) -> list[ExpertLocation]:
    a = ts.args
    d, f, e = a.embedding_length, a.expert_feed_forward_length, a.expert_count
    stacked = {
        "gate": ts.get(f"blk.{i}.ffn_gate_exps.weight", (e, f, d)),
        "up": ts.get(f"blk.{i}.ffn_up_exps.weight", (e, f, d)),
        "down": ts.get(f"blk.{i}.ffn_down_exps.weight", (e, d, f)),
    }
    shapes = {"gate": (f, d), "up": (f, d), "down": (d, f)}

    def rng(proj: str, x: int) -> TensorRange:
        t = stacked[proj]
        per = t.n_bytes // e
        return TensorRange(t.data_offset + x * per, per, t.tensor_type, shapes[proj])

    return [ExpertLocation(i, x, rng("gate", x), rng("up", x), rng("down", x)) for x in range(e)]



def load(path: str | os.PathLike[str], *, resident: bool = True, progress: Progress | None = None) -> Model:
    """Open and check a GGUF; load the trunk into RAM and describe every expert's bytes.

    ``resident=False`` checks the same things but leaves the trunk as views of
    the file (for ``plan`` and ``doctor``, which only need sizes).
    """
    p = Path(path)
    reader = _open_reader(p)
    return _build(p, reader, read_args(reader, p), resident, progress)


def with_resident_trunk(model: Model, progress: Progress | None = None) -> Model:
    """``model``, loaded with ``resident=False``, with its trunk read into RAM (the header is not parsed again).

    So that the expert reader can open, and start reading, from the header
    alone while the trunk is read.
    """
    return _build(model.path, model.reader, model.args, True, progress)


def _build(p: Path, reader: GGUFHeader, args: ModelArgs, resident: bool, progress: Progress | None) -> Model:
    ts = _Tensors(reader, p, args, copy=resident, progress=progress)
    vocab, d = args.vocab_size, args.embedding_length
    token_embd = ts.resident("token_embd.weight", (vocab, d))
    output = token_embd if args.tied_output else ts.resident("output.weight", (vocab, d))
    output_norm = ts.vector("output_norm.weight", (d,))
    blocks = [_block(ts, i) for i in range(args.block_count)]
    experts = [_expert_locations(ts, i) for i in range(args.block_count)]
    extra = sorted(n for n in ts.by_name if n.startswith(f"blk.{args.block_count}."))
    if extra:
        raise ModelFormatError(f"{p}: tensor {extra[0]} lies beyond block_count {args.block_count}")
    return Model(path=p, identity=FileIdentity.of(os.stat(p)), args=args, token_embd=token_embd,
                 output_norm=output_norm, output=output, blocks=blocks, experts=experts, reader=reader,
                 trunk_read=ts.read_stats)
