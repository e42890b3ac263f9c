"""Scan every tensor of a GGUF for values that are not finite (``doctor --verify``).

A NaN or infinity in one quantisation scale, one norm weight or one expert
row turns generation into empty or repeated text; the forward pass stops at
the first one it meets (naming the layer), and this scan finds them all
before a run: every tensor is decoded in chunks of rows, straight from a
read-only map of the file, and each one with a value that is not finite is
reported with the rows (or, for stacked expert tensors, the experts) that
hold it.
"""
from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibri_aio.gguf.header import GGUFHeader, HeaderTensor
from colibri_aio.kernels.qtensor import QTensor
from colibri_aio.kernels.quant import SUPPORTED_TYPES, dequantize

CHUNK_WEIGHTS = 1 << 22  # weights decoded at a time: 16 MiB of float32


@dataclass(frozen=True, slots=True)
class NonFinite:
    """One tensor with values that are not finite, and where they are."""

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


def scan(path: Path, header: GGUFHeader, progress: Callable[[int, int], None] | None = None
         ) -> Iterator[NonFinite]:
    """Every tensor with a value that is not finite; ``progress(bytes done, bytes total)`` as it goes.

    Tensors of types the engine cannot decode are skipped (loading the model
    refuses them anyway).
    """
    tensors = [t for t in header.tensors if t.tensor_type in SUPPORTED_TYPES]
    total, done = sum(t.n_bytes for t in tensors), 0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        raw = np.frombuffer(mm, np.uint8)
        try:
            for t in tensors:
                found = _scan_tensor(raw, t)
                done += t.n_bytes
                if progress is not None:
                    progress(done, total)
                if found is not None:
                    yield found
        finally:
            del raw  # the map cannot close while a view of it lives


def _scan_tensor(raw: np.ndarray, t: HeaderTensor) -> NonFinite | None:
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
    return NonFinite(t.name, len(bad), rows, experts)
