"""OpenAI request bodies: validation, and what a valid one asks of the engine.

Unknown fields are ignored (clients send many); a known field with a bad
value is an :class:`APIError` 400 that names it. Sampling options left out
take the model's defaults (``general.sampling.*`` in its GGUF, else
llama.cpp's), as llama-server does.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from colibri_aio.serve.errors import APIError
from colibri_aio.text.sampling import SamplingParams

Role = Literal["system", "developer", "user", "assistant", "tool"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"   # a JSON object as text (OpenAI), or the object itself


class ToolCallIn(_Body):
    """A tool call of an earlier assistant message, as the client sends it back."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Body):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None   # a JSON schema of the arguments
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
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class Message(_Body):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
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
    include_usage: bool = False


class _Generation(_Body):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)           # -1 or 0: off (vLLM and llama.cpp spellings)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repeat_penalty: float | None = Field(None, gt=0)
    repeat_last_n: int | None = Field(None, ge=-1)
    logit_bias: dict[str, float] | None = None
    n: int = Field(1, ge=1, le=1)                      # one engine stream: one choice
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_prompt: bool = True                          # llama-server's switch for KV-cache reuse

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.lstrip("-").isdigit():
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
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None   # extra template variables, e.g. {"enable_thinking": false}
    reasoning_effort: Literal["low", "medium", "high"] | None = None   # gpt-oss's template variable
    reasoning_budget: int | None = Field(None, ge=-1)   # thinking tokens before the span is closed; -1: no limit

    def token_budget(self) -> int | None:
        """max_completion_tokens, else max_tokens; None: to the end of the context."""
        return self.max_completion_tokens or self.max_tokens

    def logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_messages(self) -> list[dict[str, str]]:
        """Messages as the chat template takes them (``developer`` is the newer name of ``system``)."""
        out = []
        for i, m in enumerate(self.messages):
            try:
                text = m.text()
            except ValueError as exc:
                raise APIError(400, f"messages[{i}].content: {exc}", param=f"messages[{i}].content") from None
            out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
        return out


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int]
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


def parse(model: type[_Body], body: Any) -> Any:
    """Validate a JSON body; the first problem becomes a 400 naming its field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param = field_name(err["loc"])
        raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param or None) from None


def field_name(loc: tuple[Any, ...]) -> str:
    """``("messages", 0, "content")`` -> ``messages[0].content`` (pydantic's union branch names dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "list", "dict", "bool"}):
            continue  # a union member's tag, e.g. "list[ContentPart]"
        else:
            out += f".{part}" if out else part
    return out
