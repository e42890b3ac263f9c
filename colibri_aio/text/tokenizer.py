"""Tokenizer and chat template, read from a GGUF's ``tokenizer.*`` metadata.

Two kinds of vocabulary (``tokenizer.ggml.model``), both run by the
``tokenizers`` library; this module only translates the GGUF metadata into
its pipeline and mirrors llama.cpp (``llama-vocab.cpp``) where it matters for ids:

* ``gpt2``: byte-level BPE (vocab + merges from the file, GPT-2 byte mapping)
  after the split regexes llama.cpp uses for the file's ``tokenizer.ggml.pre``
  (:data:`PRE_TOKENIZERS`: the names llama.cpp gives the splits of qwen2, qwen35, gpt-2, llama3/glm4,
  deepseek-v3, gpt-4o, bailingmoe, kimi-k2 and its default; none named: the default, with a warning);
* ``llama``: sentencepiece-style BPE (Mixtral, Llama 2): pieces merge by the
  score of the piece they make (``tokenizer.ggml.scores``), a character with
  no piece becomes its UTF-8 bytes' ``<0xNN>`` tokens, spaces are ``▁``, and
  every text fragment gets a leading ``▁`` (the one at the start and each
  one after a special token, as llama.cpp does unless
  ``tokenizer.ggml.add_space_prefix`` is false).

For both:

* control and unknown tokens (``<|im_start|>``, ``<s>``, ``<unk>`` ...) are
  matched in the text only when ``parse_special`` is on; user-defined tokens
  are matched always;
* end of generation is eos/eot/eom plus the tokens llama.cpp recognises by
  their text (``<|im_end|>``, ``<|endoftext|>`` ...).

Decoding goes through one byte table (token id -> raw bytes) so that the
one-shot :meth:`Tokenizer.decode` and the streaming :class:`StreamDecoder`
cannot disagree.
"""
from __future__ import annotations

import codecs
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import gguf
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from colibri_aio.gguf.header import GGUFHeader
from colibri_aio.gguf.split import ModelHeader, open_header
from colibri_aio.errors import ModelFormatError, UserError
from colibri_aio.logs import warn_once
from colibri_aio.text.chat_template import ChatTemplate

__all__ = ["Tokenizer", "StreamDecoder", "TokenizerSpec", "PRE_TOKENIZERS", "QWEN2_SPLIT_REGEX"]

# Qwen2's pre-tokenizer split pattern: the one in Qwen's tokenizer.json and in
# llama.cpp for LLAMA_VOCAB_PRE_TYPE_QWEN2 (note \p{N} alone: digits split one by one).
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-2's pattern, which llama.cpp uses for LLAMA_VOCAB_PRE_TYPE_GPT2 and OLMO (case-sensitive
# contractions, letters and digits in runs with one optional leading space).
GPT2_SPLIT_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"

# DeepSeek-V3's three splits: digits in runs of up to 3, kana/CJK runs, then the main pattern.
DEEPSEEK_V3_SPLIT_REGEXES = (
    r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"
    r" ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# GLM-4's pattern: Qwen2's with digits in runs of up to 3.
GLM4_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's pattern: Qwen2's with combining marks (\p{M}) counted with the letters they follow.
QWEN35_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
    r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Ling/Ring (bailingmoe, bailingmoe2): Qwen2's pattern with one newline per run of line breaks.
BAILINGMOE_SPLIT_REGEX = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)
# Kimi K2 (tokenization_kimi.py; llama.cpp splits it with a hand-written handler of the same pattern): Han runs
# apart, then o200k's word runs over letters that are not Han (class intersection), digits in runs of up to 3.
_NOT_HAN_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_NOT_HAN_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
KIMI_K2_SPLIT_REGEX = (
    r"[\p{Han}]+|"
    rf"[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}*{_NOT_HAN_LOWER}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    rf"[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}+{_NOT_HAN_LOWER}*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's "default" split (a file that names none, or names "default"): punctuation runs, GPT-2's
# pattern, digit runs, then digits in threes.
DEFAULT_SPLIT_REGEXES = (
    r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]",
)
# o200k (GPT-4o, gpt-oss): case-aware word runs with their contractions, digits in runs of up to 3.
O200K_SPLIT_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text before byte-level BPE for one ``tokenizer.ggml.pre`` (llama-vocab.cpp).

    ``regexes`` apply in turn, each splitting the pieces of the one before.
    ``ignore_merges``: a piece that is a whole vocabulary entry is one token
    (llama.cpp sets it for glm4 and llama3, among others).
    """

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False   # llama.cpp's BOS default for the name when the file has no add_bos_token (llama3's)


# The splits this engine runs, each as llama-vocab.cpp gives it to a group of tokenizer.ggml.pre names.
_QWEN2 = PreTokenizer((QWEN2_SPLIT_REGEX,))
_GPT2 = PreTokenizer((GPT2_SPLIT_REGEX,))
_DEEPSEEK_V3 = PreTokenizer(DEEPSEEK_V3_SPLIT_REGEXES)
_LLAMA3 = PreTokenizer((GLM4_SPLIT_REGEX,), ignore_merges=True, add_bos=True)   # llama3's pattern is GLM-4's
_O200K = PreTokenizer((O200K_SPLIT_REGEX,))

# tokenizer.ggml.pre -> its split: every name llama.cpp (llama-vocab.cpp) maps to a split above, with the
# merge rule it sets beside it. A name llama.cpp splits otherwise (poro-chat, tekken, viking ...) is
# refused: tokenizing it with another split would give other ids. Adding one is an entry
# here with the regexes from llama-vocab.cpp and a llama.cpp tokenizer oracle to check it against
# (fixtures/make_family_tokenizer_oracle.py: the family fixtures and the ``pre`` names of one vocabulary;
# tests/test_text_tokenizer_families.py).
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
                     "solar-open"), _QWEN2),
    "qwen35": PreTokenizer((QWEN35_SPLIT_REGEX,)),
    **dict.fromkeys(("olmo", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
                     "a.x-4.0", "mellum", "modern-bert", "exaone4"), _GPT2),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), _DEEPSEEK_V3),
    **dict.fromkeys(("glm4", "glm5"), PreTokenizer((GLM4_SPLIT_REGEX,), ignore_merges=True)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano"), _LLAMA3),
    # the same pattern without llama.cpp's ignore_merges
    **dict.fromkeys(("chatglm-bpe", "dbrx", "smaug-bpe"), PreTokenizer((GLM4_SPLIT_REGEX,))),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2", "kanana2", "talkie"), _O200K),
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), PreTokenizer((BAILINGMOE_SPLIT_REGEX,))),
    "kimi-k2": PreTokenizer((KIMI_K2_SPLIT_REGEX,)),
    "default": PreTokenizer(DEFAULT_SPLIT_REGEXES),
}

SUPPORTED_MODELS = ("gpt2", "llama")

# Token texts llama.cpp puts in its end-of-generation set whatever their ids.
# (llama.cpp also makes them control tokens.)
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
})
# gpt-oss's harmony markers: llama.cpp makes them user-defined tokens (matched and rendered always).
HARMONY_MARKERS = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})
# In a vocabulary with both of a pair, llama.cpp takes <|end|> out of the end-of-generation set
# and makes it user-defined (o200k_harmony: <|end|> ends a message, not the generation).
END_IS_NOT_EOG = (("<|return|>", "<|call|>"), ("<|calls|>", "<|flush|>"))

_TT = gguf.TokenType


@dataclass(frozen=True)
class TokenizerSpec:
    """The tokenizer as the GGUF describes it, before any library object is built.

    ``model``: ``gpt2`` (byte-level BPE: ``merges``, ``pre``) or ``llama``
    (sentencepiece-style: ``scores``, ``add_space_prefix``).
    """

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eom_id: int | None
    pad_id: int | None
    add_bos: bool
    chat_template: str | None
    model: str = "gpt2"
    pre: str | None = "qwen2"
    scores: list[float] | None = None
    add_space_prefix: bool = True
    unk_id: int | None = None


def _field(reader: gguf.GGUFReader | GGUFHeader | ModelHeader, key: str) -> Any:
    """The decoded value of a metadata key, or None when the key is absent."""
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def read_spec(reader: gguf.GGUFReader | GGUFHeader | ModelHeader) -> TokenizerSpec:
    """Read and check the ``tokenizer.*`` keys; refuse anything we cannot tokenize exactly."""
    model = _field(reader, "tokenizer.ggml.model")
    if model is None:
        raise ModelFormatError("GGUF has no tokenizer (tokenizer.ggml.model is missing)")
    if model not in SUPPORTED_MODELS:
        raise ModelFormatError(
            f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); supported: {', '.join(SUPPORTED_MODELS)}")
    pre = _field(reader, "tokenizer.ggml.pre")
    if model == "gpt2" and not pre:
        # llama.cpp: "missing pre-tokenizer type, using: 'default'" (older conversions), and it runs the file
        warn_once("tokenizer.ggml.pre is missing: the text is split as llama.cpp's 'default' pre-tokenizer "
                  "splits it, as llama.cpp does (generation quality may suffer; a newer conversion names it)")
        pre = "default"
    if model == "gpt2" and pre not in PRE_TOKENIZERS:
        raise ModelFormatError(
            f"unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: {', '.join(PRE_TOKENIZERS)}")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ModelFormatError("GGUF tokenizer has no tokens (tokenizer.ggml.tokens)")
    merges = _field(reader, "tokenizer.ggml.merges")
    if model == "gpt2" and not merges:
        raise ModelFormatError("GGUF tokenizer has no merges (tokenizer.ggml.merges)")
    # llama.cpp reads the first n_tokens scores and token types and refuses only shorter arrays; the rest
    # of a longer one is never used, so it is dropped here too.
    scores = _field(reader, "tokenizer.ggml.scores")
    if scores is not None:
        scores = scores[:len(tokens)]
    if model == "llama" and (scores is None or len(scores) != len(tokens)):
        raise ModelFormatError(f"GGUF sentencepiece tokenizer needs one score per token (tokenizer.ggml.scores): "
                               f"{len(tokens)} tokens, {0 if scores is None else len(scores)} scores")
    types = _field(reader, "tokenizer.ggml.token_type")
    if types is None:
        types = [int(_TT.NORMAL)] * len(tokens)
    types = types[:len(tokens)]
    if len(types) != len(tokens):
        raise ModelFormatError(
            f"GGUF tokenizer has {len(tokens)} tokens but {len(types)} token types")

    def token_id(key: str) -> int | None:
        # An absent id stays None. (llama.cpp falls back to GPT-2's id 11 for
        # gpt2 vocabularies, which names an arbitrary token in any other vocabulary.)
        # An id outside the vocabulary is what a converter that cut the vocabulary leaves (an OLMoE
        # file cut to 2048 tokens keeps eos 50279): llama.cpp warns "bad special token ... using default
        # id" and runs the file, and so do we, taking the key as absent. Ends of generation still come
        # from the vocabulary's own texts (EOG_TEXTS), as llama.cpp finds them.
        v = _field(reader, f"tokenizer.ggml.{key}")
        if v is None:
            return None
        if not 0 <= int(v) < len(tokens):
            warn_once(f"tokenizer.ggml.{key} = {v} is outside the vocabulary of {len(tokens)}: ignored, as "
                      f"llama.cpp ignores it")
            return None
        return int(v)

    # llama.cpp's defaults when the keys are absent: sentencepiece vocabularies add BOS
    # and a space prefix; byte-level BPE ones neither.
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token")
    space_prefix = _field(reader, "tokenizer.ggml.add_space_prefix")
    return TokenizerSpec(
        tokens=list(tokens), token_types=llamacpp_token_types(tokens, types), merges=list(merges or []),
        bos_id=token_id("bos_token_id"), eos_id=token_id("eos_token_id"),
        eot_id=token_id("eot_token_id"), eom_id=token_id("eom_token_id"),
        pad_id=token_id("padding_token_id"),
        add_bos=bool(add_bos) if add_bos is not None else (model == "llama" or (
            model == "gpt2" and PRE_TOKENIZERS[pre].add_bos)),
        chat_template=_field(reader, "tokenizer.chat_template"),
        model=model, pre=pre, scores=None if scores is None else [float(x) for x in scores],
        add_space_prefix=bool(space_prefix) if space_prefix is not None else True,
        unk_id=token_id("unknown_token_id"),
    )


def check_vocabulary(spec: TokenizerSpec) -> None:
    """Refuse what the ``tokenizers`` library would take silently: tokens and merges that are not
    UTF-8 text (the header keeps such bytes as lone surrogates), and a byte-level vocabulary without a
    token for each of the 256 bytes (text with a missing byte would lose it: llama.cpp fails on it)."""
    for key, texts in (("tokenizer.ggml.tokens", spec.tokens), ("tokenizer.ggml.merges", spec.merges)):
        try:
            "".join(texts).encode("utf-8")
        except UnicodeEncodeError:
            i = next(i for i, t in enumerate(texts) if not _is_utf8(t))
            raise ModelFormatError(f"{key}[{i}] is not UTF-8 text: {texts[i][:40]!r}") from None
    if spec.model != "gpt2":
        return  # sentencepiece-style vocabularies carry bytes as <0xNN> tokens (byte fallback)
    missing = sorted(set(_gpt2_byte_decoder()) - set(spec.tokens))
    if missing:
        raise ModelFormatError(f"tokenizer.ggml.tokens lacks {len(missing)} of the 256 byte-level tokens "
                               f"(e.g. {missing[0]!r}): text with those bytes could not be tokenized")


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _end_is_user_defined(tokens: Sequence[str]) -> bool:
    present = set(tokens)
    return "<|end|>" in present and any(a in present and b in present for a, b in END_IS_NOT_EOG)


def llamacpp_token_types(tokens: Sequence[str], types: Sequence[int]) -> list[int]:
    """The token types llama.cpp uses after its fixes by token text at load: end-of-generation
    texts become control tokens, harmony markers (and ``<|end|>`` where END_IS_NOT_EOG says)
    user-defined ones."""
    out = [int(t) for t in types]
    end_user = _end_is_user_defined(tokens)
    for i, text in enumerate(tokens):
        if text in HARMONY_MARKERS or (end_user and text == "<|end|>"):
            out[i] = int(_TT.USER_DEFINED)
        elif text in EOG_TEXTS:
            out[i] = int(_TT.CONTROL)
    return out


def _split_merge(merge: str) -> tuple[str, str]:
    """Split a GGUF merge "left right" at its first space after position 0, as llama.cpp does."""
    i = merge.find(" ", 1)
    if i < 0:
        raise ModelFormatError(f"malformed BPE merge {merge!r} in tokenizer.ggml.merges")
    return merge[:i], merge[i + 1:]


def _bpe_model(spec: TokenizerSpec) -> HFTokenizer:
    """Byte-level BPE after the pre-tokenizer's split regexes (llama.cpp's gpt2 vocabulary)."""
    vocab = {t: i for i, t in enumerate(spec.tokens)}
    merges = [_split_merge(m) for m in spec.merges]
    pre = PRE_TOKENIZERS[spec.pre]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                 ignore_merges=pre.ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        *(pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in pre.regexes),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def spm_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Merges that reproduce llama.cpp's sentencepiece BPE: two adjacent pieces merge when their
    concatenation is a token, the highest-scoring such token first.

    Every way of cutting a token into two tokens is a merge, ranked by the score
    of the token it makes (then by id, then by where the cut is).
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, (text, score) in enumerate(zip(tokens, scores)):
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _spm_model(spec: TokenizerSpec) -> HFTokenizer:
    """Sentencepiece-style BPE with byte fallback (llama.cpp's llama vocabulary)."""
    assert spec.scores is not None
    unk = spec.unk_id if spec.unk_id is not None else next(
        (i for i, ty in enumerate(spec.token_types) if ty == _TT.UNKNOWN), None)
    tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(spec.tokens)},
                                 merges=spm_merges(spec.tokens, spec.scores), byte_fallback=True,
                                 fuse_unk=True, unk_token=None if unk is None else spec.tokens[unk]))
    # Normalizers run on each piece of text between special tokens: each gets its own ▁ prefix.
    escape = normalizers.Replace(" ", "▁")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), escape]) if spec.add_space_prefix else escape
    return tok


def build_hf_tokenizer(spec: TokenizerSpec) -> HFTokenizer:
    """The ``tokenizers`` pipeline equivalent to llama.cpp's tokenizer for ``spec``."""
    tok = _spm_model(spec) if spec.model == "llama" else _bpe_model(spec)
    # Added tokens are cut out of the text before the regex runs, like llama.cpp's
    # special-token partition. Control and unknown tokens are "special" so that
    # encode_special_tokens can turn them off; user-defined ones always match.
    special = [t for t, ty in zip(spec.tokens, spec.token_types) if ty in (_TT.CONTROL, _TT.UNKNOWN)]
    user = [t for t, ty in zip(spec.tokens, spec.token_types) if ty == _TT.USER_DEFINED]
    if special:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tok


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: printable stand-in character -> the byte it stands for."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in kept}
    shifted = 0
    for b in range(256):
        if b not in kept:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def _byte_level_translation() -> dict[int, int]:
    """str.translate table: stand-in character -> its byte as a code point; any other
    character below 256 -> a code point above 255, so that latin-1 encoding rejects it."""
    table = {ord(c): b for c, b in _gpt2_byte_decoder().items()}
    for cp in range(256):
        table.setdefault(cp, 0xFFFF)
    return table


_SPECIAL_TYPES = frozenset({int(_TT.CONTROL), int(_TT.UNKNOWN), int(_TT.UNUSED)})


def _byte_level_piece(text: str, table: Mapping[int, int]) -> bytes:
    """A gpt2 vocabulary's normal token: its stand-in characters back to bytes."""
    try:
        return text.translate(table).encode("latin-1")
    except UnicodeEncodeError:
        return text.encode("utf-8")  # not byte-level text: keep it as written, like llama.cpp


def _spm_piece(text: str, ty: int) -> bytes:
    """A llama vocabulary's token: ``<0xNN>`` byte tokens are their byte, ▁ is a space."""
    if ty == _TT.BYTE:
        if not (len(text) == 6 and text.startswith("<0x") and text.endswith(">")):
            raise ModelFormatError(f"tokenizer.ggml.tokens: byte token {text[:40]!r} is not of the form <0xNN>")
        try:
            return bytes([int(text[3:5], 16)])
        except ValueError:
            raise ModelFormatError(f"tokenizer.ggml.tokens: byte token {text!r} is not of the form <0xNN>") from None
    return text.replace("▁", " ").encode("utf-8")


def token_piece(spec: TokenizerSpec, token_id: int, translation: Mapping[int, int]) -> bytes:
    """The raw bytes one token stands for (``translation``: :func:`_byte_level_translation`)."""
    text, ty = spec.tokens[token_id], spec.token_types[token_id]
    if spec.model == "llama" and ty in (_TT.NORMAL, _TT.BYTE):
        return _spm_piece(text, ty)
    if spec.model == "gpt2" and ty == _TT.NORMAL:
        return _byte_level_piece(text, translation)
    return text.encode("utf-8")  # control, unknown and user-defined tokens are stored as plain text


def eog_ids(spec: TokenizerSpec) -> frozenset[int]:
    """llama.cpp's end-of-generation set: eos, eot, eom and the known end-of-turn texts."""
    ids = {i for i, t in enumerate(spec.tokens) if t in EOG_TEXTS}
    if _end_is_user_defined(spec.tokens):
        ids -= {i for i, t in enumerate(spec.tokens) if t == "<|end|>"}
    ids.update(i for i in (spec.eos_id, spec.eot_id, spec.eom_id) if i is not None)
    return frozenset(ids)


class Tokenizer:
    """Tokenizer (byte-level BPE or sentencepiece-style) and chat template of one GGUF model."""

    def __init__(self, spec: TokenizerSpec, origin: str = "", hf: HFTokenizer | None = None) -> None:
        """``origin``: the model file, named in messages; ``hf``: the pipeline :func:`build_hf_tokenizer`
        makes of ``spec``, built earlier (a cache); None: build it."""
        self.spec = spec
        self.origin = origin
        self._hf = hf if hf is not None else build_hf_tokenizer(spec)
        # encode_special_tokens is a flag on the shared object; flip it under a lock.
        self._lock = threading.Lock()
        # Token bytes are worked out when a token is first decoded: for 152k tokens up front
        # that took as long as building the BPE itself.
        self._translation = _byte_level_translation()
        self._pieces: dict[int, bytes] = {}
        if spec.model == "llama":  # a malformed <0xNN> token is refused now, not when it is first decoded
            for i in np.flatnonzero(np.asarray(spec.token_types) == _TT.BYTE):
                self.token_bytes(int(i))
        self._eog = eog_ids(spec)
        self._template: ChatTemplate | None = None

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader | GGUFHeader | ModelHeader,
                  pipeline: Callable[[TokenizerSpec], HFTokenizer] | None = None) -> Tokenizer:
        """Build from an open GGUF; a missing, unsupported or broken tokenizer is one
        ModelFormatError that names the file. ``pipeline(spec)``: the ``tokenizers`` pipeline of a
        checked spec from elsewhere (a cache); None: build it."""
        origin = os.fspath(getattr(reader, "path", "") or "")
        where = f"{origin}: " if origin else ""
        try:
            spec = read_spec(reader)
            check_vocabulary(spec)
            return cls(spec, origin, None if pipeline is None else pipeline(spec))
        except ModelFormatError as exc:
            raise ModelFormatError(f"{where}{exc}") from None
        except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exception on a bad vocabulary
            kind = "" if type(exc) is Exception else f"{type(exc).__name__}: "
            raise ModelFormatError(f"{where}the tokenizer cannot be built from its tokenizer.ggml.* keys: "
                                   f"{kind}{' '.join(str(exc).split())[:300]}") from exc

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """Build from a GGUF file on disk."""
        if not Path(path).is_file():
            raise UserError(f"{path}: no such file")
        return cls.from_gguf(open_header(path))  # refuses a bad magic, a truncated header, a later part

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special ones included."""
        return len(self.spec.tokens)

    @property
    def bos_id(self) -> int | None:
        """Beginning-of-sequence id, or None when the model has none."""
        return self.spec.bos_id

    @property
    def eos_id(self) -> int | None:
        """End-of-sequence id, or None when the model has none."""
        return self.spec.eos_id

    @property
    def add_bos(self) -> bool:
        """Whether prompts should start with the BOS token (``tokenizer.ggml.add_bos_token``)."""
        return self.spec.add_bos and self.spec.bos_id is not None

    @property
    def eog_ids(self) -> frozenset[int]:
        """Every id that ends generation."""
        return self._eog

    def is_eog(self, token_id: int) -> bool:
        """True when ``token_id`` ends generation (eos, <|im_end|>, <|endoftext|> ...)."""
        return token_id in self._eog

    def encode(self, text: str, *, parse_special: bool = True, add_special: bool = False) -> list[int]:
        """Token ids of ``text``.

        ``parse_special``: control-token text such as ``<|im_start|>`` becomes its one
        id; off, it is tokenized as ordinary characters. ``add_special``: prepend BOS
        when the model asks for it (llama.cpp's ``add_special``).
        """
        with self._lock:
            self._hf.encode_special_tokens = not parse_special
            ids = self._hf.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos:
            ids = [self.spec.bos_id, *ids]
        return ids

    def token_bytes(self, token_id: int, *, skip_special: bool = False) -> bytes:
        """The raw bytes one token stands for (possibly part of a UTF-8 character)."""
        if skip_special and self.spec.token_types[token_id] in _SPECIAL_TYPES:
            return b""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = token_piece(self.spec, token_id, self._translation)
        return piece

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 (a cut multi-byte character) becomes U+FFFD."""
        data = b"".join(self.token_bytes(i, skip_special=skip_special) for i in ids)
        return data.decode("utf-8", errors="replace")

    def stream_decoder(self, *, skip_special: bool = False) -> StreamDecoder:
        """A fresh incremental detokenizer for one generated sequence."""
        return StreamDecoder(self, skip_special=skip_special)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """Render ``messages`` with the model's ``tokenizer.chat_template``.

        ``extra`` reaches the template as variables (e.g. ``enable_thinking``, ``tools``).
        """
        where = f"{self.origin}: " if self.origin else ""
        if self.spec.chat_template is None:
            raise UserError(f"{where}this model has no chat template (tokenizer.chat_template); prompt it without chat")
        if self._template is None:
            self._template = ChatTemplate(self.spec.chat_template, self.origin)  # refuses one that does not compile
        special = {}
        for name, i in (("bos_token", self.spec.bos_id), ("eos_token", self.spec.eos_id),
                        ("pad_token", self.spec.pad_id)):
            special[name] = self.spec.tokens[i] if i is not None else ""
        return self._template.render({"messages": list(messages), "add_generation_prompt": add_generation_prompt,
                                      **special, **extra})


class StreamDecoder:
    """Turns generated ids, one at a time, into text as soon as it is complete.

    Byte-level BPE can split one UTF-8 character over several tokens; the bytes
    of an unfinished character are held back until the rest arrives. The text
    emitted over a whole sequence, plus :meth:`flush`, equals ``decode(ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (may be empty)."""
        return self._utf8.decode(self._tok.token_bytes(token_id, skip_special=self._skip_special))

    def flush(self) -> str:
        """End of sequence: release held-back bytes (as U+FFFD if they never completed)."""
        return self._utf8.decode(b"", final=True)
