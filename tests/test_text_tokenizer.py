"""Tokenizer from GGUF metadata: ids equal llama.cpp's, decoding, streaming, chat template, refusals."""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from colibri_aio.errors import ModelFormatError, UserError
from colibri_aio.text.tokenizer import Tokenizer, read_spec

from support import rewrite_gguf

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
ORACLE = json.loads((FIXTURES / "oracle" / "tokenizer_llamacpp.json").read_text(encoding="utf-8"))
CASES = ORACLE["cases"]
CHAT_ORACLE = json.loads((FIXTURES / "oracle" / "tokenizer_chat_transformers.json").read_text(encoding="utf-8"))


def _load_gguf_tokenizer():
    spec = importlib.util.spec_from_file_location("gguf_tokenizer", FIXTURES / "gguf_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gguf_tokenizer = _load_gguf_tokenizer()


def write_gguf(path: Path, add_keys: Callable[[gguf.GGUFWriter], None]) -> Path:
    """A tensor-less GGUF whose metadata is whatever ``add_keys`` writes."""
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    add_keys(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = write_gguf(tmp_path_factory.mktemp("tok") / "vocab.gguf", gguf_tokenizer.add_tokenizer)
    return Tokenizer.from_path(path)


def case_id(case: dict) -> str:
    return repr(case["text"][:24])


def test_oracle_is_current_and_large_enough() -> None:
    digest = hashlib.sha256(gguf_tokenizer.TOKENIZER_JSON.read_bytes()).hexdigest()
    assert ORACLE["tokenizer_json_sha256"] == digest, "re-run fixtures/make_tokenizer_oracle.py"
    assert len(CASES) >= 60
    assert len({c["text"] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_ids_equal_llamacpp(tok: Tokenizer, case: dict) -> None:
    assert tok.encode(case["text"]) == case["ids_special"]
    assert tok.encode(case["text"], parse_special=False) == case["ids_plain"]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_decode_round_trip_and_matches_llamacpp(tok: Tokenizer, case: dict) -> None:
    text = case["text"]
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, parse_special=False)) == text
    assert tok.decode(case["ids_special"]) == case["detokenized"]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_stream_decoder_equals_decode(tok: Tokenizer, case: dict) -> None:
    ids = case["ids_special"]
    stream = tok.stream_decoder()
    assert "".join(stream.push(i) for i in ids) + stream.flush() == tok.decode(ids)


def test_special_parsing(tok: Tokenizer) -> None:
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[-1] == 2
    plain = tok.encode("<|im_start|>user\nhi<|im_end|>", parse_special=False)
    assert not {0, 1, 2} & set(plain)
    # The encoding mode is per call, never left behind on the shared object.
    assert tok.encode("<|im_end|>") == [2]


def test_special_ids_and_eog_match_llamacpp(tok: Tokenizer) -> None:
    assert tok.vocab_size == ORACLE["n_vocab"]
    assert tok.bos_id == ORACLE["bos_id"]
    assert tok.eos_id == ORACLE["eos_id"]
    assert sorted(tok.eog_ids) == ORACLE["eog_ids"]
    assert all(tok.is_eog(i) for i in ORACLE["eog_ids"])
    assert not tok.is_eog(1)  # <|im_start|> does not end anything
    assert tok.add_bos is False


def test_add_special_prepends_bos_only_when_the_model_asks(tok: Tokenizer) -> None:
    assert tok.encode("hi", add_special=True) == tok.encode("hi")
    with_bos = Tokenizer(dataclasses.replace(tok.spec, add_bos=True))
    assert with_bos.encode("hi", add_special=True) == [tok.bos_id, *tok.encode("hi")]


def test_skip_special_drops_control_text(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\nok<|im_end|>")
    assert tok.decode(ids, skip_special=True) == "assistant\nok"
    stream = tok.stream_decoder(skip_special=True)
    assert "".join(stream.push(i) for i in ids) == "assistant\nok"


def test_stream_decoder_holds_back_split_characters(tok: Tokenizer) -> None:
    ids = tok.encode("🐍")
    assert len(ids) > 1  # the snake's four bytes are not one token in this small vocabulary
    stream = tok.stream_decoder()
    pieces = [stream.push(i) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == "🐍"
    assert stream.flush() == ""


def test_stream_decoder_equals_decode_on_random_ids(tok: Tokenizer) -> None:
    # Random ids make invalid and cut UTF-8 (lone continuation bytes, unfinished
    # characters at the end); both paths must replace them identically.
    rng = np.random.default_rng(1234)
    for _ in range(300):
        ids = rng.integers(0, tok.vocab_size, size=int(rng.integers(0, 20))).tolist()
        stream = tok.stream_decoder()
        assert "".join(stream.push(i) for i in ids) + stream.flush() == tok.decode(ids)


CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
]


def test_chat_template_chatml(tok: Tokenizer) -> None:
    expected = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    assert tok.apply_chat_template(CONVERSATION, add_generation_prompt=False) == expected
    assert tok.apply_chat_template(CONVERSATION) == expected + "<|im_start|>assistant\n"
    ids = tok.encode(tok.apply_chat_template(CONVERSATION[:1]))
    assert ids.count(1) == 2 and ids.count(2) == 1


def test_chat_oracle_uses_the_fixture_template() -> None:
    assert CHAT_ORACLE["templates"]["fixture_chatml"] == gguf_tokenizer.CHAT_TEMPLATE


@pytest.mark.parametrize("case", CHAT_ORACLE["cases"],
                         ids=lambda c: f"{c['template']}-{c['conversation']}-{c['add_generation_prompt']}")
def test_chat_template_matches_transformers(tok: Tokenizer, case: dict) -> None:
    conv = CHAT_ORACLE["conversations"][case["conversation"]]
    t = Tokenizer(dataclasses.replace(tok.spec, chat_template=CHAT_ORACLE["templates"][case["template"]]))
    extra = {k: v for k, v in conv.items() if k != "messages"}
    out = t.apply_chat_template(conv["messages"], add_generation_prompt=case["add_generation_prompt"], **extra)
    assert out == case["rendered"]


QWEN_STYLE_TEMPLATE = """\
{%- if messages[0].role != 'system' %}{{ raise_exception('first message must be system') }}{% endif %}
{%- for message in messages %}
    {%- if message.role == 'tool' %}{% continue %}{% endif %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>\\n' }}
{%- endfor %}
{%- if tools %}{{ tools | tojson }}{% endif %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}"""


def test_chat_template_helpers_and_extra_variables(tok: Tokenizer) -> None:
    t = Tokenizer(dataclasses.replace(tok.spec, chat_template=QWEN_STYLE_TEMPLATE))
    messages = [{"role": "system", "content": " be brief "}, {"role": "tool", "content": "x"},
                {"role": "user", "content": "héllo"}]
    out = t.apply_chat_template(messages, tools=[{"name": "café"}], enable_thinking=False)
    assert out == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhéllo<|im_end|>\n"
                   '[{"name": "café"}]<|im_start|>assistant\n<think>\n\n</think>\n\n')
    with pytest.raises(UserError, match="first message must be system"):
        t.apply_chat_template(messages[2:])


def test_chat_template_is_sandboxed(tok: Tokenizer) -> None:
    t = Tokenizer(dataclasses.replace(tok.spec, chat_template="{{ messages.__class__.__mro__ }}"))
    with pytest.raises(UserError, match="chat template failed"):
        t.apply_chat_template(CONVERSATION)
    t = Tokenizer(dataclasses.replace(tok.spec, chat_template="{% set _ = messages.append(1) %}x"))
    with pytest.raises(UserError, match="chat template failed"):
        t.apply_chat_template(CONVERSATION)


def test_missing_chat_template_is_a_user_error(tok: Tokenizer) -> None:
    with pytest.raises(UserError, match="no chat template"):
        Tokenizer(dataclasses.replace(tok.spec, chat_template=None)).apply_chat_template(CONVERSATION)


def _one_line_refusal(path: Path, match: str) -> None:
    with pytest.raises(ModelFormatError, match=match) as info:
        Tokenizer.from_path(path)
    assert "\n" not in str(info.value)


def test_refuses_gguf_without_tokenizer(tmp_path: Path) -> None:
    _one_line_refusal(write_gguf(tmp_path / "none.gguf", lambda w: None), "no tokenizer")


def test_refuses_other_tokenizer_models(tmp_path: Path) -> None:
    def unigram_vocab(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("t5")
        w.add_token_list(["<unk>", "<s>", "</s>", "▁a"])
        w.add_token_scores([0.0, 0.0, 0.0, -1.0])

    _one_line_refusal(write_gguf(tmp_path / "t5.gguf", unigram_vocab),
                      "unsupported tokenizer model 't5' .*supported: gpt2, llama")


def test_refuses_sentencepiece_tokenizer_without_scores(tmp_path: Path) -> None:
    def no_scores(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("llama")
        w.add_token_list(["<unk>", "<s>", "</s>", "▁a"])

    _one_line_refusal(write_gguf(tmp_path / "spm.gguf", no_scores), "one score per token")


def test_refuses_other_pre_tokenizer(tmp_path: Path) -> None:
    """poro-chat: llama.cpp splits it with a pattern this engine does not carry."""
    def other_pre(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("poro-chat")
        w.add_token_list(["a", "b", "ab"])
        w.add_token_merges(["a b"])

    _one_line_refusal(write_gguf(tmp_path / "pre.gguf", other_pre), "unsupported pre-tokenizer 'poro-chat'")


def test_an_out_of_range_special_id_is_read_as_absent(tmp_path: Path) -> None:
    """llama.cpp's rule ("bad special token ... using default id"): the file is not refused for it."""
    def bad_eos(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(["a", "b", "ab"])
        w.add_token_merges(["a b"])
        w.add_eos_token_id(7)
        w.add_bos_token_id(2)

    spec = read_spec(gguf.GGUFReader(write_gguf(tmp_path / "eos.gguf", bad_eos)))
    assert spec.eos_id is None and spec.bos_id == 2


@pytest.mark.parametrize("stem, key, extra", [("tiny_f32", "tokenizer.ggml.token_type", [1, 1]),
                                              ("mixtral_f32", "tokenizer.ggml.scores", [0.5, -0.5])])
def test_arrays_longer_than_the_vocabulary_are_read_to_its_length(stem: str, key: str, extra: list,
                                                                   tmp_path: Path) -> None:
    """llama.cpp reads the first n_tokens scores and token types and refuses only shorter arrays:
    a file with more opens and tokenizes as the file without the surplus."""
    src = FIXTURES / f"{stem}.gguf"
    values = list(gguf.GGUFReader(src).fields[key].contents())
    longer = rewrite_gguf(src, tmp_path / "longer.gguf", keys={key: values + extra})
    a, b = Tokenizer.from_path(src), Tokenizer.from_path(longer)
    assert b.spec == a.spec
    text = "Hello world, 12 3 é\n\tok"
    assert b.encode(text) == a.encode(text)
    shorter = rewrite_gguf(src, tmp_path / "shorter.gguf", keys={key: values[:-1]})
    with pytest.raises(ModelFormatError):
        Tokenizer.from_path(shorter)


def test_refuses_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "text.gguf"
    path.write_bytes(b"this is not a GGUF file at all")
    _one_line_refusal(path, "not a GGUF file")
