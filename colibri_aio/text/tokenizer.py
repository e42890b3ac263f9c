"""Tokenizer and chat template, read from a GGUF's ``tokenizer.*`` metadata.

Only the byte-level BPE family that Qwen models use is supported:
``tokenizer.ggml.model == "gpt2"`` with ``tokenizer.ggml.pre == "qwen2"``.
The BPE itself runs in the ``tokenizers`` library (vocab + merges from the
file, Qwen2's split regex, GPT-2 byte mapping); this module only translates
the GGUF metadata into that pipeline and mirrors llama.cpp's choices where
they matter for ids:

* control tokens (``<|im_start|>`` ...) are matched in the text only when
  ``parse_special`` is on; user-defined tokens are matched always;
* end of generation is eos/eot/eom plus the tokens llama.cpp recognises by
  their text (``<|im_end|>``, ``<|endoftext|>`` ...).

Decoding goes through one byte table (token id -> raw bytes) so that the
one-shot :meth:`Tokenizer.decode` and the streaming :class:`StreamDecoder`
cannot disagree.
"""
from __future__ import annotations

import codecs
import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import gguf
from jinja2 import TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from colibri_aio.gguf.header import GGUFHeader
from colibri_aio.errors import ModelFormatError, UserError

__all__ = ["Tokenizer", "StreamDecoder", "TokenizerSpec", "QWEN2_SPLIT_REGEX"]

# Qwen2's pre-tokenizer split pattern: the one in Qwen's tokenizer.json and in
# llama.cpp for LLAMA_VOCAB_PRE_TYPE_QWEN2 (note \p{N} alone: digits split one by one).
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

SUPPORTED_MODELS = ("gpt2",)
SUPPORTED_PRE = ("qwen2",)

# Token texts llama.cpp puts in its end-of-generation set whatever their ids.
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
    "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
})

_TT = gguf.TokenType


@dataclass(frozen=True)
class TokenizerSpec:
    """The tokenizer as the GGUF describes it, before any library object is built."""

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


def _field(reader: gguf.GGUFReader | GGUFHeader, key: str) -> Any:
    """The decoded value of a metadata key, or None when the key is absent."""
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def read_spec(reader: gguf.GGUFReader | GGUFHeader) -> TokenizerSpec:
    """Read and check the ``tokenizer.*`` keys; refuse anything we cannot tokenize exactly."""
    model = _field(reader, "tokenizer.ggml.model")
    if model is None:
        raise ModelFormatError("GGUF has no tokenizer (tokenizer.ggml.model is missing)")
    if model not in SUPPORTED_MODELS:
        raise ModelFormatError(
            f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); supported: {', '.join(SUPPORTED_MODELS)}")
    pre = _field(reader, "tokenizer.ggml.pre")
    if pre not in SUPPORTED_PRE:
        raise ModelFormatError(
            f"unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: {', '.join(SUPPORTED_PRE)}")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ModelFormatError("GGUF tokenizer has no tokens (tokenizer.ggml.tokens)")
    merges = _field(reader, "tokenizer.ggml.merges")
    if not merges:
        raise ModelFormatError("GGUF tokenizer has no merges (tokenizer.ggml.merges)")
    types = _field(reader, "tokenizer.ggml.token_type")
    if types is None:
        types = [int(_TT.NORMAL)] * len(tokens)
    if len(types) != len(tokens):
        raise ModelFormatError(
            f"GGUF tokenizer has {len(tokens)} tokens but {len(types)} token types")

    def token_id(key: str) -> int | None:
        # An absent id stays None. (llama.cpp falls back to GPT-2's id 11 for
        # gpt2 vocabularies, which names an arbitrary token in any other vocabulary.)
        v = _field(reader, f"tokenizer.ggml.{key}")
        if v is None:
            return None
        if not 0 <= int(v) < len(tokens):
            raise ModelFormatError(f"tokenizer.ggml.{key} = {v} is outside the vocabulary of {len(tokens)}")
        return int(v)

    add_bos = _field(reader, "tokenizer.ggml.add_bos_token")
    return TokenizerSpec(
        tokens=list(tokens), token_types=[int(t) for t in types], merges=list(merges),
        bos_id=token_id("bos_token_id"), eos_id=token_id("eos_token_id"),
        eot_id=token_id("eot_token_id"), eom_id=token_id("eom_token_id"),
        pad_id=token_id("padding_token_id"),
        add_bos=bool(add_bos) if add_bos is not None else False,
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def _split_merge(merge: str) -> tuple[str, str]:
    """Split a GGUF merge "left right" at its first space after position 0, as llama.cpp does."""
    i = merge.find(" ", 1)
    if i < 0:
        raise ModelFormatError(f"malformed BPE merge {merge!r} in tokenizer.ggml.merges")
    return merge[:i], merge[i + 1:]


def build_hf_tokenizer(spec: TokenizerSpec) -> HFTokenizer:
    """The ``tokenizers`` pipeline equivalent to llama.cpp's gpt2/qwen2 tokenizer for ``spec``."""
    vocab = {t: i for i, t in enumerate(spec.tokens)}
    merges = [_split_merge(m) for m in spec.merges]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # Added tokens are cut out of the text before the regex runs, like llama.cpp's
    # special-token partition. Control tokens are "special" so that
    # encode_special_tokens can turn them off; user-defined ones always match.
    control = [t for t, ty in zip(spec.tokens, spec.token_types) if ty == _TT.CONTROL]
    user = [t for t, ty in zip(spec.tokens, spec.token_types) if ty == _TT.USER_DEFINED]
    if control:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
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


def token_piece(text: str, token_type: int, translation: Mapping[int, int]) -> bytes:
    """The raw bytes one token stands for, from its vocabulary text (``translation``: :func:`_byte_level_translation`)."""
    if token_type == _TT.NORMAL:
        try:
            return text.translate(translation).encode("latin-1")
        except UnicodeEncodeError:
            pass  # not byte-level text: keep it as written, like llama.cpp
    # Control and user-defined tokens are stored as plain text, not byte-mapped.
    return text.encode("utf-8")


def eog_ids(spec: TokenizerSpec) -> frozenset[int]:
    """llama.cpp's end-of-generation set: eos, eot, eom and the known end-of-turn texts."""
    ids = {i for i in (spec.eos_id, spec.eot_id, spec.eom_id) if i is not None}
    ids.update(i for i, t in enumerate(spec.tokens) if t in EOG_TEXTS)
    return frozenset(ids)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes; chat templates want the plain JSON text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class GenerationTag(Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` and renders the body unchanged.

    Templates written for training mark the assistant's text with this tag
    (Hugging Face uses it to build loss masks); for inference it is a no-op.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def make_template_environment() -> ImmutableSandboxedEnvironment:
    """A sandboxed Jinja environment with the helpers Hugging Face chat templates expect."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class Tokenizer:
    """Byte-level BPE tokenizer and chat template of one GGUF model."""

    def __init__(self, spec: TokenizerSpec, hf: HFTokenizer | None = None) -> None:
        """``hf``: the pipeline :func:`build_hf_tokenizer` makes of ``spec``, built earlier (a cache); None: build it."""
        self.spec = spec
        self._hf = hf if hf is not None else build_hf_tokenizer(spec)
        # encode_special_tokens is a flag on the shared object; flip it under a lock.
        self._lock = threading.Lock()
        # Token bytes are worked out when a token is first decoded: for 152k tokens up front
        # that took as long as building the BPE itself.
        self._translation = _byte_level_translation()
        self._pieces: dict[int, bytes] = {}
        self._eog = eog_ids(spec)
        self._template = None

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader | GGUFHeader) -> Tokenizer:
        """Build from an open GGUF; raises ModelFormatError for a missing or unsupported tokenizer."""
        return cls(read_spec(reader))

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """Build from a GGUF file on disk."""
        if not Path(path).is_file():
            raise UserError(f"{path}: no such file")
        return cls.from_gguf(GGUFHeader(path))  # refuses a bad magic or a truncated header

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
            piece = self._pieces[token_id] = token_piece(self.spec.tokens[token_id], self.spec.token_types[token_id],
                                                         self._translation)
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
        if self.spec.chat_template is None:
            raise UserError("this model has no chat template (tokenizer.chat_template); prompt it without chat")
        if self._template is None:
            self._template = make_template_environment().from_string(self.spec.chat_template)
        special = {}
        for name, i in (("bos_token", self.spec.bos_id), ("eos_token", self.spec.eos_id),
                        ("pad_token", self.spec.pad_id)):
            special[name] = self.spec.tokens[i] if i is not None else ""
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         **special, **extra)
        except TemplateError as e:
            raise UserError(f"chat template failed: {e}") from None


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
