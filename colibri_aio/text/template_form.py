"""How a model's chat template wants tool calls written, found by trying: templates disagree.

Hugging Face templates read an assistant's ``tool_calls`` in different forms:
Qwen3's and GLM's iterate ``arguments`` as an object, DeepSeek's concatenate it
as JSON text; DeepSeek-R1's renders calls only when the message's content is
None, while Qwen3's fails on None and GLM's writes "None"; Mistral's accept only
9-character alphanumeric call ids. :func:`probe_template_form` renders one probe
call in each form and keeps the first whose text shows the call.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from colibri_aio.errors import UserError


@dataclass(frozen=True)
class TemplateForm:
    """How a chat template wants an assistant's tool calls: arguments as objects (Qwen3's, GLM's: they iterate
    them) or as JSON text (DeepSeek's: they concatenate them), and the message's empty content as None
    (DeepSeek-R1's renders calls only then) or as "" (Qwen3's fails on None; GLM's writes "None")."""

    object_arguments: bool = True
    none_content: bool = False
    short_ids: bool = False   # Mistral's accept only 9-character alphanumeric call ids


_PROBE_NAME, _PROBE_KEY, _PROBE_VALUE = "probe_function_x", "probe_key_y", "probe_value_z"


def probe_template_form(render: Callable[[list[dict[str, Any]], Mapping[str, Any]], str],
                        syntax_name: str) -> TemplateForm:
    """Try the forms on one call and its result; the first whose text shows the call wins (a template that
    renders no call at all keeps the default form)."""
    short_ids = syntax_name == "mistral"
    tools = [{"type": "function", "function": {"name": _PROBE_NAME, "description": "d",
                                               "parameters": {"type": "object",
                                                              "properties": {_PROBE_KEY: {"type": "string"}}}}}]
    for object_arguments in (True, False):
        for none_content in (False, True):
            form = TemplateForm(object_arguments, none_content, short_ids)
            args: str | dict[str, Any] = {_PROBE_KEY: _PROBE_VALUE}
            call = {"id": "call_probe", "type": "function", "function": {"name": _PROBE_NAME, "arguments": args}}
            messages = [{"role": "user", "content": "u"}, assistant_message({"content": None}, [call], form),
                        tool_message({"content": "r"}, "call_probe", form), {"role": "user", "content": "u"}]
            try:
                text = render(messages, {"tools": tools})
            except UserError:
                continue
            if _PROBE_NAME in text and _PROBE_VALUE in text and "None" not in text:
                return form
    return TemplateForm(short_ids=short_ids)


def assistant_message(message: dict[str, Any], calls: Sequence[dict[str, Any]], form: TemplateForm) -> dict[str, Any]:
    """An assistant message with ``calls`` (arguments as objects) in the template's form."""
    if not form.none_content and message.get("content") is None:
        message = {**message, "content": ""}
    out = []
    for call in calls:
        fn = call["function"]
        args = fn["arguments"] if form.object_arguments else json.dumps(fn["arguments"], ensure_ascii=False)
        entry: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args},
                                 "name": fn["name"], "arguments": args}  # some templates read the flat form
        if call.get("id"):
            entry["id"] = _call_id(call["id"], form)
        out.append(entry)
    return {"role": "assistant", **message, "tool_calls": out}


def tool_message(message: dict[str, Any], call_id: str, form: TemplateForm) -> dict[str, Any]:
    return {"role": "tool", **message, "tool_call_id": _call_id(call_id, form)}


_SHORT_ID = re.compile(r"[A-Za-z0-9]{9}")


def _call_id(call_id: str, form: TemplateForm) -> str:
    """The id as the template accepts it: for Mistral's, 9 alphanumeric characters (the same id always maps to
    the same short one, so a call and its result still match)."""
    if not form.short_ids or _SHORT_ID.fullmatch(call_id):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]
