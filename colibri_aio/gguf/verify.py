"""What ``doctor --verify`` checks beyond loading: where the bytes are, the special tokens, the values.

:func:`layout_problems` checks the byte ranges the engine will read against
the file: every tensor inside the data section and apart from every other,
every expert's three ranges inside its stacked tensor (so none reaches back
into the header and metadata), none overlapping another. The header reader
and the loader already refuse a file that breaks these rules; this check
looks at the ranges as the I/O layer will receive them, so a fault between
the two would show here. :func:`special_token_problems` checks that every
``tokenizer.ggml.*_token_id`` names a token of the vocabulary (``plan`` and
``doctor`` do not build the tokenizer, which refuses them).

:func:`scan` looks at every value. A NaN or infinity in one quantisation scale, one norm weight or one expert
row turns generation into empty or repeated text; the forward pass stops at
the first one it meets (naming the layer), and this scan finds them all
before a run: every tensor is decoded in chunks of rows, straight from a
read-only map of the file, and each one with a value that is not finite is
reported with the rows (or, for stacked expert tensors, the experts) that
hold it.
"""
from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from colibri_aio.experts import ExpertLocation
from colibri_aio.gguf.header import HeaderTensor
from colibri_aio.gguf.split import ModelHeader
from colibri_aio.kernels.qtensor import QTensor
from colibri_aio.kernels.quant import SUPPORTED_TYPES, dequantize

CHUNK_WEIGHTS = 1 << 22  # weights decoded at a time: 16 MiB of float32


@dataclass(frozen=True, slots=True)
class NonFinite:
    """One tensor with values that are not finite, and where they are."""

    path: str          # the file (part) holding it
    tensor: str
    rows: int          # rows holding one (a row is ggml's ne[0] weights)
    total_rows: int
    experts: tuple[int, ...] = ()  # for a stacked expert tensor: the experts that hold them

    def describe(self) -> str:
        if self.experts:
            where = f"expert{'s' if len(self.experts) > 1 else ''} {_ids(self.experts)}"
        else:
            where = f"{self.rows} of {self.total_rows} rows" if self.total_rows > 1 else "its only row"
        return f"{self.tensor}: values that are not finite (NaN or infinity) in {where}"


def _ids(ids: tuple[int, ...], shown: int = 8) -> str:
    more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
    return ", ".join(map(str, ids[:shown])) + more


def layout_problems(header: ModelHeader, experts: list[list[ExpertLocation]], file_sizes: Sequence[int]
                    ) -> list[str]:
    """Every tensor and expert range that lies outside its file's data section or over another one (empty: none);
    each problem is one line that starts with the path of the file (part) it is in. ``file_sizes``: each part's."""
    problems: list[str] = []
    for part, (own, file_size) in enumerate(zip(header.parts, file_sizes)):
        start = own.data_offset
        spans = sorted((t.data_offset, t.data_offset + t.n_bytes, t.name) for t in header.tensors if t.part == part)
        found = [f"tensor {name} at bytes [{lo}, {hi}) is outside the data section [{start}, {file_size})"
                 for lo, hi, name in spans if lo < start or hi > file_size]
        found += [f"tensors {a} and {b} overlap" for (_, a_hi, a), (b_lo, _, b) in zip(spans, spans[1:]) if b_lo < a_hi]
        problems += [f"{own.path}: {p}" for p in found]
    by_start = {(t.part, t.data_offset): t for t in header.tensors}
    for layer in filter(None, experts):
        for proj in range(3):
            ranges = sorted((loc.ranges[proj].offset, loc.ranges[proj].nbytes, loc.expert) for loc in layer)
            part = layer[0].ranges[proj].file
            own, file_size = header.parts[part], file_sizes[part]
            first, last = ranges[0][0], ranges[-1][0] + ranges[-1][1]
            stacked = by_start.get((part, first))
            where = f"layer {layer[0].layer} {('gate', 'up', 'down')[proj]} experts at bytes [{first}, {last})"
            found = []
            if first < own.data_offset:
                found.append(f"{where} reach into the header and metadata (which end at {own.data_offset})")
            elif (stacked is None or last > stacked.data_offset + stacked.n_bytes or last > file_size
                  or any(loc.ranges[proj].file != part for loc in layer)):
                found.append(f"{where} are not inside one stacked tensor of the file")
            for (lo, n, x), (next_lo, _, y) in zip(ranges, ranges[1:]):
                if next_lo < lo + n:
                    found.append(f"{where}: experts {x} and {y} overlap")
            problems += [f"{own.path}: {p}" for p in found]
    return problems


def special_token_problems(header: ModelHeader) -> list[str]:
    """Every ``tokenizer.ggml.*_token_id`` that names no token of the vocabulary (empty: none)."""
    tokens = header.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        return []
    n = len(tokens.value)
    return [f"{header.path}: {key} = {f.value} is not a token id (the vocabulary has {n}): ignored, as llama.cpp "
            f"ignores it"
            for key, f in header.fields.items()
            if key.startswith("tokenizer.ggml.") and key.endswith("_token_id") and not 0 <= f.value < n]


def scan(header: ModelHeader, progress: Callable[[int, int], None] | None = None) -> Iterator[NonFinite]:
    """Every tensor (in every part) with a value that is not finite; ``progress(bytes done, bytes total)`` as it goes.

    Tensors of types the engine cannot decode are skipped (loading the model
    refuses them anyway).
    """
    tensors = [t for t in header.tensors if t.tensor_type in SUPPORTED_TYPES]
    total, done = sum(t.n_bytes for t in tensors), 0
    for part, own in enumerate(header.parts):
        with open(own.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            raw = np.frombuffer(mm, np.uint8)
            try:
                for t in (t for t in tensors if t.part == part):
                    found = _scan_tensor(raw, t, own.path)
                    done += t.n_bytes
                    if progress is not None:
                        progress(done, total)
                    if found is not None:
                        yield found
            finally:
                del raw  # the map cannot close while a view of it lives


def _scan_tensor(raw: np.ndarray, t: HeaderTensor, path: str) -> NonFinite | None:
    shape = [int(n) for n in t.shape.tolist()]  # ggml order: ne[0] is the row
    cols, rows = shape[0], t.n_elements // shape[0]
    row_bytes = t.n_bytes // rows
    data = raw[t.data_offset: t.data_offset + t.n_bytes]
    step = max(1, CHUNK_WEIGHTS // cols)
    bad_rows: list[np.ndarray] = []
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        values = dequantize(QTensor(data[start * row_bytes: stop * row_bytes], t.tensor_type, (stop - start, cols)))
        finite = np.isfinite(values).all(axis=1)
        if not finite.all():
            bad_rows.append(start + np.flatnonzero(~finite))
    if not bad_rows:
        return None
    bad = np.concatenate(bad_rows)
    experts: tuple[int, ...] = ()
    if len(shape) == 3:  # ffn_*_exps: the expert axis is outermost
        experts = tuple(int(e) for e in np.unique(bad // shape[1]))
    return NonFinite(path, t.name, len(bad), rows, experts)
