"""A fast reader of a GGUF file's header: metadata key/values and the tensor table.

``gguf.GGUFReader`` builds a NumPy memmap view for every item of every
metadata array, which takes ~10 s for a 152k-token vocabulary on these
machines; a real Qwen3 model would pay that on every start. This reader
parses the same header with ``struct`` over one read of the header bytes
(~0.2 s) and offers the subset of ``GGUFReader``'s interface the engine uses:
``fields[key].contents()``, ``tensors[i].{name, tensor_type, shape, n_bytes,
data_offset}``. Tensor data is never touched here.

Layout (GGUF v2/v3, little-endian)::

    "GGUF" u32 version  u64 n_tensors  u64 n_kv
    n_kv x  (string key, u32 value_type, value)        string = u64 length + UTF-8 bytes
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset)
    padding to general.alignment (default 32), then tensor data; offsets are relative to it
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from colibri_aio.errors import ModelFormatError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
           12: "<f8"}
STRING, ARRAY = 8, 9
_READ_STEP = 1 << 20


@dataclass(frozen=True, slots=True)
class HeaderField:
    """One metadata key and its value (str, number, bool, or a list of them)."""

    name: str
    value: Any

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True, slots=True)
class HeaderTensor:
    """One entry of the tensor table; ``shape`` is in ggml order (ne[0] first)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int  # absolute file offset of the tensor's first byte


class _Cursor:
    """Reads little-endian values from a growing buffer of the file's head."""

    def __init__(self, f, path: str) -> None:
        self.f, self.path = f, path
        self.buf = bytearray()
        self.pos = 0

    def need(self, n: int) -> None:
        while self.pos + n > len(self.buf):
            more = self.f.read(max(_READ_STEP, self.pos + n - len(self.buf)))
            if not more:
                raise ModelFormatError(f"{self.path}: GGUF header is truncated at byte {len(self.buf)}")
            self.buf += more

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > 1 << 30:
            raise ModelFormatError(f"{self.path}: GGUF string of {n} bytes at {self.pos} is not plausible")
        self.need(n)
        raw = bytes(self.buf[self.pos: self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="surrogateescape")

    def array(self, n: int, vtype: int) -> Any:
        if vtype == STRING:
            return [self.string() for _ in range(n)]
        if vtype == ARRAY:
            return [self.value(self.unpack("<I")) for _ in range(n)]
        dtype = np.dtype(_DTYPES[vtype])
        self.need(n * dtype.itemsize)
        out = np.frombuffer(self.buf, dtype, n, self.pos).tolist()
        self.pos += n * dtype.itemsize
        return out

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            etype, n = self.unpack("<I"), self.unpack("<Q")
            if etype not in _SCALARS and etype not in (STRING, ARRAY):
                raise ModelFormatError(f"{self.path}: unknown GGUF array element type {etype}")
            return self.array(n, etype)
        raise ModelFormatError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")


class GGUFHeader:
    """The parsed header of a GGUF file: ``fields``, ``tensors``, ``alignment``, ``data_offset``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            cur = _Cursor(f, self.path)
            cur.need(4)
            if bytes(cur.buf[:4]) != b"GGUF":
                raise ModelFormatError(f"{self.path}: not a GGUF file (bad magic)")
            cur.pos = 4
            self.version = cur.unpack("<I")
            if self.version not in (2, 3):
                raise ModelFormatError(f"{self.path}: GGUF version {self.version} is not supported (2 or 3; "
                                       f"big-endian files read as a huge version)")
            n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
            self.fields: dict[str, HeaderField] = {}
            for _ in range(n_kv):
                key = cur.string()
                self.fields[key] = HeaderField(key, cur.value(cur.unpack("<I")))
            infos = [self._tensor_info(cur) for _ in range(n_tensors)]
            self.header_nbytes = cur.pos
            self.header_bytes = bytes(cur.buf[: cur.pos])
        align = self.fields.get("general.alignment")
        self.alignment = int(align.value) if align is not None else 32
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise ModelFormatError(f"{self.path}: general.alignment {self.alignment} is not a power of two")
        self.data_offset = -(-self.header_nbytes // self.alignment) * self.alignment
        self.tensors = [self._tensor(*info) for info in infos]
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ModelFormatError(f"{self.path}: tensor {dup} appears twice")

    def _tensor_info(self, cur: _Cursor) -> tuple[str, list[int], int, int]:
        name = cur.string()
        n_dims = cur.unpack("<I")
        if n_dims > 8:
            raise ModelFormatError(f"{self.path}: tensor {name} has {n_dims} dimensions")
        dims = [cur.unpack("<Q") for _ in range(n_dims)]
        return name, dims, cur.unpack("<I"), cur.unpack("<Q")

    def _tensor(self, name: str, dims: list[int], raw_type: int, offset: int) -> HeaderTensor:
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ModelFormatError(f"{self.path}: tensor {name} has unknown ggml type {raw_type}") from None
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        n = int(np.prod(dims)) if dims else 1
        return HeaderTensor(name, ggml_type, np.asarray(dims, np.uint64), n, n // block * type_size,
                            self.data_offset + offset)
