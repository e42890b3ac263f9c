"""The family fixtures' tokenizers against llama.cpp's ids (fixtures/make_family_tokenizer_oracle.py).

One oracle per tokenizer kind: Mixtral's sentencepiece-style vocabulary
(``tokenizer.ggml.model=llama``: score-ordered merges, byte fallback, a ▁ prefix
on every text fragment) and the byte-level BPE pre-tokenizers qwen2, olmo,
deepseek-v3, glm4, gpt-4o and minimax-m2 (split as gpt-4o). Each holds >= 94
strings (the shared corpus of make_tokenizer_oracle.py plus the family's special
tokens) with special-token parsing on and off, with BOS where the file asks for
it, and the detokenized text.
"""
from __future__ import annotations

import hashlib
import json

import pytest
from gguf import GGUFReader

from colibri_aio.text.tokenizer import Tokenizer

from support import FIXTURES, ORACLE

FAMILIES = ["mixtral", "qwen2moe", "olmoe", "deepseek2", "glm4moe", "gptoss", "minimaxm2", "llama4", "dots1",
            "ernie45moe", "hunyuanmoe"]


def _oracle(family: str) -> dict:
    return json.loads((ORACLE / f"{family}_tokenizer_llamacpp.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> tuple[Tokenizer, dict]:
    data = _oracle(request.param)
    path = FIXTURES / data["fixture"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == data["fixture_sha256"], "re-run the oracle script"
    return Tokenizer.from_path(path), data


def test_ids_equal_llamacpp(family: tuple[Tokenizer, dict]) -> None:
    tok, data = family
    assert len(data["cases"]) >= 94
    for case in data["cases"]:
        text = case["text"]
        assert tok.encode(text) == case["ids_special"], text
        assert tok.encode(text, parse_special=False) == case["ids_plain"], text
        assert tok.encode(text, add_special=True) == case["ids_bos_special"], text


def test_decode_equals_llamacpp_and_streams_alike(family: tuple[Tokenizer, dict]) -> None:
    tok, data = family
    for case in data["cases"]:
        ids = case["ids_special"]
        assert tok.decode(ids) == case["detokenized"], case["text"]
        stream = tok.stream_decoder()
        assert "".join(stream.push(i) for i in ids) + stream.flush() == case["detokenized"]


def test_special_ids_and_end_of_generation_equal_llamacpp(family: tuple[Tokenizer, dict]) -> None:
    tok, data = family
    assert (tok.vocab_size, tok.eos_id, tok.add_bos) == (data["n_vocab"], data["eos_id"], data["add_bos"])
    # A file without bos_token_id (olmoe's) has none here; llama.cpp names GPT-2's id 11, unused without add_bos.
    has_bos = "tokenizer.ggml.bos_token_id" in GGUFReader(FIXTURES / data["fixture"]).fields
    assert tok.bos_id == (data["bos_id"] if has_bos else None)
    assert sorted(tok.eog_ids) == data["eog_ids"]


def test_sentencepiece_prefixes_every_fragment_and_falls_back_to_bytes() -> None:
    """Mixtral: ▁ after a special token too; a character without a piece becomes <0xNN> tokens."""
    tok = Tokenizer.from_path(FIXTURES / _oracle("mixtral")["fixture"])
    ids = tok.encode("text</s>more")
    assert ids[ids.index(tok.eos_id) + 1] == tok.encode("more")[0]
    assert tok.decode(ids) == " text</s> more"
    emoji = "\U0001f999"
    pieces = [tok.spec.tokens[i] for i in tok.encode(emoji)]
    assert pieces[-4:] == [f"<0x{b:02X}>" for b in emoji.encode("utf-8")]
    assert tok.decode(tok.encode(emoji)) == " " + emoji


PRE = json.loads((ORACLE / "pre_tokenizers_llamacpp.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("pre", sorted(PRE["pre"]))
def test_every_pre_tokenizer_name_llamacpp_splits_alike_gives_its_ids(pre: str, tmp_path) -> None:
    """One vocabulary under other tokenizer.ggml.pre names (fixtures/make_family_tokenizer_oracle.py pre):
    llama.cpp's ids for each name's split, merge rule and, for a file naming none ("None"), its default."""
    from support import rewrite_gguf

    src = FIXTURES / PRE["fixture"]
    assert hashlib.sha256(src.read_bytes()).hexdigest() == PRE["fixture_sha256"], "re-run the oracle script"
    path = rewrite_gguf(src, tmp_path / "pre.gguf", drop_keys=("tokenizer.ggml.pre",),
                        keys={} if pre == "None" else {"tokenizer.ggml.pre": pre})
    tok, want = Tokenizer.from_path(path), PRE["pre"][pre]
    for text, special, plain, bos in zip(PRE["texts"], want["ids_special"], want["ids_plain"],
                                         want["ids_bos_special"], strict=True):
        assert tok.encode(text) == special, (pre, text)
        assert tok.encode(text, parse_special=False) == plain, (pre, text)
        assert tok.encode(text, add_special=True) == bos, (pre, text)   # llama3's names add BOS by default


def test_a_pre_tokenizer_llamacpp_does_not_know_is_refused_in_one_line(tmp_path) -> None:
    """llama.cpp throws "unknown pre-tokenizer type" for a name it does not know; the engine refuses it too."""
    from colibri_aio.errors import ModelFormatError
    from support import rewrite_gguf

    path = rewrite_gguf(FIXTURES / PRE["fixture"], tmp_path / "bad_pre.gguf", keys={"tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(ModelFormatError, match="unsupported pre-tokenizer 'no-such-pre'"):
        Tokenizer.from_path(path)


def test_kimi_k2_splits_han_as_llamacpp_does(tmp_path) -> None:
    """kimi-k2 on a vocabulary trained with no split (fixtures/make_family_tokenizer_oracle.py han), whose merges
    cross every Latin/Han/kana boundary: llama.cpp's ids; the same vocabulary under gpt-4o's split (kimi-k2's
    without the Han exclusion) gives other ids, so the comparison sees the Han split."""
    from support import rewrite_gguf

    data = json.loads((ORACLE / "kimi_k2_tokenizer_llamacpp.json").read_text(encoding="utf-8"))
    path = FIXTURES / data["fixture"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == data["fixture_sha256"], "re-run the oracle script"
    tok = Tokenizer.from_path(path)
    for case in data["cases"]:
        assert tok.encode(case["text"]) == case["ids_special"], case["text"]
        assert tok.encode(case["text"], parse_special=False) == case["ids_plain"], case["text"]
    other = Tokenizer.from_path(rewrite_gguf(path, tmp_path / "o200k.gguf", keys={"tokenizer.ggml.pre": "gpt-4o"}))
    assert sum(other.encode(c["text"]) != c["ids_special"] for c in data["cases"]) >= 3   # measured: 3 of 54
