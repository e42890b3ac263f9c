"""DeepSeek tool calls, written with DeepSeek's own tokens. V3 and R1:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 drops the type and the code fence:
``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>``. Both forms are read
whichever template is in use. R1 (and V3.1 when thinking) reason in ``<think>…</think>``. The closing
``<｜tool▁calls▁end｜>`` may be missing at the end (R1's template leaves it out after a single call).
"""
from __future__ import annotations

import re

from colibri_aio.text.replies.base import (ChatSyntax, FunctionSpec, Lark, ReplyParser, ToolCall, Tools, make_call,
                                           repeat)
from colibri_aio.text.replies.tagged import Markup, TaggedParser, read_each

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_CALL = re.compile(r"\s*" + re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(CALL_END), re.S)
_FENCED = re.compile(r"([^\n]*)\n```(?:json)?\s*\n(.*?)\n?```\s*$", re.S)


def read_call(text: str) -> ToolCall | None:
    """One call between its begin and end tokens, in either form."""
    head, sep, rest = text.partition(SEP)
    if not sep:
        return None
    fenced = _FENCED.fullmatch(rest)
    if fenced is not None:      # V3 / R1: TYPE<sep>NAME\n```json\nARGS\n```
        return make_call(fenced.group(1), fenced.group(2))
    return make_call(head, rest)   # V3.1: NAME<sep>ARGS


def read_block(inside: str) -> list[ToolCall] | None:
    return read_each(_CALL, inside, lambda match: read_call(match.group(1)))


class DeepSeekSyntax(ChatSyntax):
    """``name`` is ``deepseek_r1`` for R1's templates, ``deepseek_v3`` for V3's and V3.1's; ``v31`` says which
    call form the grammar writes."""

    def __init__(self, name: str, *, thinks: bool, v31: bool) -> None:
        self.name = name
        self.thinks = thinks
        self.v31 = v31
        self._markup = Markup(think_open="<think>" if thinks else None, block_open=CALLS_BEGIN,
                              block_close=CALLS_END, close_optional=True)

    def parser(self, *, prompt: str, tools: bool | Tools) -> ReplyParser:
        return TaggedParser(self._markup, read_block, prompt=prompt, tools=bool(tools))

    def _call(self, g: Lark, spec: FunctionSpec, i: int) -> str:
        args = g.json_rule(f"args_{i}", spec.parameters)
        if self.v31:
            body = f"{g.text(spec.name)} {g.marker(SEP)} {args}"
        else:
            body = f'"function" {g.marker(SEP)} {g.text(spec.name + chr(10) + "```json" + chr(10))} {args} "\\n```"'
        return f"{g.marker(CALL_BEGIN)} {body} {g.marker(CALL_END)}"

    def _calls(self, g: Lark, parallel: bool) -> str:
        calls = repeat("call", parallel, "" if self.v31 else '"\\n"?')
        return f"{g.marker(CALLS_BEGIN)} {calls} {g.marker(CALLS_END)}"
