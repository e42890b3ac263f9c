"""The model's side of tool calling and reasoning: which syntax a chat template's replies use, a streaming
parser that splits generated text into reasoning, content and tool calls, and the grammar that forces a tool
call in that syntax (see :mod:`colibri_aio.text.replies.base` for the contract).

:func:`chat_syntax` tells the syntax from the template's source: each syntax's markers are written in the
template itself (it renders past tool calls the way the model writes them), so finding them there is how
the model's own syntax is known.
"""
from __future__ import annotations

import re

from colibri_aio.text.replies.base import ChatSyntax, Reply, ReplyDelta, ReplyParser, ToolCall
from colibri_aio.text.replies.deepseek import CALL_BEGIN, DeepSeekSyntax
from colibri_aio.text.replies.glm45 import GlmSyntax
from colibri_aio.text.replies.harmony import HarmonySyntax
from colibri_aio.text.replies.hermes import HermesSyntax
from colibri_aio.text.replies.llama4_json import PYTHON_START, Llama4JsonSyntax
from colibri_aio.text.replies.minimax_m2 import MiniMaxSyntax
from colibri_aio.text.replies.mistral import MistralSyntax
from colibri_aio.text.replies.plain import PlainSyntax
from colibri_aio.text.replies.pythonic import PythonicSyntax

__all__ = ["ChatSyntax", "Reply", "ReplyDelta", "ReplyParser", "ToolCall", "chat_syntax"]

# A template that writes a past call as its name and an open parenthesis (``tool_call.name + '('``) shows the
# model calls tools in Python syntax (Llama 4's and Llama 3.2's pythonic templates).
_PYTHONIC_CALL = re.compile(r"""\.name\s*\+\s*(['"])\(\1""")
# A template that writes a past call as a JSON object by pieces, ``'{"name": "' + tool_call.function.name``, with
# its arguments under "parameters", shows the model calls tools in Llama's JSON (Llama 4's own template).
_JSON_CALL = re.compile(r"""\{"name": "'\s*\+""")


def _deepseek(template: str) -> ChatSyntax:
    thinks = "<think>" in template or "</think>" in template
    # V3.1 writes NAME<｜tool▁sep｜>ARGS; V3 and R1 write TYPE<｜tool▁sep｜>NAME and a ```json fence.
    v31 = "```json" not in template
    name = "deepseek_r1" if thinks and not v31 else "deepseek_v3"
    return DeepSeekSyntax(name, thinks=thinks, v31=v31)


def chat_syntax(template: str | None) -> ChatSyntax:
    """The reply syntax of the chat template ``template`` (its Jinja source); "plain" when none matches."""
    if not template:
        return PlainSyntax()
    if "<|channel|>" in template and "<|message|>" in template:
        return HarmonySyntax()
    if "<minimax:tool_call>" in template:
        return MiniMaxSyntax()
    if "<arg_key>" in template and "<tool_call>" in template:
        return GlmSyntax()
    if CALL_BEGIN in template:
        return _deepseek(template)
    if "[TOOL_CALLS]" in template:
        return MistralSyntax(array="[ARGS]" not in template)
    thinks = "</think>" in template
    if "<tool_call>" in template:
        return HermesSyntax(thinks=thinks)
    if _PYTHONIC_CALL.search(template):
        return PythonicSyntax()
    if _JSON_CALL.search(template) and '"parameters"' in template:
        return Llama4JsonSyntax(tagged=PYTHON_START in template)
    return PlainSyntax(thinks=thinks)
