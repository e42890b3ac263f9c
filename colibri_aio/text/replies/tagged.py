"""The streaming parser for replies whose parts are marked by tags: a thinking span (``<think>…</think>``) and
blocks of tool-call markup (``<tool_call>…</tool_call>`` and its kin). Each syntax module gives the markers
and a function that reads one block's inside into calls.

States: ``start`` (content, where a ``<think>`` may still open the thinking span: only whitespace came
before), ``reasoning``, ``content`` and ``block`` (inside tool-call markup, held until it closes). Whitespace
at the edges of the parts is the markup's, not the model's words: the thinking span's leading and trailing
whitespace, the content's leading whitespace after the span or after a block, and whitespace before a block
are dropped (the templates write these separators and strip them when they render a turn).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from colibri_aio.text.replies.base import ReplyDelta, ReplyParser, ToolCall, first_marker
from colibri_aio.text.sampling import longest_partial_suffix

BlockReader = Callable[[str], "list[ToolCall] | None"]   # a block's inside -> its calls, None when broken


@dataclass(frozen=True)
class Markup:
    """The markers of one syntax."""

    think_open: str | None = "<think>"
    think_close: str = "</think>"
    block_open: str | None = None
    block_close: str | None = None      # None: the block runs to the end of the generation
    close_optional: bool = False        # the block's close may be missing at the end (an end token)


def read_each(pattern: re.Pattern[str], inside: str,
              read_one: Callable[[re.Match[str]], ToolCall | None]) -> list[ToolCall] | None:
    """The calls of a block written as back-to-back matches of ``pattern`` (whitespace between them); None unless
    the block is only that and each match reads as a call."""
    calls, pos = [], 0
    while (match := pattern.match(inside, pos)) is not None:
        call = read_one(match)
        if call is None:
            return None
        calls.append(call)
        pos = match.end()
    if not calls or inside[pos:].strip():
        return None
    return calls


def thinking_state(prompt: str, markup: Markup) -> str:
    """Where the prompt leaves the reply: inside the thinking span when the generation prompt ends with it
    opened, past it when it ends with it closed, else at the start."""
    if markup.think_open is None:
        return "content"
    tail = prompt.rstrip()
    if tail.endswith(markup.think_open):
        return "reasoning"
    if tail.endswith(markup.think_close):
        return "after_think"
    return "start"


class TaggedParser(ReplyParser):
    """Reasoning, content and tool-call blocks from tagged text (see the module's docstring)."""

    def __init__(self, markup: Markup, read_block: BlockReader, *, prompt: str, tools: bool) -> None:
        super().__init__()
        self._m = markup
        self._read_block = read_block
        self._tools = bool(tools) and markup.block_open is not None
        self._buf = ""
        state = thinking_state(prompt, markup)
        self._state = "content" if state == "after_think" else state
        self._lstrip = state in ("after_think", "reasoning")   # drop leading whitespace of this part
        self._ws = ""             # trailing whitespace of the current part, held until text follows
        self._ws_before_block = ""
        self._scanned = 0         # how far a block's inside has been searched for its close

    @property
    def in_reasoning(self) -> bool:
        return self._state == "reasoning"

    # -- emitting ---------------------------------------------------------------------------------------

    def _emit(self, text: str, delta: ReplyDelta, *, hold_ws: bool) -> None:
        """Text of the current part (content or reasoning), with its edges' whitespace handled."""
        if self._lstrip:
            text = text.lstrip()
            if not text:
                return
            self._lstrip = False
        if hold_ws:
            body = text.rstrip()
            if not body:
                self._ws += text
                return
            text, self._ws = self._ws + body, text[len(body):]
        if self._state == "reasoning":
            delta.reasoning += text
        else:
            delta.content += text

    def _hold_content_ws(self) -> bool:
        # Whitespace before a block is the block's separator: held only while a block could follow.
        return self._tools

    # -- states -----------------------------------------------------------------------------------------

    def _feed(self, text: str, delta: ReplyDelta) -> None:
        self._buf += text
        while self._step(delta):
            pass

    def _step(self, delta: ReplyDelta) -> bool:
        """One move through the buffer; False when it must wait for more text."""
        if self._state == "block":
            return self._step_block(delta)
        if self._state == "reasoning":
            return self._step_text(delta, [self._m.think_close], hold_ws=True)
        if self._state == "start":
            return self._step_start()
        markers = [self._m.block_open] if self._tools else []
        return self._step_text(delta, markers, hold_ws=self._hold_content_ws())

    def _step_start(self) -> bool:
        """Before any content: a ``<think>`` (after whitespace only) opens the thinking span."""
        opening = self._m.think_open or ""
        text = self._buf.lstrip()
        if not text or (len(text) < len(opening) and opening.startswith(text)):
            return False
        if opening and text.startswith(opening):
            self._buf = text[len(opening):]
            self._state, self._lstrip = "reasoning", True
        else:
            self._state = "content"
        return True

    def _step_text(self, delta: ReplyDelta, markers: list, hold_ws: bool) -> bool:
        markers = [m for m in markers if m]
        found = first_marker(self._buf, markers)
        if found is None:
            keep = longest_partial_suffix(self._buf, markers)
            safe = self._buf[: len(self._buf) - keep]
            self._buf = self._buf[len(safe):]
            if safe:
                self._emit(safe, delta, hold_ws=hold_ws)
            return False
        i, marker = found
        before, self._buf = self._buf[:i], self._buf[i + len(marker):]
        if before:
            self._emit(before, delta, hold_ws=hold_ws)
        if marker == self._m.think_close and self._state == "reasoning":
            self._state, self._lstrip, self._ws = "content", True, ""
            return True
        # a block opens
        self._ws_before_block, self._ws = self._ws, ""
        self._state, self._scanned = "block", 0
        return True

    def _step_block(self, delta: ReplyDelta) -> bool:
        close = self._m.block_close
        if close is None:
            return False
        i = self._buf.find(close, self._scanned)
        if i < 0:
            self._scanned = max(0, len(self._buf) - len(close) + 1)
            return False
        inside, self._buf = self._buf[:i], self._buf[i + len(close):]
        self._close_block(inside, close, delta)
        return True

    def _close_block(self, inside: str, close: str, delta: ReplyDelta) -> None:
        calls = self._read_block(inside)
        if calls is None:
            # broken markup: the text as written, as content
            delta.content += self._ws_before_block + (self._m.block_open or "") + inside + close
            self._lstrip = False
        else:
            delta.tool_calls.extend(calls)
            self._lstrip = True
        self._ws_before_block = ""
        self._state = "content"

    def _finish(self, delta: ReplyDelta) -> None:
        if self._state == "block":
            inside, self._buf = self._buf, ""
            calls = self._read_block(inside) if (self._m.close_optional or self._m.block_close is None) else None
            if calls is not None:
                delta.tool_calls.extend(calls)
            else:
                delta.content += self._ws_before_block + (self._m.block_open or "") + inside
            return
        rest, self._buf = self._buf, ""
        if self._state == "start":
            self._state = "content"
        self._emit(rest, delta, hold_ws=True)
        if self._ws and not self._lstrip:
            # whitespace after the last words, at the very end: the model's own
            if self._state == "reasoning":
                delta.reasoning += self._ws
            else:
                delta.content += self._ws
        self._ws = ""
