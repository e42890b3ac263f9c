"""Where each field of a GGUF header lies: the byte spans a structure-aware mutation aims at.

The map comes from gguf-py's ``GGUFReader`` (each part of a field is a NumPy
view into the file, so its offset is its address minus the map's), not from
the engine's own parser: the harness must not share the code it tests.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType


@dataclass(frozen=True, slots=True)
class Span:
    """Bytes ``[start, start + size)`` of the file; ``kind`` says what they encode, ``owner`` whose."""

    start: int
    size: int
    kind: str   # count, key_len, key, vtype, etype, acount, slen, sbytes, scalar, tname_len, tname, n_dims, dim,
    #             ggml_type, offset
    owner: str  # the metadata key or tensor name (GGUF for the counts)

    @property
    def stop(self) -> int:
        return self.start + self.size


@dataclass(slots=True)
class Layout:
    """Every span of one file's header, the header's end and where tensor data starts."""

    path: Path
    size: int
    header_end: int
    data_start: int
    alignment: int
    spans: list[Span] = field(default_factory=list)

    def where(self, *, kind: str | None = None, owner: str | None = None,
              owner_prefix: str | None = None) -> list[Span]:
        return [s for s in self.spans if (kind is None or s.kind == kind) and (owner is None or s.owner == owner)
                and (owner_prefix is None or s.owner.startswith(owner_prefix))]


_VALUE_KIND = {GGUFValueType.STRING: "sbytes"}


def _field_spans(name: str, offsets: list[tuple[int, int]], types: list[GGUFValueType]) -> list[Span]:
    """Spans of one key/value: key length, key, value type, then the value's parts."""
    (kl, kls), (k, ks), (vt, vts), *rest = offsets
    spans = [Span(kl, kls, "key_len", name), Span(k, ks, "key", name), Span(vt, vts, "vtype", name)]
    if types[0] == GGUFValueType.STRING:
        (sl, sls), (sb, sbs) = rest
        spans += [Span(sl, sls, "slen", name), Span(sb, sbs, "sbytes", name)]
    elif types[0] == GGUFValueType.ARRAY:
        (et, ets), (ac, acs), *items = rest
        spans += [Span(et, ets, "etype", name), Span(ac, acs, "acount", name)]
        if len(types) > 1 and types[1] == GGUFValueType.STRING:
            for (sl, sls), (sb, sbs) in zip(items[0::2], items[1::2]):
                spans += [Span(sl, sls, "slen", name), Span(sb, sbs, "sbytes", name)]
        else:
            spans += [Span(o, s, "scalar", name) for o, s in items]
    else:
        spans += [Span(o, s, "scalar", name) for o, s in rest]
    return spans


def read_layout(path: Path) -> Layout:
    """The header map of a well-formed GGUF (the fixtures the mutants start from)."""
    reader = GGUFReader(path)
    base = reader.data.ctypes.data

    def offsets(parts: list[np.ndarray]) -> list[tuple[int, int]]:
        return [(p.ctypes.data - base, p.nbytes) for p in parts]

    spans = [Span(8, 8, "count", "GGUF.tensor_count"), Span(16, 8, "count", "GGUF.kv_count")]
    end = 24
    for name, f in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        parts = offsets(f.parts)
        spans += _field_spans(name, parts, f.types)
        end = max(end, parts[-1][0] + parts[-1][1])
    for t in reader.tensors:
        (nl, nls), (n, ns), (nd, nds), (d, ds), (gt, gts), (off, offs) = offsets(t.field.parts)
        dims = [Span(d + 8 * i, 8, "dim", t.name) for i in range(ds // 8)]
        spans += [Span(nl, nls, "tname_len", t.name), Span(n, ns, "tname", t.name), Span(nd, nds, "n_dims", t.name),
                  *dims, Span(gt, gts, "ggml_type", t.name), Span(off, offs, "offset", t.name)]
        end = max(end, off + offs)
    align_field = reader.fields.get("general.alignment")
    alignment = int(align_field.contents()) if align_field is not None else 32
    return Layout(path=Path(path), size=int(reader.data.nbytes), header_end=end, data_start=int(reader.data_offset),
                  alignment=alignment, spans=spans)
