"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) over the chat path.

A Messages request is validated strictly (an unknown field is a 400 naming
it; :data:`IGNORED_FIELDS` lists those accepted and ignored), translated into
the OpenAI :class:`ChatRequest` the chat route serves, and the chat path's
``chat.completion`` dict or its chunks are translated back into a ``message``
or Anthropic's stream events (``message_start`` … ``message_stop``).

What the translation decides:

- ``tool_result`` blocks become ``tool`` messages, in their order and before
  the user text of the same turn; ``is_error`` prefixes the result with
  ``Error: `` (chat templates have no other way to say it).
- ``thinking`` blocks of earlier replies become the assistant message's
  ``reasoning_content``; their ``signature`` is not checked (this server
  sends ``""``: it signs nothing).
- ``usage.input_tokens`` counts the prompt tokens prefilled for this request;
  those found in the KV cache are ``cache_read_input_tokens`` (Anthropic's
  split: their sum is the prompt). ``cache_creation_input_tokens`` is 0.
- ``stop_reason`` ``stop_sequence`` says which stop string ended the reply
  in ``stop_sequence`` (the chat path names it in its choice's
  ``stop_reason``, as vLLM's does). A reply that ended on the model's
  end-of-generation token is ``end_turn``.
- A conversation ending with an assistant message (Anthropic's prefill) is
  refused: the chat template opens a new reply, it does not continue one.

The app passes its chat opener in (:class:`ChatPath`): this module imports
nothing of :mod:`colibri_aio.serve.app`, which imports it.
"""
from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator,
                      model_validator)
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from colibri_aio.logs import get_logger
from colibri_aio.serve.chat_flow import render_prompt
from colibri_aio.serve.errors import APIError
from colibri_aio.serve.requests import (MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_STOP_CHARS, MAX_STOPS, MAX_TOOLS,
                                       ChatRequest, at_most, parse)
from colibri_aio.serve.runs import ClientGone, Run, error_for

if TYPE_CHECKING:
    from colibri_aio.serve.app import Service
    from colibri_aio.serve.session import Session

log = get_logger("colibri_aio.serve")
PATHS = ("/v1/messages", "/v1/messages/count_tokens")
SSE_SEP = "\n"
PING_SECONDS = 10  # a ping event this often keeps a slow stream open through proxies

# The error type Anthropic names for each status; other 4xx are invalid requests, other 5xx api errors.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}

# Fields a client may send that change nothing here, by where they stand.
IGNORED_FIELDS = {
    "request": frozenset({"metadata", "service_tier", "cache_control"}),  # prefixes are cached without markers
    "block": frozenset({"cache_control"}),
    "text": frozenset({"cache_control", "citations"}),   # an earlier reply's citations annotate its text
    "tool": frozenset({"cache_control"}),
}


# --- errors ----------------------------------------------------------------------------------------------------------

def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def error_body(err: APIError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}`` for an error the OpenAI routes would have answered."""
    return {"type": "error", "error": {"type": error_type(err.status), "message": err.message}}


def error_response(err: APIError) -> JSONResponse:
    """The Anthropic-shaped response of ``err``: its status and headers (``Retry-After`` of a 429), Anthropic's body."""
    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers)


def is_messages_path(path: str) -> bool:
    """Whether ``path`` is one of this API's routes (their errors take Anthropic's shape)."""
    return path in PATHS


# --- request bodies --------------------------------------------------------------------------------------------------

class _Strict(BaseModel):
    """A body part that refuses unknown fields, after dropping those of its ``IGNORED`` set."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    IGNORED: ClassVar[frozenset[str]] = IGNORED_FIELDS["block"]

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if k not in cls.IGNORED}
        return data


class TextBlock(_Strict):
    IGNORED = IGNORED_FIELDS["text"]
    type: Literal["text"]
    text: str


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | Annotated[list[TextBlock], at_most(MAX_CONTENT_PARTS)] = ""
    is_error: bool = False

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        return _known_blocks(v, ("text",))

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {body}" if self.is_error else body


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str


def _tag(v: Any) -> str | None:
    """The union member a block (or a choice) asks for by its ``type``; tags are ``<text>``-shaped, so that error
    locations can leave them out (they never name a field)."""
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return None if kind is None else f"<{kind}>"


Block = Annotated[Annotated[TextBlock, Tag("<text>")] | Annotated[ToolUseBlock, Tag("<tool_use>")]
                  | Annotated[ToolResultBlock, Tag("<tool_result>")] | Annotated[ThinkingBlock, Tag("<thinking>")],
                  Discriminator(_tag)]
BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking")


class BlockRefused(ValueError):
    """A content block of a type this server does not read (an image, a document, …)."""

    def __init__(self, index: int, kind: object, allowed: Sequence[str]) -> None:
        what = f"{kind} blocks are not supported" if isinstance(kind, str) else "a block needs a string type"
        super().__init__(f"{what}; this server reads {', '.join(allowed)} blocks")
        self.index = index


def _known_blocks(v: Any, allowed: Sequence[str]) -> Any:
    """``v`` unchanged, or :class:`BlockRefused` for its first block of a type not in ``allowed``."""
    if isinstance(v, list):
        for i, block in enumerate(v):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in allowed:
                raise BlockRefused(i, kind, allowed)
    return v


class MessageIn(_Strict):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], at_most(MAX_CONTENT_PARTS)]

    @field_validator("content", mode="before")
    @classmethod
    def _readable(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("a message needs at least one block")
        return _known_blocks(v, BLOCK_TYPES)

    def blocks(self) -> list[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


class ToolIn(_Strict):
    IGNORED = IGNORED_FIELDS["tool"]
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in (None, "custom"):
            raise ValueError(f"{data['type']!r} is a server tool, which this server does not run; declare client "
                             f"tools as {{name, description, input_schema}}")
        return data


class _Choice(_Strict):
    disable_parallel_tool_use: bool = False


class AutoChoice(_Choice):
    type: Literal["auto"]


class AnyChoice(_Choice):
    type: Literal["any"]


class ToolChoiceNamed(_Choice):
    type: Literal["tool"]
    name: str = Field(min_length=1)


class NoneChoice(_Strict):
    type: Literal["none"]


ToolChoice = Annotated[Annotated[AutoChoice, Tag("<auto>")] | Annotated[AnyChoice, Tag("<any>")]
                       | Annotated[ToolChoiceNamed, Tag("<tool>")] | Annotated[NoneChoice, Tag("<none>")],
                       Discriminator(_tag)]


class ThinkingEnabled(_Strict):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(_Strict):
    type: Literal["disabled"]


class ThinkingAdaptive(_Strict):
    """The model decides whether and how long to think: the template's default."""

    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


Thinking = Annotated[Annotated[ThinkingEnabled, Tag("<enabled>")] | Annotated[ThinkingDisabled, Tag("<disabled>")]
                     | Annotated[ThinkingAdaptive, Tag("<adaptive>")],
                     Discriminator(_tag)]


class CountTokensRequest(_Strict):
    """The body of ``/v1/messages/count_tokens``: what makes the prompt."""

    IGNORED = IGNORED_FIELDS["request"]
    model: str = Field(min_length=1)
    messages: Annotated[list[MessageIn], at_most(MAX_MESSAGES)] = Field(min_length=1)
    system: str | Annotated[list[TextBlock], at_most(MAX_CONTENT_PARTS)] | None = None
    tools: Annotated[list[ToolIn], at_most(MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _system_text(cls, v: Any) -> Any:
        return _known_blocks(v, ("text",))

    @model_validator(mode="after")
    def _consistent(self) -> CountTokensRequest:
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: tool names must be unique")
        choice = self.tool_choice
        if isinstance(choice, (AnyChoice, ToolChoiceNamed)) and not names:
            raise ValueError(f"tool_choice: type {choice.type!r} needs tools")
        if isinstance(choice, ToolChoiceNamed) and choice.name not in names:
            raise ValueError(f"tool_choice.name: no tool is named {choice.name!r}")
        return self


class MessagesRequest(CountTokensRequest):
    """The body of ``/v1/messages``."""

    max_tokens: int = Field(ge=1)
    stop_sequences: Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], at_most(MAX_STOPS)] | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False

    @field_validator("stop_sequences")
    @classmethod
    def _nonempty_stops(cls, v: list[str] | None) -> list[str] | None:
        if v and any(not s for s in v):
            raise ValueError("stop sequences must not be empty strings")
        return v


def parse_request(model: type[_Strict], body: Any) -> Any:
    """Validate a JSON body; the deepest problem becomes a 400 naming its field."""
    return parse(model, body, lambda exc: APIError(400, _problem(_deepest(exc.errors(include_url=False)))))


def _deepest(errors: Sequence[Any]) -> Any:
    """The error that reached furthest into the body: for ``str | list[...]`` given a list, the list's problem."""
    return max(errors, key=lambda e: (len(e["loc"]), e["loc"][-1:] != ("str",)))


def _problem(err: Any) -> str:
    """One line naming the field: ``messages[0].content[1]: image blocks are not supported; …``."""
    where = _where(err["loc"])
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, BlockRefused):
        where, message = f"{where}[{cause.index}]", str(cause)
    elif isinstance(cause, ValueError):
        message = str(cause)  # a whole-request check (no location) names its own field
    elif err["type"] == "union_tag_invalid":
        expected = err["ctx"]["expected_tags"].replace("<", "").replace(">", "")
        message = f"type {err['ctx']['tag'].strip('<>')!r} is not one of {expected}"
    elif err["type"] == "union_tag_not_found":
        where, message = f"{where}.type" if where else "type", "required"
    elif err["type"] == "extra_forbidden":
        message = "unknown field (this server does not implement it)"
    elif err["type"] == "missing":
        message = "required"
    else:
        message = err["msg"]
    return f"{where}: {message}" if where else message


def _where(loc: Sequence[Any]) -> str:
    """``("messages", 0, "content", "list[...]", 1, "<text>", "text")`` -> ``messages[0].content[1].text``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part.startswith("<") or part in ("str", "function-after", "function-before"):
            continue  # a union member's or a validator's tag, not a field
        else:
            out += f".{part}" if out else part
    return out


# --- Anthropic request -> OpenAI chat request ------------------------------------------------------------------------

def to_chat(req: CountTokensRequest) -> ChatRequest:
    """The OpenAI chat request asking for what ``req`` asks."""
    if req.messages[-1].role == "assistant":
        raise APIError(400, f"messages[{len(req.messages) - 1}]: the conversation must end with a user message "
                            "(continuing an assistant message is not supported)")
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _parts(req.system)})
    for i, m in enumerate(req.messages):
        messages += _user_turn(i, m) if m.role == "user" else [_assistant_turn(i, m)]
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema, "strict": t.strict}}
                         for t in req.tools]
    body.update(_tool_choice(req.tool_choice))
    body.update(_thinking(req.thinking))
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                    stop=req.stop_sequences or None, stream=req.stream)
        if req.stream:
            body["stream_options"] = {"include_usage": True}
    try:
        return ChatRequest.model_validate(body)
    except ValidationError as exc:  # the chat path refuses what this module let through: say it in its words
        err = exc.errors(include_url=False)[0]
        raise APIError(400, f"{_where(err['loc'])}: {err['msg']}") from None


def _parts(content: str | Sequence[TextBlock]) -> str | list[dict[str, str]]:
    return content if isinstance(content, str) else [{"type": "text", "text": b.text} for b in content]


def _user_turn(i: int, m: MessageIn) -> list[dict[str, Any]]:
    """A user message: its tool results as ``tool`` messages first, then its text (if any) as one message."""
    results, texts = [], []
    for j, b in enumerate(m.blocks()):
        if isinstance(b, ToolResultBlock):
            results.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
        elif isinstance(b, TextBlock):
            texts.append(b)
        else:
            raise APIError(400, f"messages[{i}].content[{j}]: {b.type} blocks belong in assistant messages")
    return results + ([{"role": "user", "content": _parts(texts)}] if texts or not results else [])


def _assistant_turn(i: int, m: MessageIn) -> dict[str, Any]:
    """An assistant message: text, its thinking as ``reasoning_content``, tool uses as ``tool_calls``."""
    texts, thoughts, calls = [], [], []
    for j, b in enumerate(m.blocks()):
        if isinstance(b, TextBlock):
            texts.append(b)
        elif isinstance(b, ThinkingBlock):
            thoughts.append(b.thinking)
        elif isinstance(b, ToolUseBlock):
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
        else:
            raise APIError(400, f"messages[{i}].content[{j}]: tool_result blocks belong in user messages")
    out: dict[str, Any] = {"role": "assistant", "content": _parts(texts) if texts else None}
    if thoughts:
        out["reasoning_content"] = "".join(thoughts)
    if calls:
        out["tool_calls"] = calls
    return out


def _tool_choice(choice: AutoChoice | AnyChoice | ToolChoiceNamed | NoneChoice | None) -> dict[str, Any]:
    if choice is None:
        return {}
    out: dict[str, Any] = {}
    if isinstance(choice, _Choice) and choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    if isinstance(choice, ToolChoiceNamed):
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return out


def _thinking(thinking: ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive | None) -> dict[str, Any]:
    if isinstance(thinking, ThinkingEnabled):
        return {"reasoning_budget": thinking.budget_tokens}
    if isinstance(thinking, ThinkingDisabled):
        return {"chat_template_kwargs": {"enable_thinking": False}}
    return {}


# --- OpenAI chat response -> Anthropic message -----------------------------------------------------------------------

def message_id() -> str:
    return f"msg_{secrets.token_hex(12)}"


def usage(chat_usage: dict[str, Any] | None) -> dict[str, int]:
    """Anthropic's usage from the chat path's: prefilled prompt tokens, those read from the KV cache, output."""
    chat_usage = chat_usage or {}
    prompt = chat_usage.get("prompt_tokens", 0)
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": prompt - cached, "output_tokens": chat_usage.get("completion_tokens", 0),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def stop_reason(choice: dict[str, Any]) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of a finished chat choice."""
    finish = choice.get("finish_reason")
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls":
        return "tool_use", None
    matched = choice.get("stop_reason")  # the stop string that ended the reply (None: an end-of-generation token)
    return ("stop_sequence", matched) if isinstance(matched, str) else ("end_turn", None)


def tool_input(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call's arguments as the ``input`` object of a ``tool_use`` block."""
    fn = call.get("function") or {}
    try:
        value = json.loads(fn.get("arguments") or "{}")
    except json.JSONDecodeError as exc:
        raise APIError(500, f"the tool call to {fn.get('name')!r} has arguments that are not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise APIError(500, f"the tool call to {fn.get('name')!r} has arguments that are not a JSON object")
    return value


def to_message(chat: dict[str, Any], *, msg_id: str, show_thinking: bool = True
               ) -> dict[str, Any]:
    """The Anthropic ``message`` of a whole ``chat.completion`` dict."""
    choice = chat["choices"][0]
    reply = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if reply.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": reply["reasoning_content"] if show_thinking else "",
                        "signature": ""})
    if reply.get("content"):
        content.append({"type": "text", "text": reply["content"]})
    for call in reply.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": tool_input(call)})
    reason, sequence = stop_reason(choice)
    return {"id": msg_id, "type": "message", "role": "assistant", "model": chat.get("model"), "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage(chat.get("usage"))}


Event = tuple[str, dict[str, Any]]


class StreamTranslator:
    """Chat chunks in, Anthropic stream events out: one content block open at a time (thinking, text, or one
    tool use), closed when the next kind of delta starts; ``message_delta`` and ``message_stop`` once the usage
    chunk arrives."""

    def __init__(self, *, msg_id: str, model: str, show_thinking: bool = True) -> None:
        self.msg_id, self.model, self.show_thinking = msg_id, model, show_thinking
        self.index = -1                  # of the open (or last) block
        self.open: str | None = None     # "thinking", "text", or "tool:<chat tool-call index>"
        self.finish: tuple[str, str | None] = ("end_turn", None)
        self.done = False

    def start(self, input_tokens: int = 0, cached_tokens: int = 0) -> list[Event]:
        """``message_start`` (no content yet; the prompt's tokens: prefilled, read from the KV cache) and a
        ``ping``."""
        message: dict[str, Any] = {
            "id": self.msg_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": cached_tokens}}
        return [("message_start", {"type": "message_start", "message": message}), ("ping", {"type": "ping"})]

    def chunk(self, chunk: dict[str, Any]) -> list[Event]:
        """The events of one chat chunk (an ``{"error": …}`` chunk is an ``error`` event, and the end)."""
        if "error" in chunk:
            self.done = True
            err = chunk["error"] or {}
            return [("error", {"type": "error", "error": {"type": _anthropic_kind(err),
                                                          "message": err.get("message", "")}})]
        events: list[Event] = []
        for choice in chunk.get("choices") or []:
            events += self._delta(choice.get("delta") or {})
            if choice.get("finish_reason"):
                events += self._close()
                self.finish = stop_reason(choice)
        if chunk.get("usage") and not chunk.get("choices"):
            events += self._close() + self.end(chunk["usage"])
        return events

    def end(self, chat_usage: dict[str, Any] | None) -> list[Event]:
        """``message_delta`` (the stop reason, the usage) and ``message_stop``."""
        self.done = True
        reason, sequence = self.finish
        return [("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                   "usage": usage(chat_usage)}),
                ("message_stop", {"type": "message_stop"})]

    def _delta(self, delta: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        if delta.get("reasoning_content"):
            events += self._ensure("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            if self.show_thinking:
                events.append(self._block_delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            events += self._ensure("text", {"type": "text", "text": ""})
            events.append(self._block_delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            key = f"tool:{call.get('index', 0)}"
            if key != self.open:
                call_id = call.get("id") or f"toolu_{secrets.token_hex(12)}"
                events += self._ensure(key, {"type": "tool_use", "id": call_id, "name": fn.get("name") or "",
                                             "input": {}})
            if fn.get("arguments"):
                events.append(self._block_delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return events

    def _ensure(self, kind: str, block: dict[str, Any]) -> list[Event]:
        """Open a block of ``kind`` unless one is open (closing the open one of another kind)."""
        if self.open == kind:
            return []
        events = self._close()
        self.index += 1
        self.open = kind
        return events + [("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block})]

    def _close(self) -> list[Event]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _block_delta(self, delta: dict[str, Any]) -> Event:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}


def _anthropic_kind(err: dict[str, Any]) -> str:
    """Anthropic's error type for an OpenAI error body (a mid-stream error chunk carries no status)."""
    if err.get("code") in ("shutting_down", "queue_full"):
        return "overloaded_error"
    kind = err.get("type")
    same = ("invalid_request_error", "authentication_error", "not_found_error", "rate_limit_error")
    return kind if isinstance(kind, str) and kind in same else "api_error"


# --- routes ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChatPath:
    """What these routes take from the chat route (passed in by the app, which imports this module)."""

    open: Callable[[Request, Service, ChatRequest], Awaitable[Run | Response]]   # the turn, the prompt, the start
    read_json: Callable[[Request], Awaitable[Any]]                                # the request's JSON body


def routes(chat: ChatPath) -> list[Route]:
    """``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` over ``chat``."""
    return [Route(PATHS[0], partial(messages, chat=chat), methods=["POST"]),
            Route(PATHS[1], partial(count_tokens, chat=chat), methods=["POST"])]


async def messages(request: Request, *, chat: ChatPath) -> Response:
    """Anthropic's ``POST /v1/messages``: a whole ``message``, or its stream events."""
    service: Service = request.app.state.service
    try:
        req, body = await run_in_threadpool(translated, MessagesRequest, await chat.read_json(request))
        run = await chat.open(request, service, body)
    except Exception as exc:
        return _refusal(exc)
    if isinstance(run, Response):  # the client left while waiting for its turn
        return run
    show = getattr(req.thinking, "display", None) != "omitted"
    if req.stream:
        translator = StreamTranslator(msg_id=message_id(), model=service.model_id, show_thinking=show)
        return EventSourceResponse(_events(run, translator), sep=SSE_SEP, ping=PING_SECONDS,
                                   ping_message_factory=_ping, background=BackgroundTask(run.cancel))
    try:
        chat_reply = await run.whole()
        return JSONResponse(to_message(chat_reply, msg_id=message_id(), show_thinking=show))
    except ClientGone:
        return Response(status_code=499)
    except Exception as exc:
        return _refusal(exc)
    finally:
        run.cancel()


async def count_tokens(request: Request, *, chat: ChatPath) -> Response:
    """Anthropic's ``POST /v1/messages/count_tokens``: ``{"input_tokens": n}`` of the prompt the same messages,
    system prompt and tools make with the model's chat template."""
    service: Service = request.app.state.service
    try:
        _, body = await run_in_threadpool(translated, CountTokensRequest, await chat.read_json(request))
        ids = await run_in_threadpool(prompt_ids, service.session, body)
    except Exception as exc:
        return _refusal(exc)
    return JSONResponse({"input_tokens": len(ids)})


def translated(model: type[MessagesRequest] | type[CountTokensRequest], body: Any) -> tuple[Any, ChatRequest]:
    """The request validated as ``model`` and its chat request (on a worker thread: a large body takes a while)."""
    req = parse_request(model, body)
    return req, to_chat(req)


def prompt_ids(session: Session, body: ChatRequest) -> list[int]:
    """The prompt's ids as the chat route renders it: messages and offered tools through the chat template."""
    return render_prompt(session, body)[1]


async def _events(run: Run, translator: StreamTranslator) -> AsyncIterator[dict[str, str]]:
    """The stream: ``message_start``, the blocks, ``message_delta``, ``message_stop``; an error ends it."""
    try:
        first = run.first
        for event in translator.start(first.prompt_tokens - first.cached_tokens, first.cached_tokens):
            yield _sse(event)
        async for chunk in run.chunks(True):
            for event in translator.chunk(chunk):
                yield _sse(event)
            if translator.done:
                return
        for event in translator.chunk({"choices": [], "usage": None}) + translator.end(None):
            yield _sse(event)  # the chunks ended without their usage chunk: the message still ends
    except Exception as exc:  # the status line is sent: the error goes in the stream, and the stream ends
        err = error_for(exc)
        _log_unexpected(exc, err)
        yield _sse(("error", error_body(err)))
    finally:
        run.cancel()


def _sse(event: Event) -> dict[str, str]:
    name, payload = event
    return {"event": name, "data": json.dumps(payload, ensure_ascii=False, separators=(",", ":"))}


def _ping() -> ServerSentEvent:
    return ServerSentEvent(data=json.dumps({"type": "ping"}), event="ping", sep=SSE_SEP)


def _refusal(exc: Exception) -> Response:
    err = error_for(exc)
    _log_unexpected(exc, err)
    return error_response(err)


def _log_unexpected(exc: BaseException, err: APIError) -> None:
    if err.status >= 500 and not isinstance(exc, APIError):
        log.error("the messages route failed", exc_info=exc)
