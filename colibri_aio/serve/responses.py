"""OpenAI response bodies built from generation pieces: whole responses and stream chunks.

:class:`ChatShape` makes ``chat.completion`` / ``chat.completion.chunk``
objects, :class:`CompletionShape` ``text_completion`` ones. Both share the
id, ``created`` and ``model`` of one response, and the usage block with the
prompt tokens the KV cache already held (``prompt_tokens_details.cached_tokens``).
"""
from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Any

from colibri_aio.engine.engine import GenerationPiece
from colibri_aio.text.tokenizer import Tokenizer


def usage(last: GenerationPiece) -> dict[str, Any]:
    """The usage block of a finished generation (``last``: its final piece)."""
    return {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.generated_tokens,
            "total_tokens": last.prompt_tokens + last.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": last.cached_tokens}}


def scored(pieces: Sequence[GenerationPiece], tokenizer: Tokenizer) -> list[GenerationPiece]:
    """The pieces whose token is content: an end-of-generation token that ended the text is not."""
    return [p for p in pieces if p.logprob is not None and not (p.finish_reason and tokenizer.is_eog(p.token or 0))]


class _Shape:
    object: str
    prefix: str

    def __init__(self, model: str, tokenizer: Tokenizer) -> None:
        self.id = f"{self.prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.model, self.tokenizer = model, tokenizer

    def _envelope(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices, **extra}

    def _token(self, token: int) -> tuple[str, bytes]:
        raw = self.tokenizer.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), raw

    def usage_chunk(self, last: GenerationPiece) -> dict[str, Any]:
        """The extra last chunk of ``stream_options.include_usage``: no choices, the usage."""
        return self._envelope(self.chunk_object, [], usage=usage(last))

    chunk_object: str


class ChatShape(_Shape):
    object, chunk_object, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def logprobs(self, pieces: Sequence[GenerationPiece]) -> dict[str, Any]:
        content = []
        for p in scored(pieces, self.tokenizer):
            text, raw = self._token(p.token or 0)
            top = []
            for tid, lp in p.top_logprobs:
                t, b = self._token(tid)
                top.append({"token": t, "logprob": lp, "bytes": list(b)})
            content.append({"token": text, "logprob": p.logprob, "bytes": list(raw), "top_logprobs": top})
        return {"content": content, "refusal": None}

    def response(self, pieces: Sequence[GenerationPiece], with_logprobs: bool) -> dict[str, Any]:
        last = pieces[-1]
        choice = {"index": 0, "message": {"role": "assistant", "content": "".join(p.text for p in pieces),
                                          "refusal": None},
                  "logprobs": self.logprobs(pieces) if with_logprobs else None, "finish_reason": last.finish_reason}
        return self._envelope(self.object, [choice], usage=usage(last))

    def first_chunk(self, include_usage: bool) -> dict[str, Any]:
        """The assistant role, before any content (as OpenAI's stream starts)."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._envelope(self.chunk_object, [choice], **({"usage": None} if include_usage else {}))

    def chunk(self, piece: GenerationPiece, with_logprobs: bool, include_usage: bool) -> dict[str, Any] | None:
        """The chunk of one piece; None when it carries nothing to send."""
        lp = self.logprobs([piece]) if with_logprobs else None
        if not piece.text and not piece.finish_reason and not (lp and lp["content"]):
            return None
        choice = {"index": 0, "delta": {"content": piece.text} if piece.text else {},
                  "logprobs": lp, "finish_reason": piece.finish_reason}
        return self._envelope(self.chunk_object, [choice], **({"usage": None} if include_usage else {}))


class CompletionShape(_Shape):
    object, chunk_object, prefix = "text_completion", "text_completion", "cmpl"

    def __init__(self, model: str, tokenizer: Tokenizer) -> None:
        super().__init__(model, tokenizer)
        self._streamed = 0  # characters of token text sent so far: the next chunk's text_offset

    def logprobs(self, pieces: Sequence[GenerationPiece], offset: int = 0) -> dict[str, Any]:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for p in scored(pieces, self.tokenizer):
            text, _ = self._token(p.token or 0)
            tokens.append(text)
            token_logprobs.append(p.logprob)
            top.append({self._token(tid)[0]: lp for tid, lp in p.top_logprobs})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def response(self, pieces: Sequence[GenerationPiece], with_logprobs: bool) -> dict[str, Any]:
        last = pieces[-1]
        choice = {"index": 0, "text": "".join(p.text for p in pieces),
                  "logprobs": self.logprobs(pieces) if with_logprobs else None, "finish_reason": last.finish_reason}
        return self._envelope(self.object, [choice], usage=usage(last))

    def first_chunk(self, include_usage: bool) -> None:
        return None  # completions streams start with text

    def chunk(self, piece: GenerationPiece, with_logprobs: bool, include_usage: bool) -> dict[str, Any] | None:
        lp = self.logprobs([piece], self._streamed) if with_logprobs else None
        if lp is not None:
            self._streamed += sum(len(t) for t in lp["tokens"])
        if not piece.text and not piece.finish_reason and not (lp and lp["tokens"]):
            return None
        choice = {"index": 0, "text": piece.text, "logprobs": lp, "finish_reason": piece.finish_reason}
        return self._envelope(self.chunk_object, [choice], **({"usage": None} if include_usage else {}))
