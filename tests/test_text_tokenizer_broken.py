"""A broken tokenizer in a model file is one ModelFormatError line naming the file, from the API and
from every command that builds it; never an exception of the ``tokenizers`` library."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from colibri_aio.errors import ModelFormatError, one_line
from colibri_aio.gguf.header import GGUFHeader
from colibri_aio.text.tokenizer import Tokenizer

from support import FIXTURES, main_in_process

sys.path.insert(0, str(FIXTURES.parent / "tools"))
from gguf_fuzz.layout import read_layout  # noqa: E402

SOURCE = FIXTURES / "tiny_q8_0.gguf"


def patched(tmp_path: Path, owner: str, item: int, edit) -> Path:
    """SOURCE with the bytes of string ``item`` of ``owner`` replaced by ``edit(old)`` (same length)."""
    span = read_layout(SOURCE).where(kind="sbytes", owner=owner)[item]
    raw = bytearray(SOURCE.read_bytes())
    new = edit(bytes(raw[span.start: span.stop]))
    assert len(new) == span.size
    raw[span.start: span.stop] = new
    path = tmp_path / "broken_tokenizer.gguf"
    path.write_bytes(raw)
    return path


def token_index(text: str) -> int:
    return GGUFHeader(SOURCE).fields["tokenizer.ggml.tokens"].value.index(text)


def ascii_merge() -> int:
    """A merge whose last character is an ASCII letter (to put a character no token has in its place)."""
    merges = GGUFHeader(SOURCE).fields["tokenizer.ggml.merges"].value
    return next(i for i, m in enumerate(merges) if m[-1].isascii() and m[-1].isalpha())


CASES = {
    "merge out of vocabulary": (
        "tokenizer.ggml.merges", ascii_merge, lambda old: old[:-1] + b"\x7f",
        "the tokenizer cannot be built from its tokenizer.ggml.\\* keys: Error while initializing BPE: Token "),
    "token not UTF-8": (
        "tokenizer.ggml.tokens", 300, lambda old: b"\xff" + old[1:], "tokenizer.ggml.tokens\\[300\\] is not UTF-8 text"),
    "merge not UTF-8": (
        "tokenizer.ggml.merges", 5, lambda old: old[:-1] + b"\xc3", "tokenizer.ggml.merges\\[5\\] is not UTF-8 text"),
    "a byte without its token": (
        "tokenizer.ggml.tokens", lambda: token_index("T"), lambda old: b"\x01", "lacks 1 of the 256 byte-level tokens \\(e.g. 'T'\\)"),
    "unknown tokenizer model": (
        "tokenizer.ggml.model", 0, lambda old: b"spm!", "unsupported tokenizer model 'spm!'"),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_broken_tokenizer_is_one_line_naming_the_file(tmp_path: Path, case: str) -> None:
    owner, item, edit, match = CASES[case]
    path = patched(tmp_path, owner, item() if callable(item) else item, edit)
    with pytest.raises(ModelFormatError, match=match) as info:
        Tokenizer.from_path(path)
    assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value)
    status, _, err = main_in_process("logits", str(path), "--ids", "1,2", "--out", str(tmp_path / "l.npy"),
                                     "--no-history", "--kernels", "numpy")
    assert status == 2
    assert err.strip().splitlines()[-1] == f"colibri-aio: error: {one_line(info.value)}"


def test_special_token_outside_the_vocabulary_names_the_file_and_the_key(tmp_path: Path) -> None:
    lay = read_layout(SOURCE)
    span = next(s for s in lay.where(kind="scalar", owner="tokenizer.ggml.eos_token_id"))
    raw = bytearray(SOURCE.read_bytes())
    raw[span.start: span.stop] = (5000).to_bytes(span.size, "little")
    path = tmp_path / "eos_5000.gguf"
    path.write_bytes(raw)
    with pytest.raises(ModelFormatError, match=f"^{path}: tokenizer.ggml.eos_token_id = 5000 is outside the vocabulary"):
        Tokenizer.from_path(path)
    # plan and doctor do not build the tokenizer; doctor --verify checks the ids and says which
    assert main_in_process("plan", str(path), "--no-history")[0] == 0
    assert main_in_process("doctor", str(path))[0] == 0
    status, out, err = main_in_process("doctor", str(path), "--verify")
    assert status == 2
    assert f"FAIL  special tokens   {path}: tokenizer.ggml.eos_token_id = 5000 is not a token id" in out
    assert err.strip() == (f"colibri-aio: error: doctor: special tokens: {path}: tokenizer.ggml.eos_token_id = 5000 "
                           f"is not a token id (the vocabulary has 2048) (and 1 more failed checks)")
