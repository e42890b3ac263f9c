"""A broken tokenizer in a model file is one ModelFormatError line naming the file, from the API and
from every command that builds it; never an exception of the ``tokenizers`` library."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import structlog.testing

from colibri_aio import logs

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


def test_a_special_token_outside_the_vocabulary_is_ignored_with_one_warning_as_llamacpp_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp warns "bad special token ... using default id" and runs such a file (a converter that cut
    the vocabulary leaves them): so do we, the id taken as absent; the end of generation still comes from
    the vocabulary's <|endoftext|>; the logits are the file's."""
    lay = read_layout(SOURCE)
    span = next(s for s in lay.where(kind="scalar", owner="tokenizer.ggml.eos_token_id"))
    raw = bytearray(SOURCE.read_bytes())
    raw[span.start: span.stop] = (5000).to_bytes(span.size, "little")
    path = tmp_path / "eos_5000.gguf"
    path.write_bytes(raw)
    monkeypatch.setattr(logs, "_warned", set())       # this process has warned of nothing yet
    with structlog.testing.capture_logs() as events:
        tokenizer = Tokenizer.from_path(path)
        Tokenizer.from_path(path)                       # built again: no second warning
    assert tokenizer.eos_id is None and tokenizer.spec.tokens.index("<|endoftext|>") in tokenizer.eog_ids
    assert Tokenizer.from_path(SOURCE).eog_ids == tokenizer.eog_ids
    assert [e["event"] for e in events if e["log_level"] == "warning"] == [
        "tokenizer.ggml.eos_token_id = 5000 is outside the vocabulary of 2048: ignored, as llama.cpp ignores it"]
    ids = "1,2,3"
    for p in (SOURCE, path):
        status, _, _ = main_in_process("logits", str(p), "--ids", ids, "--out", str(tmp_path / f"{p.stem}.npy"),
                                       "--no-history", "--kernels", "numpy")
        assert status == 0
    assert np.array_equal(np.load(tmp_path / f"{SOURCE.stem}.npy"), np.load(tmp_path / "eos_5000.npy"))
    status, out, _ = main_in_process("doctor", str(path), "--verify")
    assert f"WARN  special tokens   {path}: tokenizer.ggml.eos_token_id = 5000 is not a token id" in out
