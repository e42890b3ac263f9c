"""MiniMax-M2 tool calls: XML invocations inside one block,

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    </minimax:tool_call>

(a value is written as JSON unless it is a string), and reasoning in ``<think>…</think>`` (the generation
prompt opens it).
"""
from __future__ import annotations

import html
import re
from collections.abc import Mapping
from functools import partial
from typing import Any

from colibri_aio.text.replies.base import (ChatSyntax, FunctionSpec, Lark, ReplyParser, ToolCall, Tools,
                                           is_string_schema, make_call, repeat, schemas_by_name, xml_value)
from colibri_aio.text.replies.glm45 import argument_schema
from colibri_aio.text.replies.tagged import Markup, TaggedParser, read_each

OPEN, CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
_INVOKE = re.compile(r'\s*<invoke name="([^"]*)">(.*?)</invoke>', re.S)
_PARAMETER = re.compile(r'\s*<parameter name="([^"]*)">(.*?)</parameter>', re.S)


def read_invoke(name: str, body: str, schemas: Mapping[str, dict[str, Any]]) -> ToolCall | None:
    arguments: dict[str, Any] = {}
    pos = 0
    while (match := _PARAMETER.match(body, pos)) is not None:
        key = html.unescape(match.group(1))
        arguments[key] = xml_value(match.group(2), argument_schema(schemas, name, key))
        pos = match.end()
    if body[pos:].strip():
        return None
    return make_call(name, arguments)


def read_block(inside: str, schemas: Mapping[str, dict[str, Any]]) -> list[ToolCall] | None:
    """The calls inside one ``<minimax:tool_call>`` block; None unless it is only whole invocations."""
    return read_each(_INVOKE, inside, lambda match: read_invoke(html.unescape(match.group(1)), match.group(2), schemas))


class MiniMaxSyntax(ChatSyntax):
    name = "minimax_m2"
    thinks = True

    def __init__(self) -> None:
        self._markup = Markup(block_open=OPEN, block_close=CLOSE)

    def parser(self, *, prompt: str, tools: bool | Tools) -> ReplyParser:
        return TaggedParser(self._markup, partial(read_block, schemas=schemas_by_name(tools)), prompt=prompt,
                            tools=bool(tools))

    def _call(self, g: Lark, spec: FunctionSpec, i: int) -> str:
        """One ``<invoke>``: its parameters in the schema's order, text values held to their string schemas."""
        params = []
        for j, (key, schema, required) in enumerate(spec.properties()):
            head = g.text('<parameter name="' + key + '">')
            if is_string_schema(schema):
                value = g.text_until(f"text_{i}_{j}", "</parameter>", schema)
            else:
                value = g.json_rule(f"value_{i}_{j}", schema) + ' "</parameter>"'
            param = g.rule(f"param_{i}_{j}", head + " " + value + ' "\\n"')
            params.append(param if required else param + "?")
        if not params:   # a free-form object: any parameters, as text
            value = g.text_until(f"free_{i}", "</parameter>")
            params.append(g.rule(f"param_{i}", '"<parameter name=\\"" /[^"<]+/ "\\">" ' + value + ' "\\n"') + "*")
        return " ".join([g.text('<invoke name="' + spec.name + '">\n'), *params, g.text("</invoke>\n")])

    def _calls(self, g: Lark, parallel: bool) -> str:
        return f'{g.marker(OPEN)} "\\n" {repeat("call", parallel)} {g.marker(CLOSE)}'
