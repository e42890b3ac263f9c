"""A chat request's way from body to prompt and constraints: template messages and variables, the reply's
syntax, the grammar and thinking budget that mask each pick.

What a client sends in OpenAI's shapes (``tools``, assistant ``tool_calls``,
``tool`` messages, ``response_format``, ``tool_choice``, ``chat_template_kwargs``,
``reasoning_effort``, ``reasoning_budget``) reaches the model through its own chat
template (as Hugging Face templates expect: ``tools=`` and messages whose
``tool_calls[].function.arguments`` are objects), and comes back through the
:class:`~colibri_aio.text.replies.ReplyParser` of the template's syntax.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from colibri_aio.serve.errors import APIError
from colibri_aio.serve.requests import ChatRequest, Message
from colibri_aio.serve.session import Session
from colibri_aio.text.reasoning_gate import ReasoningGate
from colibri_aio.text.replies.base import Lark
from colibri_aio.text.template_form import TemplateForm, assistant_message, tool_message
from colibri_aio.text.sampling import TokenConstraint

if TYPE_CHECKING:
    from colibri_aio.text.replies import ChatSyntax, ReplyParser

# Template variables the server sets itself: chat_template_kwargs may not replace them.
RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "pad_token",
                                "reasoning_effort"})
# What a grammar-constrained answer starts with, per syntax (markers, then text): gpt-oss writes its answer in
# the final channel.
ANSWER_PREFIX = {"harmony": ("<|channel|>", "final", "<|message|>")}
# How a thinking span opens, and the text that shows it closed (gpt-oss's analysis channel ends at <|end|>,
# whatever channel follows: the final answer or a tool call in commentary).
REASONING_MARKERS = {"harmony": ("<|channel|>analysis<|message|>", "<|end|>")}
THINK_MARKERS = ("<think>", "</think>")


@dataclass(frozen=True)
class ChatPlan:
    """What one chat request asks of the engine beyond its ids."""

    prompt: str                         # the rendered prompt
    ids: list[int]
    parser: ReplyParser
    constraint: TokenConstraint | None
    special: bool                       # pieces must show special tokens: the parser reads markers


def template_messages(body: ChatRequest, form: TemplateForm = TemplateForm()) -> list[dict[str, Any]]:
    """The request's messages as chat templates take them (in ``form``)."""
    return [_template_message(i, m, form) for i, m in enumerate(body.messages)]


def _template_message(i: int, m: Message, form: TemplateForm) -> dict[str, Any]:
    where = f"messages[{i}]"
    try:
        text: str | None = m.text()
    except ValueError as exc:
        raise APIError(400, f"{where}.content: {exc}", param=f"{where}.content") from None
    if m.content is None and m.tool_calls and form.none_content:
        text = None
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": text}
    if m.tool_calls:
        if m.role != "assistant":
            raise APIError(400, f"{where}.tool_calls: only assistant messages carry tool calls",
                           param=f"{where}.tool_calls")
        calls = [{"id": c.id, "type": "function",
                  "function": {"name": c.function.name, "arguments": _arguments(f"{where}.tool_calls[{j}]",
                                                                                c.function.arguments)}}
                 for j, c in enumerate(m.tool_calls)]
        out = assistant_message(out, calls, form)
    if m.role == "tool":
        if not m.tool_call_id:
            raise APIError(400, f"{where}.tool_call_id: a tool message must name the call it answers",
                           param=f"{where}.tool_call_id")
        out = tool_message(out, m.tool_call_id, form)
    if m.name is not None:
        out["name"] = m.name
    if m.reasoning_content:
        out["reasoning_content"] = m.reasoning_content  # Qwen3's and GLM's templates
        out["thinking"] = m.reasoning_content           # gpt-oss's
    return out


def _arguments(where: str, arguments: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise APIError(400, f"{where}.function.arguments: not JSON ({exc.msg} at {exc.pos})",
                           param=f"{where}.function.arguments") from None
    if not isinstance(arguments, dict):
        raise APIError(400, f"{where}.function.arguments: must be a JSON object", param=f"{where}.function.arguments")
    return arguments


def tools_offered(body: ChatRequest) -> list[dict[str, Any]]:
    """The tools the model may call (OpenAI's dicts); none with ``tool_choice: "none"``."""
    if not body.tools or body.tool_choice == "none":
        return []
    return [t.model_dump(exclude_none=True, by_alias=True) for t in body.tools]


def forced_tool(body: ChatRequest) -> tuple[bool, str | None]:
    """(a tool call is required, the one function it must call or None)."""
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        if choice == "required" and not body.tools:
            raise APIError(400, "tool_choice: \"required\" needs tools", param="tool_choice")
        return choice == "required", None
    names = {t.function.name for t in body.tools or ()}
    if choice.function.name not in names:
        raise APIError(400, f"tool_choice: no tool named {choice.function.name!r} in tools", param="tool_choice")
    return True, choice.function.name


def template_vars(body: ChatRequest, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """Variables for the chat template beyond messages."""
    extra = dict(body.chat_template_kwargs or {})
    taken = sorted(RESERVED_VARIABLES & extra.keys())
    if taken:
        raise APIError(400, f"chat_template_kwargs: {taken[0]!r} is set by the server", param="chat_template_kwargs")
    if tools:
        extra["tools"] = tools
    if body.reasoning_effort is not None:
        extra["reasoning_effort"] = body.reasoning_effort
    return extra


def render_prompt(session: Session, body: ChatRequest) -> tuple[str, list[int], list[dict[str, Any]]]:
    """The request's prompt through the chat template (its messages and the tools offered), its ids, and those
    tools."""
    tools = tools_offered(body)
    engine = session.engine.engine
    prompt = engine.render_chat(template_messages(body, session.template_form), template_vars(body, tools))
    return prompt, engine.text_ids(prompt, templated=True), tools


def plan_chat(session: Session, body: ChatRequest, *, default_budget: int | None = None) -> ChatPlan:
    """Render and tokenize the request, and choose the reply's parser and constraint (runs off the event loop:
    the template may take up to its time limit)."""
    required, name = forced_tool(body)
    syntax = session.syntax
    if tools_offered(body) and syntax.name == "plain":
        # Its template would drop them, or write calls no parser here reads back: never silently.
        raise APIError(400, "tools: this model's chat template has no tool-call syntax this server reads "
                            "(send the request without tools, or with tool_choice \"none\")", param="tools")
    prompt, ids, tools = render_prompt(session, body)
    parser = syntax.parser(prompt=prompt, tools=tools)
    answer = _answer_grammar(session, syntax, body, tools, required, name)
    budget = body.reasoning_budget if body.reasoning_budget is not None else default_budget
    if budget is not None and budget < 0:
        budget = None
    constraint = answer
    if parser.in_reasoning and (answer is not None or budget is not None):
        constraint = _gate(session, syntax, budget, answer, opened=True)
    elif syntax.thinks and answer is None and budget is not None:
        constraint = _gate(session, syntax, budget, None, opened=False)
    return ChatPlan(prompt, ids, parser, constraint, special=syntax.name != "plain")


def _answer_grammar(session: Session, syntax: ChatSyntax, body: ChatRequest, tools: list[dict[str, Any]],
                    required: bool, name: str | None) -> TokenConstraint | None:
    if required:
        grammar = syntax.tool_call_grammar(tools, name=name, parallel=body.parallel_tool_calls,
                                           special_tokens=session.grammars.special_tokens)
        return session.grammars.lark(grammar)
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_schema" and (fmt.json_schema is None or fmt.json_schema.schema_ is None):
        raise APIError(400, "response_format.json_schema.schema: give the schema", param="response_format")
    schema = fmt.json_schema.schema_ if fmt.type == "json_schema" and fmt.json_schema else None
    strict = bool(fmt.json_schema.strict) if fmt.json_schema is not None else False
    prefix = ANSWER_PREFIX.get(syntax.name)
    if prefix is None:
        return session.grammars.json_schema(schema, strict=strict)
    g = Lark(session.grammars.special_tokens)
    marker, text, close = prefix
    head = f"{g.marker(marker)} {g.text(text)} {g.marker(close)}"
    return session.grammars.lark(g.grammar(f"{head} {g.json_rule('answer', schema or {'type': 'object'})}"))


def _gate(session: Session, syntax: ChatSyntax, budget: int | None, answer: TokenConstraint | None, *,
          opened: bool) -> ReasoningGate:
    """The thinking budget (None: none) and, after the span, the answer's grammar. A budget spent closes the
    span with the syntax's own ``reasoning_close`` (gpt-oss: on into the final channel)."""
    tok = session.tokenizer
    open_marker, closed = REASONING_MARKERS.get(syntax.name, THINK_MARKERS)
    close_ids = tok.encode(syntax.reasoning_close, parse_special=True, add_special=False)
    return ReasoningGate(close=closed, close_ids=close_ids,
                         token_text=lambda t: tok.token_bytes(t).decode("utf-8", errors="replace"),
                         budget=budget, eog=sorted(tok.eog_ids), answer=answer,
                         open_marker=None if opened else open_marker)
