"""GLM-4.5 / GLM-4.6 tool calls: the function's name, then each argument as a key and a bare value,

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

(a value is written as JSON unless it is a string), and reasoning in ``<think>…</think>``.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from functools import partial
from typing import Any

from colibri_aio.text.replies.base import (ChatSyntax, FunctionSpec, Lark, ReplyParser, ToolCall, Tools,
                                           is_string_schema, make_call, repeat, schemas_by_name,
                                           xml_value)
from colibri_aio.text.replies.tagged import Markup, TaggedParser

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def argument_schema(schemas: Mapping[str, dict[str, Any]], function: str, key: str) -> dict[str, Any] | None:
    """The declared schema of one argument, or None when the function or argument is not declared."""
    props = (schemas.get(function) or {}).get("properties")
    value = props.get(key) if isinstance(props, Mapping) else None
    return value if isinstance(value, dict) else None


def read_block(inside: str, schemas: Mapping[str, dict[str, Any]]) -> list[ToolCall] | None:
    """The call inside one ``<tool_call>`` block; None when the markup is not a name and key/value pairs."""
    start = inside.find(KEY_OPEN)
    head = inside if start < 0 else inside[:start]
    name = head.strip()
    if not name or any(c in name for c in "<>\n"):
        return None
    arguments: dict[str, Any] = {}
    rest, pos = inside[len(head):], 0
    while (match := _PAIR.match(rest, pos)) is not None:
        key = match.group(1).strip()
        arguments[key] = xml_value(match.group(2), argument_schema(schemas, name, key))
        pos = match.end()
    if rest[pos:].strip():
        return None
    call = make_call(name, arguments)
    return None if call is None else [call]


def argument_pairs(g: Lark, spec: FunctionSpec, i: int) -> str:
    """The key/value pairs of one function, in the schema's order, the optional ones optional; any number of
    keys with text values when the schema declares no properties (a free-form object)."""
    if not spec.properties():
        value = g.text_until(f"free_{i}", VALUE_CLOSE)
        pair = f'{g.marker(KEY_OPEN)} /[^<\\n]+/ {g.marker(KEY_CLOSE)} "\\n" {g.marker(VALUE_OPEN)} {value} "\\n"'
        return f"{g.rule(f'pair_{i}', pair)}*"
    parts = []
    for j, (key, schema, required) in enumerate(spec.properties()):
        if is_string_schema(schema):
            value = g.text_until(f"text_{i}_{j}", VALUE_CLOSE, schema)
        else:
            value = f"{g.json_rule(f'value_{i}_{j}', schema)} {g.marker(VALUE_CLOSE)}"
        pair = f'{g.marker(KEY_OPEN)} {g.text(key)} {g.marker(KEY_CLOSE)} "\\n" {g.marker(VALUE_OPEN)} {value} "\\n"'
        parts.append(f"{g.rule(f'pair_{i}_{j}', pair)}{'' if required else '?'}")
    return " ".join(parts)


class GlmSyntax(ChatSyntax):
    name = "glm45"
    thinks = True

    def __init__(self) -> None:
        self._markup = Markup(block_open=OPEN, block_close=CLOSE)

    def parser(self, *, prompt: str, tools: bool | Tools) -> ReplyParser:
        return TaggedParser(self._markup, partial(read_block, schemas=schemas_by_name(tools)), prompt=prompt,
                            tools=bool(tools))

    def _call(self, g: Lark, spec: FunctionSpec, i: int) -> str:
        return f'{g.text(spec.name)} "\\n" {argument_pairs(g, spec, i)}'.rstrip()

    def _calls(self, g: Lark, parallel: bool) -> str:
        block = g.rule("block", f"{g.marker(OPEN)} call {g.marker(CLOSE)}")
        return repeat(block, parallel, '"\\n"')
