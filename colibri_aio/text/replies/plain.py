"""Templates with no tool-call syntax known: the whole reply is content (after a ``<think>…</think>`` span when
the template has one). Such a model has no markup for a call that a parser could find, so forcing one
(``tool_choice`` "required" or a named function) is refused."""
from __future__ import annotations

from collections.abc import Mapping

from colibri_aio.errors import UserError
from colibri_aio.text.replies.base import ChatSyntax, ReplyParser, ToolCall, Tools
from colibri_aio.text.replies.tagged import Markup, TaggedParser


def _no_calls(inside: str) -> list[ToolCall] | None:
    return None


class PlainSyntax(ChatSyntax):
    name = "plain"

    def __init__(self, thinks: bool = False) -> None:
        self.thinks = thinks
        self._markup = Markup(think_open="<think>" if thinks else None)

    def parser(self, *, prompt: str, tools: bool | Tools) -> ReplyParser:
        return TaggedParser(self._markup, _no_calls, prompt=prompt, tools=False)

    def tool_call_grammar(self, tools: Tools, *, name: str | None = None, parallel: bool = True,
                          special_tokens: Mapping[str, int] | None = None) -> str:
        raise UserError("this model's chat template has no tool-call syntax, so a tool call cannot be required")
