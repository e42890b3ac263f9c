"""A fast, defensive reader of a GGUF file's header: metadata key/values and the tensor table.

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

The file may come from anyone, so nothing in it is trusted before it is
checked, and every check failure is one :class:`ModelFormatError` line naming
the file and the field:

- no length or count is believed beyond what the rest of the file could hold
  (a string, an array, the key and tensor counts), so nothing larger than the
  file is ever allocated or read;
- the structural rules llama.cpp's reader (``gguf.cpp``) applies: no
  duplicate keys or tensor names, no arrays of arrays, at most 4 dimensions,
  tensor names under 64 bytes, element counts that fit in 63 bits, rows that
  fill whole quantisation blocks, and tensors stored one after the other in
  table order, each padded to the alignment, all inside the file (so no
  tensor overlaps another or the header, and swapped offsets are caught);
- keys and tensor names are UTF-8 text without control characters (they end
  up in messages and on terminals);
- the keys the engine reads hold the type it reads them as (:data:`KEY_KINDS`),
  so a count is a non-negative integer wherever it is used.
"""
from __future__ import annotations

import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from colibri_aio.errors import ModelFormatError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
           12: "<f8"}
TYPE_NAMES = {0: "UINT8", 1: "INT8", 2: "UINT16", 3: "INT16", 4: "UINT32", 5: "INT32", 6: "FLOAT32", 7: "BOOL",
              8: "STRING", 9: "ARRAY", 10: "UINT64", 11: "INT64", 12: "FLOAT64"}
STRING, ARRAY = 8, 9
INTEGER_TYPES = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
FLOAT_TYPES = frozenset({6, 12})
_READ_STEP = 1 << 20
MAX_STRING = 1 << 30   # bytes in one string (a chat template or a token is far smaller)
MAX_DIMS = 4           # GGML_MAX_DIMS
MAX_NAME = 63          # bytes in a tensor name (GGML_MAX_NAME is 64 with the terminating NUL)
# The fewest bytes a key/value (u64 key length, u32 type, a one-byte value) and a tensor entry
# (u64 name length, u32 n_dims, u32 type, u64 offset) can take: a count beyond the bytes left is a lie.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_BYTES = 8 + 4 + 4 + 8
_MIN_ITEM_BYTES = {**{t: struct.calcsize(f) for t, f in _SCALARS.items()}, STRING: 8}


class Kind(NamedTuple):
    """What a metadata key must hold: a description for messages and a test on (type, element type, value)."""

    description: str
    test: Any  # Callable[[int, int | None, Any], bool]


def _count(vtype: int, etype: int | None, v: Any) -> bool:
    return vtype in INTEGER_TYPES and v >= 0


def _number(vtype: int, etype: int | None, v: Any) -> bool:
    return (vtype in INTEGER_TYPES or vtype in FLOAT_TYPES) and math.isfinite(v)


COUNT = Kind("a non-negative integer", _count)
# The keys llama.cpp reads as one value or one per block (llama_model_loader::get_key_or_arr);
# arch.base.Metadata.get reads an array of them as one value for all blocks.
PER_LAYER_KEYS = frozenset({"feed_forward_length", "attention.head_count", "attention.head_count_kv",
                            "expert_used_count", "expert_feed_forward_length"})
COUNTS = Kind("a non-negative integer or an array of them", lambda vtype, etype, v: _count(vtype, etype, v) or (
    vtype == ARRAY and etype in INTEGER_TYPES and all(x >= 0 for x in v)))
NUMBER = Kind("a finite number", _number)
FLAG = Kind("a boolean", lambda vtype, etype, v: vtype == 7)
TEXT = Kind("a string", lambda vtype, etype, v: vtype == STRING)
TEXTS = Kind("an array of strings", lambda vtype, etype, v: vtype == ARRAY and etype == STRING)
INTEGERS = Kind("an array of integers", lambda vtype, etype, v: vtype == ARRAY and etype in INTEGER_TYPES)
NUMBERS = Kind("an array of numbers without NaN", lambda vtype, etype, v: vtype == ARRAY and (
    etype in INTEGER_TYPES or (etype in FLOAT_TYPES and not any(math.isnan(x) for x in v))))

# The keys the engine reads, with the type it reads them as (the types llama.cpp writes and reads).
KEY_KINDS: dict[str, Kind] = {
    "general.architecture": TEXT, "general.alignment": COUNT,
    "tokenizer.ggml.model": TEXT, "tokenizer.ggml.pre": TEXT, "tokenizer.ggml.tokens": TEXTS,
    "tokenizer.ggml.token_type": INTEGERS, "tokenizer.ggml.merges": TEXTS, "tokenizer.ggml.scores": NUMBERS,
    "tokenizer.ggml.add_bos_token": FLAG, "tokenizer.ggml.add_eos_token": FLAG,
    "tokenizer.ggml.add_space_prefix": FLAG, "tokenizer.chat_template": TEXT,
    "split.no": COUNT, "split.count": COUNT, "split.tensors.count": COUNT,
}
# ... and ``<architecture>.<suffix>`` keys, the hyper-parameters every family reads.
ARCH_KEY_KINDS: dict[str, Kind] = {
    **{k: COUNT for k in (
        "context_length", "embedding_length", "block_count", "expert_count", "expert_shared_feed_forward_length",
        "expert_shared_count", "expert_group_count", "expert_group_used_count", "expert_gating_func",
        "leading_dense_block_count", "nextn_predict_layers", "attention.key_length", "attention.value_length", "attention.q_lora_rank", "attention.kv_lora_rank",
        "attention.sliding_window", "rope.dimension_count")},
    **{k: COUNTS for k in PER_LAYER_KEYS},
    **{k: NUMBER for k in (
        "rope.freq_base", "attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon",
        "expert_weights_scale", "rope.scaling.factor")},
    "expert_weights_norm": FLAG,
    # deepseek2: MLA head sizes and YaRN
    **{k: COUNT for k in ("attention.key_length_mla", "attention.value_length_mla",
                          "rope.scaling.original_context_length")},
    **{k: NUMBER for k in ("rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
                           "rope.scaling.yarn_log_multiplier", "rope.scaling.attn_factor")},
    "rope.scaling.type": TEXT,
}
_TOKEN_ID_KEY = re.compile(r"tokenizer\.ggml\.\w+_token_id")


def expected_kind(key: str, architecture: str | None) -> Kind | None:
    """The kind a key must hold, or None for a key the engine does not read."""
    if key in KEY_KINDS:
        return KEY_KINDS[key]
    if _TOKEN_ID_KEY.fullmatch(key):
        return COUNT
    if architecture and key.startswith(architecture + "."):
        return ARCH_KEY_KINDS.get(key[len(architecture) + 1:])
    return None


@dataclass(frozen=True, slots=True)
class HeaderField:
    """One metadata key and its value (str, number, bool, or a list of them) with its GGUF type codes."""

    name: str
    value: Any
    type: int
    element_type: int | None = None  # for an array

    def contents(self) -> Any:
        return self.value

    def describe_type(self) -> str:
        if self.type == ARRAY:
            return f"an array of {TYPE_NAMES.get(self.element_type or 0, '?')}"
        return f"a {TYPE_NAMES.get(self.type, '?')} ({_short(self.value)})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True, slots=True)
class HeaderTensor:
    """One entry of the tensor table; ``shape`` is in ggml order (ne[0] first)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int  # absolute file offset of the tensor's first byte
    part: int = 0     # which file of a model in several parts holds it (gguf/split.py)


class _Cursor:
    """Reads little-endian values from a growing buffer of the file's head, never past the file's end."""

    def __init__(self, f, path: str) -> None:
        self.f, self.path = f, path
        self.size = os.fstat(f.fileno()).st_size
        self.buf = bytearray()
        self.pos = 0

    @property
    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.left:
            raise ModelFormatError(f"{self.path}: GGUF header is truncated: {what} needs {n} bytes at byte "
                                   f"{self.pos}, the file has {self.size}")
        while self.pos + n > len(self.buf):
            more = self.f.read(min(max(_READ_STEP, self.pos + n - len(self.buf)), self.size - len(self.buf)))
            if not more:  # the file shrank under us
                raise ModelFormatError(f"{self.path}: GGUF header is truncated at byte {len(self.buf)}")
            self.buf += more

    def unpack(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def raw_string(self, what: str) -> bytes:
        n = self.unpack("<Q", what)
        if n > min(self.left, MAX_STRING):
            limit = "the file has left" if n > self.left else f"the limit of {MAX_STRING}"
            raise ModelFormatError(f"{self.path}: {what} at byte {self.pos - 8} claims a string of {n} bytes, "
                                   f"more than {limit}")
        self.need(n, what)
        raw = bytes(self.buf[self.pos: self.pos + n])
        self.pos += n
        return raw

    def string(self, what: str) -> str:
        raw = self.raw_string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:  # kept (as lone surrogates); whoever uses the text decides
            return raw.decode("utf-8", errors="surrogateescape")

    def name(self, what: str) -> str:
        """A key or tensor name: UTF-8 text without control characters."""
        start = self.pos
        raw = self.raw_string(what)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFormatError(f"{self.path}: {what} at byte {start} is not UTF-8 text") from None
        if not text.isprintable():
            raise ModelFormatError(f"{self.path}: {what} at byte {start} has control characters: {_short(text)}")
        return text

    def array(self, key: str) -> tuple[list, int]:
        etype, n = self.unpack("<I", key), self.unpack("<Q", key)
        if etype == ARRAY:
            raise ModelFormatError(f"{self.path}: metadata key {key} is an array of arrays (not supported, "
                                   f"as in llama.cpp)")
        if etype not in _MIN_ITEM_BYTES:
            raise ModelFormatError(f"{self.path}: metadata key {key} has unknown array element type {etype}")
        if n * _MIN_ITEM_BYTES[etype] > self.left:
            raise ModelFormatError(f"{self.path}: metadata key {key} claims {n} items, more than the "
                                   f"{self.left} bytes left in the file could hold")
        if etype == STRING:
            return [self.string(key) for _ in range(n)], etype
        dtype = np.dtype(_DTYPES[etype])
        self.need(n * dtype.itemsize, key)
        out = np.frombuffer(self.buf, dtype, n, self.pos).tolist()
        self.pos += n * dtype.itemsize
        return out, etype

    def field(self, key: str) -> HeaderField:
        vtype = self.unpack("<I", key)
        if vtype in _SCALARS:
            return HeaderField(key, self.unpack(_SCALARS[vtype], key), vtype)
        if vtype == STRING:
            return HeaderField(key, self.string(key), vtype)
        if vtype == ARRAY:
            value, etype = self.array(key)
            return HeaderField(key, value, vtype, etype)
        raise ModelFormatError(f"{self.path}: metadata key {key} has unknown value type {vtype}")


class GGUFHeader:
    """The parsed and checked header of a GGUF file: ``fields``, ``tensors``, ``alignment``, ``data_offset``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            cur = _Cursor(f, self.path)
            self.file_size = cur.size
            cur.need(4, "the magic")
            if bytes(cur.buf[:4]) != b"GGUF":
                raise ModelFormatError(f"{self.path}: not a GGUF file (bad magic)")
            cur.pos = 4
            self.version = cur.unpack("<I", "the version")
            if self.version not in (2, 3):
                raise ModelFormatError(f"{self.path}: GGUF version {self.version} is not supported (2 or 3; "
                                       f"big-endian files read as a huge version)")
            n_tensors, n_kv = cur.unpack("<Q", "the tensor count"), cur.unpack("<Q", "the key count")
            if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_BYTES > cur.left:
                raise ModelFormatError(f"{self.path}: GGUF header claims {n_tensors} tensors and {n_kv} keys, more "
                                       f"than its {cur.size} bytes could hold")
            self.fields: dict[str, HeaderField] = {}
            for i in range(n_kv):
                key = cur.name(f"metadata key {i}")
                if key in self.fields:
                    raise ModelFormatError(f"{self.path}: metadata key {key} appears twice")
                self.fields[key] = cur.field(key)
            infos = [self._tensor_info(cur, i) for i in range(n_tensors)]
            self.header_nbytes = cur.pos
            self.header_bytes = bytes(cur.buf[: cur.pos])
        self._check_kinds()
        align = self.fields.get("general.alignment")
        self.alignment = int(align.value) if align is not None else 32
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise ModelFormatError(f"{self.path}: general.alignment {self.alignment} is not a power of two")
        self.data_offset = -(-self.header_nbytes // self.alignment) * self.alignment
        self.tensors = self._tensors(infos)

    def _check_kinds(self) -> None:
        arch = self.fields.get("general.architecture")
        architecture = arch.value if arch is not None and arch.type == STRING else None
        for f in self.fields.values():
            kind = expected_kind(f.name, architecture)
            if kind is not None and not kind.test(f.type, f.element_type, f.value):
                raise ModelFormatError(f"{self.path}: metadata key {f.name} holds {f.describe_type()}, "
                                       f"expected {kind.description}")

    def _tensor_info(self, cur: _Cursor, i: int) -> tuple[str, list[int], int, int]:
        name = cur.name(f"the name of tensor {i}")
        if len(name.encode()) > MAX_NAME:
            raise ModelFormatError(f"{self.path}: tensor name {_short(name)} is longer than {MAX_NAME} bytes")
        n_dims = cur.unpack("<I", name)
        if n_dims > MAX_DIMS:
            raise ModelFormatError(f"{self.path}: tensor {name} has {n_dims} dimensions (at most {MAX_DIMS})")
        dims = [cur.unpack("<q", name) for _ in range(n_dims)]
        return name, dims, cur.unpack("<I", name), cur.unpack("<Q", name)

    def _tensors(self, infos: list[tuple[str, list[int], int, int]]) -> list[HeaderTensor]:
        tensors, seen, expected = [], set(), 0
        for name, dims, raw_type, offset in infos:
            if name in seen:
                raise ModelFormatError(f"{self.path}: tensor {name} appears twice")
            seen.add(name)
            t = self._tensor(name, dims, raw_type, offset)
            if offset != expected:
                raise ModelFormatError(
                    f"{self.path}: tensor {name} starts at data offset {offset}, expected {expected} (tensors "
                    f"follow each other in table order, each padded to {self.alignment} bytes)")
            if t.data_offset + t.n_bytes > self.file_size:
                raise ModelFormatError(f"{self.path}: tensor {name} ends at byte {t.data_offset + t.n_bytes} but "
                                       f"the file has {self.file_size} (truncated)")
            expected += -(-t.n_bytes // self.alignment) * self.alignment
            tensors.append(t)
        return tensors

    def _tensor(self, name: str, dims: list[int], raw_type: int, offset: int) -> HeaderTensor:
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ModelFormatError(f"{self.path}: tensor {name} has unknown ggml type {raw_type}") from None
        if any(d < 0 for d in dims):
            raise ModelFormatError(f"{self.path}: tensor {name} has a negative dimension {dims}")
        n = math.prod(dims)
        if n >= 1 << 63:
            raise ModelFormatError(f"{self.path}: tensor {name} of shape {dims} has more than 2^63 elements")
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        row = dims[0] if dims else 1
        if row % block:
            raise ModelFormatError(f"{self.path}: tensor {name} of type {ggml_type.name} has rows of {row} "
                                   f"elements, not a multiple of its block of {block}")
        return HeaderTensor(name, ggml_type, np.asarray(dims, np.uint64), n, n // block * type_size,
                            self.data_offset + offset)
