"""Llama 4's JSON tool calls, as the chat template shipped with Llama-4-Scout and Llama-4-Maverick writes them: an
object per call with the arguments under ``parameters``, the calls back to back after the turn's content, which
the template wraps in ``<|python_start|>…<|python_end|>``,

    <|python_start|>Let me look.<|python_end|>{"name": "get_weather", "parameters": {"city": "Paris"}}{"name": …}

(a turn with calls only is ``<|python_start|><|python_end|>{…}{…}``). The template's system prompt asks for
``{"name": function name, "parameters": dictionary of argument name and its value}``, and Llama 4 models also
write the calls on their own or inside the tags, ``<|python_start|>{"name": …}<|python_end|>``: all of these are
read. ``arguments`` is read where ``parameters`` is missing, and arguments written as JSON text are decoded.

What is read, and what stays content:

- An object that begins ``{"name":`` (spacing aside) is held until its braces close (strings followed), then read:
  a call when it is a JSON object with a non-empty ``name`` and a ``parameters`` (or ``arguments``) object. Any
  other object goes back as content, as written.
- ``<|python_start|>…<|python_end|>`` is held until it closes. When its inside holds calls, they are the calls
  (with any text around them as content). Otherwise, when calls follow the close, the inside is the turn's content
  (the template's layout); else the whole span, tags included, is content as written (code, say).

Whitespace between the content and a call, between calls and after the last one is the markup's; a
``<|python_end|>`` right after calls closes their span. Nothing here thinks: the reply has no reasoning.

The forced-call grammar (:meth:`Llama4JsonSyntax.tool_call_grammar`) writes what the template writes for a turn of
calls only, ``<|python_start|><|python_end|>`` (the special tokens) and the objects back to back, so a forced turn
renders back into the next prompt exactly as it was generated.
"""
from __future__ import annotations

import json

from colibri_aio.text.replies.base import (ChatSyntax, FunctionSpec, Lark, ReplyDelta, ReplyParser, ToolCall, Tools,
                                           TrailingCallsParser,
                                           first_marker, make_call, repeat)
from colibri_aio.text.replies.pythonic import PYTHON_END, PYTHON_START

_HEAD_KEY = '"name"'


def call_head(text: str, i: int) -> int | None:
    """Whether the ``{`` at ``text[i]`` opens a call, ``{"name":`` with any whitespace: the index past the colon
    when it does, -1 when it cannot, None when the text ends before that is known."""
    n, j = len(text), i + 1
    while j < n and text[j].isspace():
        j += 1
    for ch in _HEAD_KEY:
        if j == n:
            return None
        if text[j] != ch:
            return -1
        j += 1
    while j < n and text[j].isspace():
        j += 1
    if j == n:
        return None
    return j + 1 if text[j] == ":" else -1


def scan_object(text: str, pos: int, depth: int, in_string: bool) -> tuple[int, int, int, bool]:
    """Follows a JSON value's brackets and strings from ``pos`` (``depth`` brackets open, maybe inside a string).
    Returns (the index past the bracket that closes the value or -1, where to go on from, depth, in_string)."""
    n = len(text)
    while pos < n:
        ch = text[pos]
        if in_string:
            if ch == "\\":
                if pos + 1 == n:
                    break          # the escaped character is still to come
                pos += 2
                continue
            if ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return pos + 1, pos + 1, depth, in_string
        pos += 1
    return -1, pos, depth, in_string


def read_call(text: str) -> ToolCall | None:
    """One call object, ``{"name": …, "parameters": {…}}`` (or ``arguments``); None for anything else."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    key = "parameters" if "parameters" in obj else "arguments"
    if key not in obj or obj[key] is None:
        return None
    return make_call(obj.get("name"), obj[key])


class Llama4JsonParser(TrailingCallsParser):
    """Content and calls from a reply (see the module's docstring). States: ``content``; ``span`` (inside
    ``<|python_start|>``, held until ``<|python_end|>``); ``span_end`` (a span without calls closed: held until
    the text after it shows whether calls follow); ``object`` (a call object opened, held until it closes);
    ``after`` (calls were read: a ``<|python_end|>`` after them is the markup's)."""

    closing = PYTHON_END

    def __init__(self, *, tools: bool | Tools) -> None:
        super().__init__(tools=tools)
        self._lead = ""           # held text before the open object (whitespace, a span), given back if no call
        self._span_lead = ""      # whitespace before an open span
        self._inside = ""         # a closed span's inside: the turn's content when calls follow it
        # (the whitespace before a closed span, its inside) while the object after it is still open
        self._pending: tuple[str, str] | None = None
        self._scanned = 0         # how far the buffer has been searched (for the span's close, the object's end)
        self._depth = 0
        self._in_string = False

    def _give_back(self, text: str, delta: ReplyDelta) -> None:
        """Held text that was not calls: content, as written."""
        self._lstrip = False
        self._emit(text, delta)
        self._lead, self._pending, self._inside, self._state = "", None, "", "content"

    def _step(self, delta: ReplyDelta) -> bool:
        if self._state == "object":
            return self._step_object(delta)
        if self._state == "span":
            return self._step_span(delta)
        if self._state == "span_end":
            return self._step_span_end(delta)
        if self._state == "after":
            return self._step_after()
        return self._step_content(delta)

    def _step_content(self, delta: ReplyDelta) -> bool:
        found = first_marker(self._buf, [PYTHON_START, "{"])
        if found is None:
            self._emit_all_but_partial([PYTHON_START], delta)
            return False
        i, marker = found
        if marker == PYTHON_START:
            self._emit(self._buf[:i], delta)
            self._span_lead, self._ws = self._ws, ""
            self._buf = self._buf[i + len(PYTHON_START):]
            self._state, self._scanned = "span", 0
            return True
        head = call_head(self._buf, i)
        if head is None:
            self._emit_to(i, delta)
            return False
        if head < 0:
            self._emit_to(i + 1, delta)
            return True
        self._emit(self._buf[:i], delta)
        self._open_object(self._ws, i)
        self._ws = ""
        return True

    def _open_object(self, lead: str, at: int) -> None:
        self._lead = lead
        self._buf = self._buf[at:]
        self._state, self._scanned, self._depth, self._in_string = "object", 0, 0, False

    def _step_object(self, delta: ReplyDelta) -> bool:
        end, self._scanned, self._depth, self._in_string = scan_object(self._buf, self._scanned, self._depth,
                                                                       self._in_string)
        if end < 0:
            return False
        text, self._buf = self._buf[:end], self._buf[end:]
        call = read_call(text)
        if call is None:
            self._give_back(self._lead + text, delta)
            return True
        if self._pending is not None:
            # the span before this call held the turn's content (the template's layout)
            self._emit_inner(*self._pending, delta)
        delta.tool_calls.append(call)
        self._lead, self._pending, self._inside = "", None, ""
        self._state, self._lstrip = "after", True
        return True

    def _step_span(self, delta: ReplyDelta) -> bool:
        j = self._buf.find(PYTHON_END, self._scanned)
        if j < 0:
            self._scanned = max(0, len(self._buf) - len(PYTHON_END) + 1)
            return False
        inside, self._buf = self._buf[:j], self._buf[j + len(PYTHON_END):]
        if self._read_inside(inside, delta):
            return True
        self._inside, self._state = inside, "span_end"
        return True

    def _read_inside(self, inside: str, delta: ReplyDelta) -> bool:
        """A span's inside, when it holds calls: its calls, and any text around them as content."""
        inner = Llama4JsonParser(tools=True)
        inner.feed(inside)
        inner.finish()
        reply = inner.reply
        if not reply.tool_calls:
            return False
        self._emit_inner(self._span_lead, reply.content, delta)
        delta.tool_calls.extend(reply.tool_calls)
        self._span_lead, self._state, self._lstrip = "", "after", True
        return True

    def _emit_inner(self, lead: str, text: str, delta: ReplyDelta) -> None:
        """Content from inside a span, after the reply's earlier content (with ``lead``, the whitespace between
        them, when there was some); whitespace after it is the markup's (calls follow)."""
        if not text:
            return
        self._lstrip = False
        self._ws = lead if (any(self._content) or delta.content) else ""
        self._emit(text, delta)
        self._ws = ""

    def _span_text(self) -> str:
        return self._span_lead + PYTHON_START + self._inside + PYTHON_END

    def _step_span_end(self, delta: ReplyDelta) -> bool:
        text = self._buf.lstrip()
        if not text:
            return False
        if text[0] == "{":
            head = call_head(text, 0)
            if head is None:
                return False
            if head > 0:
                gap = self._buf[:len(self._buf) - len(text)]
                self._pending = (self._span_lead, self._inside)
                self._open_object(self._span_text() + gap, len(gap))
                self._span_lead = ""
                return True
        span, self._span_lead = self._span_text(), ""
        self._give_back(span, delta)
        return True

    def _finish(self, delta: ReplyDelta) -> None:
        if not self._tools:
            return
        rest, self._buf = self._buf, ""
        if self._state == "object":
            self._give_back(self._lead + rest, delta)
        elif self._state == "span":
            if not self._read_inside(rest, delta):
                lead, self._span_lead = self._span_lead + PYTHON_START, ""
                self._give_back(lead + rest, delta)
        elif self._state == "span_end":
            span, self._span_lead = self._span_text(), ""
            self._give_back(span + rest, delta)
        elif self._state == "after":
            if rest.strip() and rest.strip() != PYTHON_END:
                self._emit(rest, delta)
        else:
            self._emit(rest, delta)
        if self._ws and not self._lstrip:
            delta.content += self._ws   # whitespace after the last words, at the very end: the model's own
        self._ws = ""


class Llama4JsonSyntax(ChatSyntax):
    """``tagged``: the template wraps a calling turn's content in ``<|python_start|>…<|python_end|>`` (the model's
    own template does; vLLM's ``tool_chat_template_llama4_json.jinja`` writes content and calls bare)."""

    name = "llama4_json"
    thinks = False

    def __init__(self, *, tagged: bool = True) -> None:
        self.tagged = tagged

    def parser(self, *, prompt: str, tools: bool | Tools) -> ReplyParser:
        return Llama4JsonParser(tools=tools)

    def _call(self, g: Lark, spec: FunctionSpec, i: int) -> str:
        args = g.json_rule(f"args_{i}", spec.parameters)
        head = g.text('{"name": ' + json.dumps(spec.name, ensure_ascii=False) + ', "parameters": ')
        return f'{head} {args} "}}"'

    def _calls(self, g: Lark, parallel: bool) -> str:
        calls = repeat("call", parallel)
        if not self.tagged:
            return calls
        return f"{g.marker(PYTHON_START)} {g.marker(PYTHON_END)} {calls}"
