"""A model in one GGUF file, or in several parts as llama.cpp's ``gguf-split`` (and gguf-py) write them.

A split model is ``<prefix>-00001-of-0000N.gguf`` ... ``<prefix>-0000N-of-0000N.gguf``.
Each part is a whole GGUF (its own header, tensor table and data section) and
carries ``split.no`` (0-based), ``split.count`` (N) and ``split.tensors.count``
(tensors in all parts); the model's other metadata is in the first part only.
The tensors are distributed over the parts in table order, each in exactly one
(the first part may hold none: ``--no-tensor-first-split``).

As in llama.cpp (``llama_model_loader``), the model is opened from its first
part, and the other parts are found by name: ``-0000k-of-0000N.gguf`` with the
same prefix. Another part given is refused, naming the first part. Every part
is checked before anything is loaded, and each problem is one
:class:`~colibri_aio.errors.ModelFormatError` line naming the file:

- a part missing, or not a GGUF;
- a part whose ``split.no`` is not its place in the names (parts out of order,
  or renamed), or that has no ``split.no`` at all;
- a part of another split or model: another ``split.count`` or
  ``split.tensors.count``, or another ``general.architecture``;
- a tensor in two parts, or parts whose tensors do not add up to
  ``split.tensors.count``.

Parts cannot prove they belong together beyond this (gguf-split writes no model
identity into the later parts): a part of another model with the same count of
tensors of the same names and shapes would be taken, as llama.cpp takes it.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from colibri_aio.errors import ModelFormatError
from colibri_aio.gguf.header import GGUFHeader, HeaderField, HeaderTensor

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS_COUNT = "split.no", "split.count", "split.tensors.count"
MAX_PARTS = 99999  # the names have five digits


def part_name(prefix: str, no: int, count: int) -> str:
    """The name of part ``no`` (0-based) of ``count``, as llama.cpp's ``llama_split_path`` writes it."""
    return f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf"


def _value(header: GGUFHeader, key: str) -> int | None:
    f = header.fields.get(key)
    return None if f is None else int(f.value)


def part_paths(first: Path, count: int) -> list[Path]:
    """Every part's path from the first part's (llama.cpp's ``llama_split_prefix``: the name must end in
    ``-00001-of-<count>.gguf``)."""
    suffix = part_name("", 0, count)
    if not first.name.endswith(suffix) or first.name == suffix:
        raise ModelFormatError(f"{first}: the first of {count} parts (split.count), but its name does not end in "
                               f"{suffix}, so the other parts cannot be found (rename it as gguf-split names parts)")
    prefix = first.name[: -len(suffix)]
    return [first.with_name(part_name(prefix, no, count)) for no in range(count)]


class ModelHeader:
    """The header of a model in one or more files: the metadata of the first, the tensor tables of all.

    Offers what the loader reads of :class:`GGUFHeader` (``fields``,
    ``tensors``, ``path``), with each tensor's ``part`` saying which file
    holds its bytes (its ``data_offset`` is in that file). ``parts`` are the
    files' own headers, in order.
    """

    def __init__(self, parts: list[GGUFHeader]) -> None:
        self.parts = tuple(parts)
        self.path = parts[0].path
        self.fields: dict[str, HeaderField] = parts[0].fields
        self.tensors: list[HeaderTensor] = [dataclasses.replace(t, part=i) if i else t
                                            for i, part in enumerate(parts) for t in part.tensors]

    @property
    def paths(self) -> tuple[Path, ...]:
        return tuple(Path(p.path) for p in self.parts)

    @property
    def file_sizes(self) -> tuple[int, ...]:
        return tuple(p.file_size for p in self.parts)

    @property
    def file_nbytes(self) -> int:
        """Bytes of every part together."""
        return sum(self.file_sizes)


def open_header(path: str | os.PathLike[str]) -> ModelHeader:
    """The header of the model whose (first) file is ``path``: one part, or every part of a split model, checked."""
    first = GGUFHeader(path)
    count = _value(first, SPLIT_COUNT)
    if count is None or count <= 1:  # gguf-split --merge leaves split.count = 0 in the merged file
        return ModelHeader([first])
    p = Path(first.path)
    if count > MAX_PARTS:
        raise ModelFormatError(f"{p}: split.count {count} is more parts than a split model can have ({MAX_PARTS})")
    no = _value(first, SPLIT_NO)
    if no is None:
        raise ModelFormatError(f"{p}: split.count says {count} parts but split.no is missing")
    if no != 0:
        if no >= count:
            raise ModelFormatError(f"{p}: split.no {no} is beyond split.count {count}")
        own = part_name("", no, count)
        first_name = p.name[: -len(own)] + part_name("", 0, count) if p.name.endswith(own) else "split.no 0"
        raise ModelFormatError(f"{p}: this is part {no + 1} of {count}; open the model from its first part "
                               f"({first_name}), as llama.cpp does")
    paths = part_paths(p, count)
    parts = [first] + [_part(path, k, first, count) for k, path in enumerate(paths[1:], start=1)]
    _check_tensors(parts, first)
    return ModelHeader(parts)


def _part(path: Path, no: int, first: GGUFHeader, count: int) -> GGUFHeader:
    """Part ``no`` of ``count``, checked against the first part."""
    where = f"part {no + 1} of {count}"
    if not path.is_file():
        raise ModelFormatError(f"{first.path}: {where}, {path.name}, is missing (expected in {path.parent})")
    part = GGUFHeader(path)
    own_no, own_count = _value(part, SPLIT_NO), _value(part, SPLIT_COUNT)
    if own_no is None or own_count is None:
        raise ModelFormatError(f"{path}: not a part of a split model (no {SPLIT_NO if own_no is None else SPLIT_COUNT}"
                               f"), expected {where} of {first.path}")
    if own_count != count:
        raise ModelFormatError(f"{path}: split.count is {own_count} but the first part, {Path(first.path).name}, "
                               f"says {count}: a part of another split")
    if own_no != no:
        raise ModelFormatError(f"{path}: holds part {own_no + 1} of {count} (split.no {own_no}) but is named as "
                               f"{where}: parts out of order")
    mine, theirs = _value(part, SPLIT_TENSORS_COUNT), _value(first, SPLIT_TENSORS_COUNT)
    if mine != theirs:
        raise ModelFormatError(f"{path}: split.tensors.count is {mine} but the first part, {Path(first.path).name}, "
                               f"says {theirs}: a part of another model")
    arch, own_arch = first.fields.get("general.architecture"), part.fields.get("general.architecture")
    if own_arch is not None and (arch is None or own_arch.value != arch.value):
        raise ModelFormatError(f"{path}: general.architecture is {own_arch.value!r}, the first part's "
                               f"{None if arch is None else arch.value!r}: a part of another model")
    return part


def _check_tensors(parts: list[GGUFHeader], first: GGUFHeader) -> None:
    """No tensor in two parts; the parts hold every tensor ``split.tensors.count`` counts."""
    seen: dict[str, int] = {}
    for no, part in enumerate(parts):
        for t in part.tensors:
            if t.name in seen:
                raise ModelFormatError(f"{part.path}: tensor {t.name} is also in part {seen[t.name] + 1}, "
                                       f"{Path(parts[seen[t.name]].path).name}")
            seen[t.name] = no
    expected = _value(first, SPLIT_TENSORS_COUNT)
    if expected is None:
        raise ModelFormatError(f"{first.path}: split.count says {len(parts)} parts but split.tensors.count is missing")
    if len(seen) != expected:
        raise ModelFormatError(f"{first.path}: the {len(parts)} parts hold {len(seen)} tensors, split.tensors.count "
                               f"says {expected}")
