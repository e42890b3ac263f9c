"""OpenAI request bodies: what is accepted, what is refused (naming the field), what reaches the engine."""
from __future__ import annotations

import pytest

from colibri_aio.serve.errors import APIError
from colibri_aio.serve.chat_flow import template_messages
from colibri_aio.serve.requests import ChatRequest, CompletionRequest, field_name, parse
from colibri_aio.text.sampling import LLAMA_CPP_DEFAULTS

MSG = [{"role": "user", "content": "hi"}]


def test_field_names_read_like_the_request() -> None:
    assert field_name(("messages", 0, "content")) == "messages[0].content"
    assert field_name(("messages", 1, "content", "list[ContentPart]", 0, "type")) == "messages[1].content[0].type"
    assert field_name(("stream_options", "include_usage")) == "stream_options.include_usage"


def test_request_options_override_the_model_defaults_and_the_rest_stay() -> None:
    body = parse(ChatRequest, {"messages": MSG, "temperature": 0.3, "top_k": -1, "repeat_last_n": 16,
                               "logit_bias": {"5": -2}, "user": "an ignored field"})
    params = body.sampling(LLAMA_CPP_DEFAULTS, vocab_size=100)
    assert (params.temperature, params.top_k, params.penalty_last_n, dict(params.logit_bias)) == (0.3, 0, 16, {5: -2.0})
    assert params.top_p == LLAMA_CPP_DEFAULTS.top_p and params.min_p == LLAMA_CPP_DEFAULTS.min_p


def test_token_budgets() -> None:
    assert parse(ChatRequest, {"messages": MSG}).token_budget() is None           # to the end of the context
    assert parse(ChatRequest, {"messages": MSG, "max_tokens": 5}).token_budget() == 5
    assert parse(ChatRequest, {"messages": MSG, "max_tokens": 5, "max_completion_tokens": 7}).token_budget() == 7
    assert parse(CompletionRequest, {"prompt": "x"}).token_budget() == 16


def test_text_parts_are_joined_and_developer_is_system() -> None:
    body = parse(ChatRequest, {"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]}]})
    assert template_messages(body) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b"}]


def test_prompt_forms() -> None:
    assert parse(CompletionRequest, {"prompt": ["one"]}).prompt == "one"
    assert parse(CompletionRequest, {"prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    for bad in ({"prompt": ["a", "b"]}, {"prompt": []}, {}, {"prompt": "x", "echo": True},
                {"prompt": "x", "best_of": 3}, {"prompt": "x", "suffix": "y"}):
        with pytest.raises(APIError) as err:
            parse(CompletionRequest, bad)
        assert err.value.status == 400 and err.value.param


@pytest.mark.parametrize("body,param", [
    ({"messages": MSG, "temperature": float("inf")}, "temperature"),
    ({"messages": MSG, "stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
    ({"messages": [{"content": "no role"}]}, "messages[0].role"),
    ({"messages": MSG, "logit_bias": {"3": 500}}, "logit_bias"),
])
def test_invalid_values_name_their_field(body: dict, param: str) -> None:
    with pytest.raises(APIError) as err:
        parse(ChatRequest, body)
    assert (err.value.status, err.value.param) == (400, param)
    assert err.value.body()["error"]["type"] == "invalid_request_error"


def test_top_logprobs_needs_logprobs_and_logit_bias_needs_real_tokens() -> None:
    with pytest.raises(APIError, match="top_logprobs"):
        parse(ChatRequest, {"messages": MSG, "top_logprobs": 3}).logprobs_count()
    assert parse(ChatRequest, {"messages": MSG, "logprobs": True}).logprobs_count() == 0
    assert parse(ChatRequest, {"messages": MSG}).logprobs_count() is None
    with pytest.raises(APIError, match="logit_bias"):
        parse(ChatRequest, {"messages": MSG, "logit_bias": {"100": 1}}).sampling(LLAMA_CPP_DEFAULTS, vocab_size=100)


def test_a_body_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(APIError, match="JSON object"):
        parse(ChatRequest, ["messages"])
