"""Load a GGUF of any registered family: metadata into the family's ``ModelArgs``,
the dense trunk into RAM, and every routed expert as three byte ranges for the I/O layer.

The split is by tensor name, the same for every family: routed experts
(``blk.<i>.ffn_{gate,up,down}_exps.weight``) stay on disk and are streamed;
everything else the family lists (``block_tensors``: attention, norms, routers,
shared experts and their gates, the FFN of leading dense blocks) is the
resident trunk. A dense block (``leading_dense_block_count``) has no experts.

A model split into several files (gguf-split) is opened from its first part
(:mod:`colibri_aio.gguf.split`); each tensor, and so each expert range, knows
which part holds its bytes.

Everything that can be wrong with a file is checked here, once, and refused
with a :class:`~colibri_aio.errors.ModelFormatError` whose message is one line
that names the problem.
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import dropwhile
from pathlib import Path
from typing import Any

import numpy as np

from colibri_aio.arch import SUPPORTED_ARCHITECTURES, family
from colibri_aio.arch.base import BaseArgs, Family, Metadata, TensorSpec
from colibri_aio.errors import ModelFormatError
from colibri_aio.gguf.split import ModelHeader, open_header
from colibri_aio.io.bulk import BulkStats, read_ranges, total_stats
from colibri_aio.io.modelfile import FileIdentity
from colibri_aio.experts import ExpertLocation, TensorRange
from colibri_aio.kernels.qtensor import QTensor
from colibri_aio.kernels.quant import SUPPORTED_TYPES, dequantize

# The hyper-parameters every family has (each family's own ModelArgs extends them).
ModelArgs = BaseArgs

Progress = Callable[[str, int, int], None]  # (step, done, total)


class BlockWeights:
    """The resident tensors of one block (everything but the routed experts), by their name in the block.

    ``blk["attn_q"]`` (or ``blk.attn_q``) is ``blk.<i>.attn_q.weight``; names with
    a dot are the file's (``blk["attn_q.bias"]``). Matrices are raw
    :class:`QTensor` bytes; norms, biases and routers float32 arrays.
    ``get`` returns None for a tensor this file does not have.
    """

    __slots__ = ("tensors",)

    def __init__(self, tensors: dict[str, QTensor | np.ndarray]) -> None:
        self.tensors = tensors

    def __getitem__(self, name: str) -> Any:
        return self.tensors[name]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.tensors[name]
        except KeyError:
            raise AttributeError(name) from None

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> Any:
        return self.tensors.get(name)

    def matrices(self) -> Iterator[QTensor]:
        return (t for t in self.tensors.values() if isinstance(t, QTensor))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


@dataclass(slots=True)
class Model:
    """A loaded GGUF (one file or the parts of a split model): args, resident trunk, expert byte ranges,
    tokenizer metadata, its family."""

    path: Path                           # the model's file (of a split model: its first part)
    identities: tuple[FileIdentity, ...]  # every file's, in part order
    args: BaseArgs
    token_embd: QTensor                  # (vocab, D)
    output_norm: np.ndarray              # (D,)
    output: QTensor                      # (vocab, D); token_embd when tied
    blocks: list[BlockWeights]
    experts: list[list[ExpertLocation]]  # [layer][expert]; [] for a dense block
    reader: ModelHeader                  # metadata (tokenizer, chat template), every part's tensor table
    family: Family
    trunk_read: BulkStats | None = None  # how the resident trunk was read (None: views of the file)
    globals: dict[str, np.ndarray] = field(default_factory=dict)  # the family's model-wide vectors (rope_freqs)

    @property
    def paths(self) -> tuple[Path, ...]:
        """Every file of the model, in part order (one for a model in one file)."""
        return self.reader.paths

    @property
    def file_nbytes(self) -> int:
        """Bytes of the model's files together."""
        return sum(i.size for i in self.identities)

    @property
    def trunk_nbytes(self) -> int:
        """Bytes of everything resident: embeddings, output head, the family's model-wide tensors, every
        block's tensors."""
        head = self.token_embd.nbytes + self.output_norm.nbytes + (0 if self.args.tied_output else self.output.nbytes)
        return head + sum(g.nbytes for g in self.globals.values()) + sum(b.nbytes for b in self.blocks)

    @property
    def expert_nbytes_max(self) -> int:
        return max(loc.nbytes for layer in self.experts for loc in layer)

    @property
    def block_matrix_weights(self) -> int:
        """Weights of every resident matrix of the blocks (each is used once per decoded token)."""
        return sum(math.prod(m.shape) for b in self.blocks for m in b.matrices())

    def expert(self, layer: int, expert: int) -> ExpertLocation:
        return self.experts[layer][expert]


def _open_reader(path: Path) -> ModelHeader:
    if not path.is_file():
        raise ModelFormatError(f"{path}: no such model file")
    return open_header(path)


def family_of(reader: ModelHeader, path: Path) -> Family:
    """The registered family of the file's ``general.architecture``; anything else is refused."""
    f = reader.fields.get("general.architecture")
    arch = None if f is None else f.contents()
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFormatError(
            f"{path}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return family(arch)


def read_args(reader: ModelHeader, path: Path, fam: Family) -> BaseArgs:
    """The family's ModelArgs from the metadata; refuses missing and inconsistent keys."""
    args = fam.args.from_gguf(Metadata(reader, path, fam.architecture))
    args.check(path)
    return args


def _significant(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape without leading 1s: ggml pads dims with 1, so {D} and {D, 1} are one shape."""
    return tuple(dropwhile(lambda n: n == 1, shape))


def _block_of(name: str) -> int:
    """The block a tensor belongs to (``blk.N.``), -1 for the tensors outside blocks."""
    m = re.match(r"blk\.(\d+)\.", name)
    return -1 if m is None else int(m.group(1))


def is_routed_expert(name: str) -> bool:
    """Whether tensor ``name`` holds routed experts' weights (``blk.N.ffn_*_exps.weight``): streamed, never
    resident. Their biases (gpt-oss) are small and stay resident."""
    return name.endswith("_exps.weight")


class _Tensors:
    """Checked access to the model's tensors: presence, type, shape, bytes within the file (part) holding each."""

    def __init__(self, reader: ModelHeader, path: Path, args: ModelArgs, copy: bool,
                 progress: Progress | None = None, huge_pages: bool = True) -> None:
        self.by_name = {t.name: t for t in reader.tensors}
        self.used: set[str] = set()
        self.path, self.args, self.copy = path, args, copy
        self.paths = reader.paths
        self.file_sizes = [p.stat().st_size for p in self.paths]
        self.raws = [np.memmap(p, dtype=np.uint8, mode="r") for p in self.paths]
        self.copies: dict[str, np.ndarray] = {}
        self.read_stats: BulkStats | None = None
        if copy:
            self._read_trunk(progress, huge_pages)

    def _read_trunk(self, progress: Progress | None, huge_pages: bool) -> None:
        """Every tensor but the routed experts, read at once with large aligned reads, each from the part
        that holds it.

        Not through the mmap: mapped file pages count in RSS, and copying
        through them would hold the trunk twice at peak. Tensors that reach
        past the end of their file are left to :meth:`get`, which names them.
        """
        wanted = [t for t in self.by_name.values()
                  if not is_routed_expert(t.name) and _block_of(t.name) < self.args.block_count
                  and t.data_offset + t.n_bytes <= self.file_sizes[t.part]]
        parts = sorted({t.part for t in wanted})
        stats = []
        for n, part in enumerate(parts):
            mine = [t for t in wanted if t.part == part]
            report = None if progress is None else (
                lambda done, total, n=n: progress("load trunk", n * total + done, len(parts) * total))
            data, part_stats = read_ranges(self.paths[part], [(t.data_offset, t.n_bytes) for t in mine],
                                           huge_pages=huge_pages, progress=report)
            self.copies.update({t.name: d for t, d in zip(mine, data)})
            stats.append(part_stats)
        self.read_stats = total_stats(stats)

    def get(self, name: str, shape: tuple[int, ...]):
        t = self.by_name.get(name)
        if t is None:
            hint = ""
            if name.startswith("blk."):
                hint = f" (block_count says {self.args.block_count} blocks)"
            raise ModelFormatError(f"{self.path}: missing tensor {name}{hint}")
        self.used.add(name)
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ModelFormatError(f"{self.path}: tensor {name} has unsupported type {t.tensor_type.name} "
                                   f"(this engine runs {', '.join(sorted(s.name for s in SUPPORTED_TYPES))})")
        got = tuple(int(n) for n in reversed(t.shape.tolist()))
        if _significant(got) != _significant(shape):
            raise ModelFormatError(f"{self.path}: tensor {name} has shape {got}, expected {shape} from the metadata")
        if t.data_offset + t.n_bytes > self.file_sizes[t.part]:
            raise ModelFormatError(
                f"{self.paths[t.part]}: tensor {name} ends at byte {t.data_offset + t.n_bytes} "
                f"but the file has {self.file_sizes[t.part]} (truncated)")
        return t

    def resident(self, name: str, shape: tuple[int, ...]) -> QTensor:
        """A copy in RAM (the trunk must not depend on the page cache), or a view of the file when
        only the model's description is wanted."""
        t = self.get(name, shape)
        if not self.copy:
            return QTensor(self.raws[t.part][t.data_offset: t.data_offset + t.n_bytes], t.tensor_type, shape)
        return QTensor(self.copies[name], t.tensor_type, shape)

    def vector(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        return dequantize(self.resident(name, shape)).astype(np.float32, copy=False)


def _block(ts: _Tensors, specs: list[TensorSpec], i: int) -> BlockWeights:
    tensors: dict[str, QTensor | np.ndarray] = {}
    for spec in specs:
        name = spec.file_name(i)
        if spec.optional and name not in ts.by_name:
            continue
        tensors[spec.name] = ts.vector(name, spec.shape) if spec.dense else ts.resident(name, spec.shape)
    return BlockWeights(tensors)


def _expert_locations(ts: _Tensors, i: int) -> list[ExpertLocation]:
    a = ts.args
    d, f, e = a.embedding_length, a.expert_feed_forward_length, a.expert_count
    if f"blk.{i}.ffn_gate_exps.weight" not in ts.by_name and f"blk.{i}.ffn_gate.0.weight" in ts.by_name:
        raise ModelFormatError(f"{ts.path}: experts stored one tensor each (blk.{i}.ffn_gate.0.weight), an older "
                               f"GGUF layout; convert the model again with a current llama.cpp")
    stacked = {
        "gate": ts.get(f"blk.{i}.ffn_gate_exps.weight", (e, f, d)),
        "up": ts.get(f"blk.{i}.ffn_up_exps.weight", (e, f, d)),
        "down": ts.get(f"blk.{i}.ffn_down_exps.weight", (e, d, f)),
    }
    shapes = {"gate": (f, d), "up": (f, d), "down": (d, f)}

    def rng(proj: str, x: int) -> TensorRange:
        t = stacked[proj]
        per = t.n_bytes // e
        return TensorRange(t.data_offset + x * per, per, t.tensor_type, shapes[proj], t.part)

    return [ExpertLocation(i, x, rng("gate", x), rng("up", x), rng("down", x)) for x in range(e)]



def _check_every_tensor_used(ts: _Tensors, path: Path) -> None:
    """Refuse tensors the forward pass would ignore (llama.cpp refuses them too): silently
    skipping one would compute another model than the file holds."""
    a, block = ts.args, _block_of
    extra = sorted(n for n in ts.by_name if n not in ts.used
                   and not a.block_count <= block(n) < a.block_count + a.skipped_blocks)
    if not extra:
        return
    for name in extra:
        if block(name) >= a.block_count + a.skipped_blocks:
            raise ModelFormatError(f"{path}: tensor {name} lies beyond block_count {a.block_count}")
    raise ModelFormatError(f"{path}: tensor {extra[0]} is not part of a {a.architecture} model as this engine runs "
                           f"it ({len(extra)} such tensor{'s' if len(extra) > 1 else ''})")


def load(path: str | os.PathLike[str], *, resident: bool = True, progress: Progress | None = None) -> Model:
    """Open and check a GGUF; load the trunk into RAM and describe every expert's bytes.

    ``resident=False`` checks the same things but leaves the trunk as views of
    the file (for ``plan`` and ``doctor``, which only need sizes).
    """
    p = Path(path)
    reader = _open_reader(p)
    fam = family_of(reader, p)
    try:
        args = read_args(reader, p, fam)
    except (TypeError, ValueError, ArithmeticError) as exc:  # the keys' types are checked; their values may still clash
        raise ModelFormatError(f"{p}: the hyper-parameters in the metadata cannot be used: {exc}") from exc
    return _build(p, reader, fam, args, resident, progress)


def with_resident_trunk(model: Model, progress: Progress | None = None, huge_pages: bool = True) -> Model:
    """``model``, loaded with ``resident=False``, with its trunk read into RAM (the header is not parsed again),
    on transparent huge pages unless ``huge_pages`` is False.

    So that the expert reader can open, and start reading, from the header
    alone while the trunk is read.
    """
    return _build(model.path, model.reader, model.family, model.args, True, progress, huge_pages)


def _build(p: Path, reader: ModelHeader, fam: Family, args: ModelArgs, resident: bool,
           progress: Progress | None, huge_pages: bool = True) -> Model:
    ts = _Tensors(reader, p, args, copy=resident, progress=progress, huge_pages=huge_pages)
    vocab, d = args.vocab_size, args.embedding_length
    token_embd = ts.resident("token_embd.weight", (vocab, d))
    output = token_embd if args.tied_output else ts.resident("output.weight", (vocab, d))
    output_norm = ts.vector("output_norm.weight", (d,))
    blocks = [_block(ts, fam.block_tensors(args, i), i) for i in range(args.block_count)]
    experts = [_expert_locations(ts, i) if args.is_moe(i) else [] for i in range(args.block_count)]
    globals_ = {spec.name: ts.vector(spec.name + ".weight", spec.shape) for spec in fam.global_tensors(args)
                if not (spec.optional and spec.name + ".weight" not in ts.by_name)}
    _check_every_tensor_used(ts, p)
    identities = tuple(FileIdentity.of(os.stat(part)) for part in reader.paths)
    return Model(path=p, identities=identities, args=args, token_embd=token_embd,
                 output_norm=output_norm, output=output, blocks=blocks, experts=experts, reader=reader, family=fam,
                 trunk_read=ts.read_stats, globals=globals_)
