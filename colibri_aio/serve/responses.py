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
from typing import TYPE_CHECKING, Any

from colibri_aio.engine.engine import GenerationPiece
from colibri_aio.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from colibri_aio.text.replies import ReplyDelta, ReplyParser, ToolCall


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


def tool_call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """OpenAI's ``tool_calls`` entry (with ``index`` in a stream's delta)."""
    out: dict[str, Any] = {} if index is None else {"index": index}
    out.update({"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}})
    return out


class ChatShape(_Shape):
    """``chat.completion`` objects; with a ``parser``, the reply's text is split into ``reasoning_content``,
    ``content`` and ``tool_calls`` (``finish_reason`` "tool_calls" when the model called one)."""

    object, chunk_object, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def __init__(self, model: str, tokenizer: Tokenizer, parser: ReplyParser | None = None) -> None:
        super().__init__(model, tokenizer)
        self.parser = parser
        self._calls = 0  # tool calls streamed so far: the next one's index

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

    def _finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self._calls else reason

    def response(self, pieces: Sequence[GenerationPiece], with_logprobs: bool) -> dict[str, Any]:
        last = pieces[-1]
        text = "".join(p.text for p in pieces)
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if self.parser is not None:
            self.parser.feed(text)
            self.parser.finish()
            reply = self.parser.reply
            self._calls = len(reply.tool_calls)
            message["content"] = reply.content if reply.content or not reply.tool_calls else None
            if reply.reasoning:
                message["reasoning_content"] = reply.reasoning
            if reply.tool_calls:
                message["tool_calls"] = [tool_call_json(c) for c in reply.tool_calls]
        choice = {"index": 0, "message": message, "logprobs": self.logprobs(pieces) if with_logprobs else None,
                  "finish_reason": self._finish_reason(last.finish_reason), "stop_reason": last.stop}
        return self._envelope(self.object, [choice], usage=usage(last))

    def first_chunk(self, include_usage: bool) -> dict[str, Any]:
        """The assistant role, before any content (as OpenAI's stream starts)."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._envelope(self.chunk_object, [choice], **({"usage": None} if include_usage else {}))

    def chunk(self, piece: GenerationPiece, with_logprobs: bool, include_usage: bool) -> dict[str, Any] | None:
        """The chunk of one piece; None when it carries nothing to send."""
        lp = self.logprobs([piece]) if with_logprobs else None
        delta = self._delta(piece)
        if not delta and not piece.finish_reason and not (lp and lp["content"]):
            return None
        choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": self._finish_reason(piece.finish_reason),
                  **({"stop_reason": piece.stop} if piece.finish_reason else {})}
        return self._envelope(self.chunk_object, [choice], **({"usage": None} if include_usage else {}))

    def _delta(self, piece: GenerationPiece) -> dict[str, Any]:
        if self.parser is None:
            return {"content": piece.text} if piece.text else {}
        parsed = self.parser.feed(piece.text)
        if piece.finish_reason is not None:
            parsed = _joined(parsed, self.parser.finish())
        delta: dict[str, Any] = {}
        if parsed.reasoning:
            delta["reasoning_content"] = parsed.reasoning
        if parsed.content:
            delta["content"] = parsed.content
        if parsed.tool_calls:
            delta["tool_calls"] = [tool_call_json(c, self._calls + i) for i, c in enumerate(parsed.tool_calls)]
            self._calls += len(parsed.tool_calls)
        return delta


def _joined(a: ReplyDelta, b: ReplyDelta) -> ReplyDelta:
    from colibri_aio.text.replies import ReplyDelta

    return ReplyDelta(content=a.content + b.content, reasoning=a.reasoning + b.reasoning,
                      tool_calls=[*a.tool_calls, *b.tool_calls])


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
                  "logprobs": self.logprobs(pieces) if with_logprobs else None, "finish_reason": last.finish_reason,
                  "stop_reason": last.stop}
        return self._envelope(self.object, [choice], usage=usage(last))

    def first_chunk(self, include_usage: bool) -> None:
        return None  # completions streams start with text

    def chunk(self, piece: GenerationPiece, with_logprobs: bool, include_usage: bool) -> dict[str, Any] | None:
        lp = self.logprobs([piece], self._streamed) if with_logprobs else None
        if lp is not None:
            self._streamed += sum(len(t) for t in lp["tokens"])
        if not piece.text and not piece.finish_reason and not (lp and lp["tokens"]):
            return None
        choice = {"index": 0, "text": piece.text, "logprobs": lp, "finish_reason": piece.finish_reason,
                  **({"stop_reason": piece.stop} if piece.finish_reason else {})}
        return self._envelope(self.chunk_object, [choice], **({"usage": None} if include_usage else {}))
