"""Constrained decoding: a grammar that masks every pick, so the output parses (and validates) every time.

:class:`Grammars` indexes a model's vocabulary once (llguidance's token
trie: each token's bytes, special and control tokens flagged special so a
grammar can name them, e.g. ``<|call|>``, and the model's end-of-generation
tokens). From it, each request compiles a :class:`GrammarConstraint`:

* :meth:`Grammars.json_schema`: OpenAI's ``response_format``. ``None`` is
  ``json_object`` (any JSON object); a schema is ``json_schema``, with
  ``strict`` deciding what a keyword the grammar cannot enforce does: refused
  (:class:`GrammarError`) when strict, ignored otherwise;
* :meth:`Grammars.lark`: llguidance's Lark dialect (``%json{...}`` embeds a
  schema, :func:`lark_json` writes one; ``<|call|>`` names a special token),
  for forced tool calls.

The constraint implements :class:`~colibri_aio.text.sampling.TokenConstraint`:
:class:`~colibri_aio.text.sampling.TokenPicker` masks the logits after bias
and penalties, and the model's logits themselves are never touched (logprobs
stay the model's). Once the grammar is complete (:attr:`done`), the mask
allows exactly the end-of-generation tokens, so the reply ends.

JSON is written compactly with ``", "`` and ``": "`` between items and keys
and no other whitespace: a model cannot wander into endless whitespace, and
the text reads like ``json.dumps``. A schema bounds the length of the
output only when its strings, arrays, objects and numbers are bounded
(``maxLength``, ``maxItems``, ``additionalProperties: false``, a fractional
number's ``multipleOf``); an unbounded one may run into the token budget.
A budget too small for the JSON ends the reply with ``finish_reason``
"length" and text that is not valid JSON, as OpenAI's does.

Cost: the mask is llguidance's bitmask computed in Rust into a preallocated
buffer, unpacked and applied with NumPy (no Python loop over the vocabulary);
``tools/bench_grammar.py`` measures it against a decode step (receipt
``evidence/grammar_*``). llguidance was chosen by that receipt.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np

from colibri_aio.errors import UserError
from colibri_aio.text.tokenizer import Tokenizer

__all__ = ["GrammarError", "Grammars", "GrammarConstraint", "JSON_OPTIONS", "lark_json"]

# How the JSON is spelled between tokens: fixed separators, no free whitespace (see the module's docstring).
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_NORMAL, _USER_DEFINED, _BYTE = 1, 4, 6   # gguf.TokenType values that stand for text
_SPECIAL_MARK = b"\xff"   # llguidance's prefix for a token a grammar names as <|...|>, never as text


def lark_json(schema: Mapping[str, Any]) -> str:
    """``%json{...}``: a Lark rule body matching JSON valid under ``schema``, spelled as :meth:`Grammars.json_schema`
    spells it (fixed separators, no free whitespace; a bare ``%json`` would allow whitespace without end).
    The schema's own ``x-guidance`` options win."""
    options = {**JSON_OPTIONS, **schema.get("x-guidance", {})}
    return "%json" + json.dumps({**schema, "x-guidance": options})


# What a forbidden (0) and an allowed (1) token add to its logit, per logits dtype.
_PENALTY: dict[np.dtype, np.ndarray] = {}


def _penalty(dtype: np.dtype) -> np.ndarray:
    table = _PENALTY.get(dtype)
    if table is None:
        table = _PENALTY[dtype] = np.array([-np.inf, 0.0], dtype=dtype)
    return table


class GrammarError(UserError):
    """A JSON schema or grammar that cannot be compiled into a token mask (one line naming the problem)."""


class _VocabWrapper:
    """The shape llguidance's ``TokenizerWrapper`` reads: token bytes, special ids, EOS, a text tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(tokenizer.eog_ids)
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = [i for i in range(tokenizer.vocab_size) if is_special(tokenizer, i)]
        special = set(self.special_token_ids)
        self.tokens = [_SPECIAL_MARK + tokenizer.token_bytes(i) if i in special else tokenizer.token_bytes(i)
                       for i in range(tokenizer.vocab_size)]
        self._by_bytes: dict[bytes, int] | None = None   # plain tokens by their bytes, built when first needed

    def __call__(self, text: bytes | str) -> list[int]:
        """Token ids of ``text`` as plain text (special-token text is not parsed), spelling exactly its bytes.

        A sentencepiece tokenizer that prepends a space to its input (``add_space_prefix``) would make the
        grammar force a space nobody asked for: that space comes off the first token again (its rest spelled
        by the longest tokens that fit)."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        ids = self._tokenizer.encode(text, parse_special=False)
        data = text.encode()
        if not ids or b"".join(self._tokenizer.token_bytes(i) for i in ids) == data:
            return ids
        first = self._tokenizer.token_bytes(ids[0])
        if first.startswith(b" "):
            fixed = self._longest_first(first[1:]) + ids[1:]
            if b"".join(self._tokenizer.token_bytes(i) for i in fixed) == data:
                return fixed
        return self._longest_first(data)

    def _longest_first(self, data: bytes) -> list[int]:
        """``data`` spelled greedily by the longest plain tokens (bytes every vocabulary with byte fallback has)."""
        if self._by_bytes is None:
            self._by_bytes = {}
            for i, raw in enumerate(self.tokens):
                if raw and not raw.startswith(_SPECIAL_MARK):
                    self._by_bytes.setdefault(raw, i)
        out, at, longest = [], 0, max(map(len, self._by_bytes))
        while at < len(data):
            for n in range(min(longest, len(data) - at), 0, -1):
                token = self._by_bytes.get(data[at:at + n])
                if token is not None:
                    out.append(token)
                    at += n
                    break
            else:
                raise GrammarError(f"the vocabulary cannot spell the byte {data[at]:#04x}")
        return out


def is_special(tokenizer: Tokenizer, token_id: int) -> bool:
    """Whether a token is a marker, not text: control, unknown and unused tokens, and user-defined ones that look
    like ``<...>`` (``<tool_call>``), as llama.cpp's llguidance binding decides."""
    kind = tokenizer.spec.token_types[token_id]
    if kind in (_NORMAL, _BYTE):
        return False
    if kind == _USER_DEFINED:
        text = tokenizer.spec.tokens[token_id]
        return text.startswith("<") and text.endswith(">")
    return True


class Grammars:
    """Compiles grammars against one model's vocabulary; build it once per model (it indexes every token)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        if not tokenizer.eog_ids:
            raise GrammarError(f"{tokenizer.origin or 'this model'}: the tokenizer has no end-of-generation token; "
                               "a constrained reply could not end")
        self.tokenizer = tokenizer
        self.eog_ids = sorted(tokenizer.eog_ids)
        vocab = _VocabWrapper(tokenizer)
        # The marker tokens by their text: a grammar names these ids rather than spelling their text.
        self.special_tokens = {tokenizer.spec.tokens[i]: i for i in vocab.special_token_ids}
        self.ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab),
                                         eos_token=self.eog_ids)

    def json_schema(self, schema: Mapping[str, Any] | None, *, strict: bool = True) -> GrammarConstraint:
        """A constraint whose output is JSON valid under ``schema`` (``None``: any JSON object).

        ``strict``: a keyword the grammar cannot enforce is a :class:`GrammarError`; not strict, it is ignored
        (the output follows the rest of the schema).
        """
        if schema is None:
            schema = {"type": "object"}
        if not isinstance(schema, Mapping):
            raise GrammarError(f"response_format: the JSON schema must be an object, got {type(schema).__name__}")
        options = {**JSON_OPTIONS, "lenient": not strict}
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)
        except (TypeError, ValueError) as exc:
            raise GrammarError(f"response_format: the JSON schema cannot be compiled: {_line(exc)}") from None
        return self._compile(grammar, "response_format: the JSON schema cannot be compiled")

    def lark(self, grammar: str) -> GrammarConstraint:
        """A constraint from a grammar in llguidance's Lark dialect (``%json{...}`` embeds a JSON schema: write
        it with :func:`lark_json`; ``<|name|>`` names a special token); the rule ``start`` is the whole output.

        A forced tool call, for example::

            start: <|im_start|> "get_weather " args
            args: %json{"type": "object", ...}
        """
        return self._compile(llguidance.LLMatcher.grammar_from_lark(grammar), "the grammar cannot be compiled")

    def _compile(self, grammar: str, what: str) -> GrammarConstraint:
        matcher = llguidance.LLMatcher(self.ll, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{what}: {_line(matcher.get_error())}")
        return GrammarConstraint(matcher, self.ll.vocab_size, self.eog_ids)


class GrammarConstraint:
    """One generation's grammar state: a :class:`~colibri_aio.text.sampling.TokenConstraint`."""

    def __init__(self, matcher: llguidance.LLMatcher, n_tokens: int, eog_ids: list[int]) -> None:
        self._matcher = matcher
        self._n = n_tokens
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, n_tokens)
        self._eog = np.asarray(eog_ids, dtype=np.int64)

    @property
    def done(self) -> bool:
        """The grammar is complete: only an end-of-generation token may follow."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    def allowed(self) -> np.ndarray:
        """A bool per token of the vocabulary: may it come next?"""
        return self.allowed_bits().view(bool)

    def allowed_bits(self) -> np.ndarray:
        """A uint8 per token of the vocabulary: 1 if it may come next, else 0."""
        if self._matcher.is_stopped():
            bits = np.zeros(self._n, dtype=np.uint8)
            bits[self._eog] = 1
            return bits
        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._bitmask)
        if self._matcher.is_error():
            raise RuntimeError(f"grammar: {_line(self._matcher.get_error())}")
        return np.unpackbits(self._bitmask[0].view(np.uint8), bitorder="little", count=self._n)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` with every token the grammar forbids next at -inf (a new array; ``logits`` is kept).

        Logit rows past the tokenizer's vocabulary (a model's padding) are always forbidden.
        """
        # Adding 0 or -inf looked up per token: one gather and one add, the same cost whatever the mask holds
        # (a masked copy, np.copyto(where=), ran 2.5x slower on a mask of scattered bits).
        penalty = _penalty(logits.dtype)
        n = self._n
        if logits.shape[-1] == n:
            return logits + penalty[self.allowed_bits()]
        out = np.full_like(logits, -np.inf)
        k = min(n, logits.shape[-1])
        out[:k] = logits[:k] + penalty[self.allowed_bits()[:k]]
        return out

    def accept(self, token_id: int) -> None:
        """Advance the grammar past ``token_id`` (one the last mask allowed)."""
        if not self._matcher.consume_token(int(token_id)):
            raise RuntimeError(f"grammar: token {token_id} is not allowed here: {_line(self._matcher.get_error())}")


def _line(message: object) -> str:
    """A library's message (often several lines, with a caret under the fault) as one line."""
    return " ".join(str(message).split())
