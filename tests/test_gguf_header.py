"""The fast header reader agrees with gguf.GGUFReader on every fixture and refuses damaged headers."""
from __future__ import annotations

import struct
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from colibri_aio.errors import ModelFormatError
from colibri_aio.gguf.header import GGUFHeader

from support import FIXTURES

sys.path.insert(0, str(FIXTURES.parent / "tools"))
from gguf_fuzz.layout import read_layout  # noqa: E402

GOOD = sorted(p for p in FIXTURES.glob("tiny_*.gguf"))


@pytest.mark.parametrize("path", GOOD, ids=[p.stem for p in GOOD])
def test_matches_gguf_reader(path: Path) -> None:
    ours, theirs = GGUFHeader(path), GGUFReader(path)
    # GGUFReader adds the header's counts as pseudo-fields named GGUF.*
    kv = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(kv)
    for key, f in kv.items():
        want, got = f.contents(), ours.fields[key].contents()
        if isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-7), key
        else:
            assert got == want, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, a.n_bytes, a.data_offset, a.n_elements) == \
            (b.tensor_type, b.n_bytes, b.data_offset, b.n_elements)
        np.testing.assert_array_equal(a.shape, b.shape)


def test_truncated_header_is_refused(tmp_path: Path) -> None:
    raw = (FIXTURES / "tiny_f32.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[:5000])
    with pytest.raises(ModelFormatError, match="truncated"):
        GGUFHeader(cut)


def test_unknown_version_is_refused(tmp_path: Path) -> None:
    raw = bytearray((FIXTURES / "tiny_f32.gguf").read_bytes()[:64])
    raw[4:8] = (7).to_bytes(4, "little")
    bad = tmp_path / "v7.gguf"
    bad.write_bytes(bytes(raw))
    with pytest.raises(ModelFormatError, match="version 7"):
        GGUFHeader(bad)


# ---- hostile headers: built byte by byte, each refused in one line, reading nothing larger than the file

U8, U32, I32, F32, BOOL, STR, ARR, U64 = 0, 4, 5, 6, 7, 8, 9, 10
Q8_0 = 8


def _str(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", vtype) + payload


def _tensor(name: str, dims: list[int], ggml_type: int = 0, offset: int = 0) -> bytes:
    return (_str(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d % (1 << 64)) for d in dims)
            + struct.pack("<II", ggml_type, 0)[:4] + struct.pack("<Q", offset))


ARCH = _kv("general.architecture", STR, _str("qwen3moe"))


def _gguf(tmp_path: Path, kvs: list[bytes], tensors: list[bytes] = (), *, n_kv: int | None = None,
          n_tensors: int | None = None, data: bytes = b"") -> Path:
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(tensors)
    path = tmp_path / "hostile.gguf"
    path.write_bytes(head + bytes(-len(head) % 32) + data)
    return path


def _refused(path: Path, match: str) -> str:
    """Parse under tracemalloc: refused with a message matching ``match``, never allocating beyond 1 MiB."""
    tracemalloc.start()
    try:
        with pytest.raises(ModelFormatError, match=match) as info:
            GGUFHeader(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"parsing a {path.stat().st_size}-byte file allocated {peak} bytes"
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


HUGE = (2**32, 2**40, 2**62, 2**64 - 1)


@pytest.mark.parametrize("n", HUGE)
def test_counts_beyond_the_file_are_refused_before_any_allocation(tmp_path: Path, n: int) -> None:
    _refused(_gguf(tmp_path, [ARCH], n_tensors=n), "claims .* tensors")
    _refused(_gguf(tmp_path, [ARCH], n_kv=n), "claims .* keys")


@pytest.mark.parametrize("n", HUGE)
def test_lengths_beyond_the_file_are_refused_before_any_allocation(tmp_path: Path, n: int) -> None:
    long_string = _str("general.name") + struct.pack("<I", STR) + struct.pack("<Q", n) + b"abc"
    _refused(_gguf(tmp_path, [ARCH, long_string]), "claims a string of")
    for etype in (U8, U32, U64, STR):
        array = _kv("tokenizer.ggml.scores", ARR, struct.pack("<IQ", etype, n) + bytes(16))
        _refused(_gguf(tmp_path, [ARCH, array]), "claims .* items")
    _refused(_gguf(tmp_path, [ARCH], [struct.pack("<Q", n) + b"token_embd"]), "claims a string of")


@pytest.mark.parametrize("kvs, match", [
    ([ARCH, _kv("x", ARR, struct.pack("<IQ", ARR, 1) + struct.pack("<IQ", U8, 1) + b"\x00")], "array of arrays"),
    ([ARCH, _kv("x", 13, b"\x00" * 8)], "unknown value type 13"),
    ([ARCH, _kv("x", ARR, struct.pack("<IQ", 200, 1) + b"\x00" * 8)], "unknown array element type 200"),
    ([ARCH, ARCH], "general.architecture appears twice"),
    ([ARCH, _kv("general.name\nFAKE OK", STR, _str("x"))], "control characters"),
    ([ARCH, _kv(b"general.\xff\xfe", STR, _str("x"))], "not UTF-8"),
    ([ARCH, _kv("qwen3moe.block_count", STR, _str("48"))], "qwen3moe.block_count holds a STRING .* expected a non-negative integer"),
    ([ARCH, _kv("qwen3moe.attention.layer_norm_rms_epsilon", F32, struct.pack("<f", float("nan")))], "expected a finite number"),
    ([ARCH, _kv("tokenizer.ggml.eos_token_id", I32, struct.pack("<i", -1))], "eos_token_id holds .* non-negative"),
    ([ARCH, _kv("tokenizer.ggml.tokens", ARR, struct.pack("<IQ", U32, 2) + bytes(8))], "expected an array of strings"),
    ([ARCH, _kv("tokenizer.chat_template", U32, bytes(4))], "chat_template holds a UINT32"),
    ([_kv("general.architecture", U32, bytes(4))], "architecture holds a UINT32 .* expected a string"),
    ([ARCH, _kv("general.alignment", U32, struct.pack("<I", 48))], "not a power of two"),
    ([ARCH, _kv("general.alignment", U32, struct.pack("<I", 0))], "not a power of two"),
])
def test_malformed_metadata_is_refused(tmp_path: Path, kvs: list[bytes], match: str) -> None:
    _refused(_gguf(tmp_path, kvs), match)


@pytest.mark.parametrize("tensors, data, match", [
    ([_tensor("x" * 64, [32])], 128, "longer than 63 bytes"),
    ([_tensor("bad\x1b[2Jname", [32])], 128, "control characters"),
    ([_tensor("a", [32, 1, 1, 1, 1])], 128, "5 dimensions"),
    ([_tensor("a", [32, -1])], 128, "negative dimension"),
    ([_tensor("a", [2**32, 2**32])], 128, "more than 2\\^63 elements"),
    ([_tensor("a", [33], Q8_0)], 128, "rows of 33 elements, not a multiple of its block of 32"),
    ([_tensor("a", [32], 4)], 128, "unknown ggml type 4"),
    ([_tensor("a", [32]), _tensor("a", [32], offset=128)], 256, "tensor a appears twice"),
    ([_tensor("a", [32], offset=32)], 256, "starts at data offset 32, expected 0"),
    ([_tensor("a", [32]), _tensor("b", [32], offset=64)], 256, "tensor b starts at data offset 64, expected 128"),
    ([_tensor("a", [32]), _tensor("b", [32])], 256, "tensor b starts at data offset 0, expected 128"),
    ([_tensor("a", [1024])], 128, "ends at byte .* \\(truncated\\)"),
])
def test_malformed_tensor_table_is_refused(tmp_path: Path, tensors: list[bytes], data: int, match: str) -> None:
    _refused(_gguf(tmp_path, [ARCH], tensors, data=bytes(data)), match)


def test_a_well_formed_crafted_file_is_read(tmp_path: Path) -> None:
    h = GGUFHeader(_gguf(tmp_path, [ARCH], [_tensor("a", [32]), _tensor("b", [32, 2], offset=128)], data=bytes(384)))
    assert [(t.name, t.n_bytes, t.data_offset - h.data_offset) for t in h.tensors] == [("a", 128, 0), ("b", 256, 128)]


def test_swapped_offsets_of_a_fixture_are_refused(tmp_path: Path) -> None:
    """Two tensors of the same size with their offsets swapped would load as another model: refused."""
    path = FIXTURES / "tiny_q8_0.gguf"
    lay = read_layout(path)
    offsets = {s.owner: s for s in lay.where(kind="offset")}
    a, b = offsets["blk.0.attn_k.weight"], offsets["blk.0.attn_v.weight"]
    raw = bytearray(path.read_bytes())
    raw[a.start:a.stop], raw[b.start:b.stop] = raw[b.start:b.stop], raw[a.start:a.stop]
    (tmp_path / "swapped.gguf").write_bytes(raw)
    _refused(tmp_path / "swapped.gguf", "tensor blk.0.attn_k.weight starts at data offset")
