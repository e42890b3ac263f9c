"""OpenAI request bodies: validation, and what a valid one asks of the engine.

No field is silently dropped: a field the server does not know is a 400
naming it (``messages[0].foo: unknown field``), so a client that relies on
an option this server does not implement learns it at once. Each body keeps
two short lists instead (``IGNORED``, ``EMPTY_ONLY``): fields clients commonly
send that change nothing here (``user``, ``store``, ``metadata``,
``service_tier``, ``prediction``: bookkeeping, billing, latency hints), and
fields of OpenAI's API that are not implemented but are accepted when they
carry nothing (``"audio": null`` in a message an SDK sends back). A field that
would change the answer and is not implemented (``audio``, ``functions``,
``web_search_options``, ``n`` > 1, llama-server's ``mirostat``, vLLM's
``min_tokens``) is refused.

Input is bounded as an attacker would send it: lists have caps (messages,
stop strings, ``logit_bias`` entries, tools, content parts, token ids), free
JSON objects (tool schemas, template variables) a nesting depth, and
:func:`parse_json` validates the raw body in pydantic's own parser, which
bounds nesting and lets other threads run (the server calls it off its
loop). A known field with a bad value is an :class:`APIError` 400 that names
it. Sampling options left out take the model's defaults
(``general.sampling.*`` in its GGUF, else llama.cpp's), as llama-server does.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

import pydantic_core
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, ValidationError, field_validator,
                      model_validator)

from colibri_aio.serve.errors import APIError
from colibri_aio.text.sampling import SamplingParams

Role = Literal["system", "developer", "user", "assistant", "tool"]

# Caps on what one request may hold (a 400 naming the field beyond them).
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 256        # per message
MAX_TOOLS = 128                # OpenAI's own limit
MAX_TOOL_CALLS = 128           # per message
MAX_STOPS = 64
MAX_STOP_CHARS = 1024          # per stop string
MAX_LOGIT_BIAS = 2048          # entries
MAX_TOKEN_IDS = 1 << 18        # a prompt or detokenize list of token ids (a 256k context)
MAX_TEMPLATE_VARIABLES = 64
MAX_DEPTH = 64                 # nesting of a free JSON object (a tool's schema, template variables)
TOKEN_ID = re.compile(r"-?[0-9]{1,12}")  # ASCII digits only: str.isdigit() takes "²", which int() refuses
EMPTY = (None, "", [], {})
# Fields of OpenAI's API this server does not implement (refused unless empty, as each body's EMPTY_ONLY says).
NOT_IMPLEMENTED = frozenset({"audio", "functions", "function_call", "web_search_options", "refusal", "annotations"})


def at_most(limit: int) -> BeforeValidator:
    """A cap on a list's or object's items, checked before they are validated (pydantic's ``max_length`` counts
    after validating every item: 10 000 messages would all be built first, holding the interpreter meanwhile)."""
    def check(value: Any) -> Any:
        if isinstance(value, (list, dict)) and len(value) > limit:
            raise ValueError(f"at most {limit} items, got {len(value)}")
        return value

    return BeforeValidator(check)


def _depth(value: Any) -> int:
    """How deeply ``value``'s lists and dicts nest (0: a scalar), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if level > MAX_DEPTH:
            break
        stack.extend((child, level + 1) for child in children)
    return deepest


def _shallow(value: dict[str, Any]) -> dict[str, Any]:
    if _depth(value) > MAX_DEPTH:
        raise ValueError(f"nested more than {MAX_DEPTH} levels deep")
    return value


JSONObject = Annotated[dict[str, Any], AfterValidator(_shallow)]


class _Body(BaseModel):
    """A request body: unknown fields refused, but for the two lists each body declares."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    # Fields accepted with any value and ignored: they change nothing in the answer of this server.
    IGNORED: ClassVar[frozenset[str]] = frozenset()
    # Fields of the APIs this server speaks that it does not implement: accepted only when empty (null, "", [], {}).
    EMPTY_ONLY: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, data: Any) -> Any:
        if isinstance(data, dict) and not (cls.IGNORED.isdisjoint(data) and cls.EMPTY_ONLY.isdisjoint(data)):
            data = {k: v for k, v in data.items()
                    if k not in cls.IGNORED and not (k in cls.EMPTY_ONLY and _is_empty(v))}
        return data


def _is_empty(value: Any) -> bool:
    return any(value == e and type(value) is type(e) for e in EMPTY)


class ContentPart(_Body):
    IGNORED = frozenset({"cache_control"})   # a prompt-caching hint; the KV cache is reused here anyway

    type: str
    text: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "text":
            raise ValueError(f"content parts of type {data.get('type')!r} are not supported (only text)")
        return data


class FunctionCall(_Body):
    name: str = Field(min_length=1)
    arguments: str | JSONObject = "{}"   # a JSON object as text (OpenAI), or the object itself


class ToolCallIn(_Body):
    """A tool call of an earlier assistant message, as the client sends it back."""

    IGNORED = frozenset({"index"})   # a stream delta's position, kept by clients that rebuild calls from deltas

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Body):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: JSONObject | None = None   # a JSON schema of the arguments
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Body):
    name: str = Field(min_length=1)


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class JSONSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    schema_: JSONObject | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class Message(_Body):
    # What an SDK's own reply object carries when it is sent back as the next turn's assistant message.
    EMPTY_ONLY = frozenset({"refusal", "annotations", "audio", "function_call"})

    role: Role
    content: str | Annotated[list[ContentPart], at_most(MAX_CONTENT_PARTS)] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCallIn], at_most(MAX_TOOL_CALLS)] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None   # an earlier reply's thinking, as this server returned it

    def text(self) -> str:
        """The message's text; parts other than text are refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"content parts of type {part.type!r} are not supported (only text)")
        return "".join(p.text or "" for p in self.content)


class StreamOptions(_Body):
    IGNORED = frozenset({"include_obfuscation"})   # padding against side channels; no usage shape change

    include_usage: bool = False


class _Generation(_Body):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    IGNORED = frozenset({"user"})   # an end-user id for the provider's abuse monitoring

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)           # -1 or 0: off (vLLM and llama.cpp spellings)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: (Annotated[str, Field(max_length=MAX_STOP_CHARS)]
           | Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], at_most(MAX_STOPS)]
           | None) = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repeat_penalty: float | None = Field(None, gt=0)
    repeat_last_n: int | None = Field(None, ge=-1)
    logit_bias: Annotated[dict[str, float], at_most(MAX_LOGIT_BIAS)] | None = None
    n: int = Field(1, ge=1, le=1)                      # one engine stream: one choice
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_prompt: bool = True                          # llama-server's switch for KV-cache reuse

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not TOKEN_ID.fullmatch(key):
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"bias of token {key} must be in [-100, 100], got {bias}")
        return v

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self, defaults: SamplingParams, vocab_size: int) -> SamplingParams:
        """The request's options over the model's defaults."""
        given = {"temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p, "seed": self.seed,
                 "top_k": None if self.top_k is None else max(self.top_k, 0),
                 "repeat_penalty": self.repeat_penalty, "presence_penalty": self.presence_penalty,
                 "frequency_penalty": self.frequency_penalty, "penalty_last_n": self.repeat_last_n,
                 "logit_bias": None if self.logit_bias is None else {int(k): v for k, v in self.logit_bias.items()}}
        params = defaults.override(given)
        for token in params.logit_bias:
            if not 0 <= token < vocab_size:
                raise APIError(400, f"logit_bias: token id {token} is not in [0, {vocab_size})", param="logit_bias")
        return params


class ChatRequest(_Generation):
    IGNORED = _Generation.IGNORED | {
        "store", "metadata",                           # keeping completions at the provider, and their tags
        "service_tier",                                # the provider's latency tier and billing
        "prediction",                                  # predicted output: a speed hint, the answer is the same
        "safety_identifier", "prompt_cache_key", "prompt_cache_retention",  # the provider's bookkeeping
    }
    EMPTY_ONLY = frozenset({"audio", "functions", "function_call", "web_search_options"})

    messages: Annotated[list[Message], at_most(MAX_MESSAGES)] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Annotated[list[Tool], at_most(MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    chat_template_kwargs: Annotated[JSONObject, at_most(MAX_TEMPLATE_VARIABLES)] | None = None   # extra template variables, e.g. {"enable_thinking": false}
    reasoning_effort: Literal["low", "medium", "high"] | None = None   # gpt-oss's template variable
    reasoning_budget: int | None = Field(None, ge=-1)   # thinking tokens before the span is closed; -1: no limit
    modalities: list[Literal["text"]] | None = None      # text is what this server answers with

    def token_budget(self) -> int | None:
        """max_completion_tokens, else max_tokens; None: to the end of the context."""
        return self.max_completion_tokens or self.max_tokens

    def logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Generation):
    # Tried in this order, and a list stops at its first bad item: a million token ids are not also tried, one
    # error each, as strings.
    prompt: (str | Annotated[list[StrictInt], Field(fail_fast=True), at_most(MAX_TOKEN_IDS)]
             | Annotated[list[str], Field(fail_fast=True), at_most(MAX_MESSAGES)]) = Field(union_mode="left_to_right")
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=1)

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str] | list[int]) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("one prompt per request (a list of several is not supported)")
            return v[0]
        if isinstance(v, list) and not v:
            raise ValueError("the prompt is empty")
        return v

    def token_budget(self) -> int:
        """max_tokens, else 16 as in OpenAI's completions API."""
        return self.max_tokens or 16


def parse(model: type[BaseModel], body: Any,
          refusal: Callable[[ValidationError], APIError] | None = None) -> Any:
    """Validate a JSON body already decoded; the first problem becomes a 400 naming its field (``refusal``: how
    another API words it)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise (refusal or _refusal)(exc) from None


def load_json(raw: bytes) -> Any:
    """A raw body decoded as JSON (a route that validates its own shapes); nesting past :data:`MAX_DEPTH` is
    refused, as is a body that is no JSON."""
    try:
        value = pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError as exc:
        if "recursion limit" in str(exc):
            raise APIError(400, "the request body is nested too deeply") from None
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if _depth(value) > MAX_DEPTH:
        raise APIError(400, f"the request body is nested more than {MAX_DEPTH} levels deep")
    return value


def parse_json(model: type[_Body], raw: bytes) -> Any:
    """Validate a raw JSON body in pydantic's parser (nesting bounded; other threads run meanwhile); the first
    problem, a syntax error included, becomes a 400 naming its field."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise _refusal(exc) from None


def _refusal(exc: ValidationError) -> APIError:
    err = _telling(exc.errors(include_url=False))
    loc, kind = err["loc"], err["type"]
    if kind == "json_invalid":
        reason = err.get("ctx", {}).get("error", err["msg"])
        if "recursion limit" in reason:
            return APIError(400, "the request body is nested too deeply")
        return APIError(400, f"the request body is not valid JSON: {reason}")
    if not loc and kind in ("model_type", "model_attributes_type", "dict_type"):
        return APIError(400, "the request body must be a JSON object")
    param = field_name(loc)
    if kind == "extra_forbidden":
        msg = "not supported by this server" if loc[-1] in NOT_IMPLEMENTED else "unknown field"
    else:
        msg = err["msg"].removeprefix("Value error, ")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param or None)


def _telling(errors: list[Any]) -> Any:
    """The error to report: of the first field's errors, one that is not a union branch's type mismatch, the most
    specific (``messages[0].content[0].foo`` rather than "content is not a string")."""
    field = errors[0]["loc"][:1]
    same = [e for e in errors if e["loc"][:1] == field]
    telling = [e for e in same if not e["type"].endswith("_type")] or same
    return max(telling, key=lambda e: len(e["loc"]))


def field_name(loc: tuple[Any, ...]) -> str:
    """``("messages", 0, "content")`` -> ``messages[0].content`` (pydantic's union branch names dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and ("[" in part or part.startswith("constrained-")
                                        or part in {"str", "int", "float", "list", "dict", "bool"}):
            continue  # a union member's tag, e.g. "list[ContentPart]", "constrained-str"
        else:
            out += f".{part}" if out else part
    return out
