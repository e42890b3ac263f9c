"""Mistral tool calls, after the ``[TOOL_CALLS]`` control token. The older templates (Mistral-Nemo,
Mixtral-8x22B, Mistral-Small-3.1) write one JSON array,

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcdefghi"}]

the newer ones (Mistral-Small-3.2, Devstral, Magistral) one ``[TOOL_CALLS]`` per call,

    [TOOL_CALLS]get_weather[CALL_ID]abcdefghi[ARGS]{"city": "Paris"}

(``[CALL_ID]…`` only in some). Both are read whichever template is in use. The calls run to the end of the
generation (the end-of-sequence token closes them), so they are read when it finishes, or as soon as the
text so far is whole calls.
"""
from __future__ import annotations

import json

from colibri_aio.text.replies.base import (ChatSyntax, FunctionSpec, Lark, ReplyDelta, ReplyParser, ToolCall, Tools,
                                           make_call, repeat)
from colibri_aio.text.replies.tagged import Markup, TaggedParser

TOOL_CALLS, CALL_ID, ARGS = "[TOOL_CALLS]", "[CALL_ID]", "[ARGS]"


def read_array(text: str) -> list[ToolCall] | None:
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if isinstance(items, dict):
        items = [items]
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        call = make_call(item.get("name"), item.get("arguments")) if isinstance(item, dict) else None
        if call is None:
            return None
        calls.append(call)
    return calls


def read_named(text: str) -> ToolCall | None:
    """``NAME[CALL_ID]ID[ARGS]{…}`` or ``NAME[ARGS]{…}``."""
    head, sep, arguments = text.partition(ARGS)
    if not sep:
        return None
    name = head.partition(CALL_ID)[0]
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return make_call(name, value) if isinstance(value, dict) else None


def read_block(inside: str) -> list[ToolCall] | None:
    """Everything after the first ``[TOOL_CALLS]``: whole calls only, else None."""
    if inside.lstrip().startswith(("[", "{")):
        return read_array(inside)
    calls = []
    for part in inside.split(TOOL_CALLS):
        call = read_named(part)
        if call is None:
            return None
        calls.append(call)
    return calls


class MistralParser(TaggedParser):
    """Mistral's calls have no closing marker: besides at the end, a block is read whenever its text so far
    ends as whole calls could (``]`` or ``}``) and reads as whole calls; a later ``[TOOL_CALLS]`` starts the
    next block."""

    def _step_block(self, delta: ReplyDelta) -> bool:
        cut = self._buf.find(TOOL_CALLS)
        body = (self._buf if cut < 0 else self._buf[:cut]).rstrip()
        if not body.endswith(("]", "}")):
            return False
        calls = read_block(body)
        if calls is None:
            return False
        self._buf = self._buf[len(body):]
        delta.tool_calls.extend(calls)
        self._ws_before_block, self._state, self._lstrip = "", "content", True
        return True


class MistralSyntax(ChatSyntax):
    """``array``: the template writes the JSON array form (else the ``NAME[ARGS]`` form)."""

    name = "mistral"
    thinks = False

    def __init__(self, *, array: bool) -> None:
        self.array = array
        self._markup = Markup(think_open=None, block_open=TOOL_CALLS, block_close=None)

    def parser(self, *, prompt: str, tools: bool | Tools) -> ReplyParser:
        return MistralParser(self._markup, read_block, prompt=prompt, tools=bool(tools))

    def _call(self, g: Lark, spec: FunctionSpec, i: int) -> str:
        args = g.json_rule(f"args_{i}", spec.parameters)
        if self.array:
            head = g.text('{"name": ' + json.dumps(spec.name, ensure_ascii=False) + ', "arguments": ')
            return f'{head} {args} call_id? "}}"'
        return f"{g.marker(TOOL_CALLS)} {g.text(spec.name)} ({g.marker(CALL_ID)} ID)? {g.marker(ARGS)} {args}"

    def _calls(self, g: Lark, parallel: bool) -> str:
        g.rules.append("ID: /[a-zA-Z0-9]{9}/")
        if self.array:
            g.rule("call_id", '", \\"id\\": \\"" ID "\\""')
            return f'{g.marker(TOOL_CALLS)} "[" {repeat("call", parallel, chr(34) + ", " + chr(34))} "]"'
        return repeat("call", parallel)
