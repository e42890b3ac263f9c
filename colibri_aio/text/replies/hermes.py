"""Hermes-style tool calls (Qwen3, Qwen2.5, QwQ, Hermes 2/3): a JSON object per call between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and, in the templates that think (Qwen3, QwQ), reasoning in ``<think>…</think>``.
"""
from __future__ import annotations

import json

from colibri_aio.text.replies.base import (ChatSyntax, FunctionSpec, Lark, ReplyParser, ToolCall, Tools, make_call,
                                           repeat)
from colibri_aio.text.replies.tagged import Markup, TaggedParser

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def read_call(obj: object) -> ToolCall | None:
    """One ``{"name": …, "arguments": …}`` object (``parameters`` is read as ``arguments`` too)."""
    if not isinstance(obj, dict):
        return None
    arguments = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    return make_call(obj.get("name"), arguments)


def read_block(inside: str) -> list[ToolCall] | None:
    """The calls inside one ``<tool_call>`` block (one object, or a list of them as some models write);
    None unless every one is a JSON object with a name."""
    try:
        obj = json.loads(inside)
    except ValueError:
        return None
    calls = [read_call(item) for item in (obj if isinstance(obj, list) and obj else [obj])]
    return None if None in calls else calls


class HermesSyntax(ChatSyntax):
    name = "hermes"

    def __init__(self, thinks: bool) -> None:
        self.thinks = thinks
        self._markup = Markup(think_open="<think>" if thinks else None, block_open=OPEN, block_close=CLOSE)

    def parser(self, *, prompt: str, tools: bool | Tools) -> ReplyParser:
        return TaggedParser(self._markup, read_block, prompt=prompt, tools=bool(tools))

    def _call(self, g: Lark, spec: FunctionSpec, i: int) -> str:
        args = g.json_rule(f"args_{i}", spec.parameters)
        head = g.text('{"name": ' + json.dumps(spec.name, ensure_ascii=False) + ', "arguments": ')
        return f'{head} {args} "}}"'

    def _calls(self, g: Lark, parallel: bool) -> str:
        block = g.rule("block", f'{g.marker(OPEN)} "\\n" call "\\n" {g.marker(CLOSE)}')
        return repeat(block, parallel, '"\\n"')
