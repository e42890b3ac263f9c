"""The fast header reader agrees with gguf.GGUFReader on every fixture and refuses damaged headers."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from colibri_aio.errors import ModelFormatError
from colibri_aio.gguf.header import GGUFHeader

from support import FIXTURES

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
