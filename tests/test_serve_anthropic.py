"""Anthropic's Messages API: the translation to and from the chat path, then the official ``anthropic`` client
against a real ``serve`` process on 127.0.0.1 with the shipped model."""
from __future__ import annotations

import concurrent.futures
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from colibri_aio.serve.anthropic import (CountTokensRequest, MessagesRequest, StreamTranslator, parse_request,
                                         stop_reason, to_chat, to_message)
from colibri_aio.serve.errors import APIError
from colibri_aio.serve.launch import ServerProcess
from support import fixture, rewrite_gguf

BASE = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}
WEATHER = {"name": "get_weather", "description": "The weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"], "additionalProperties": False}}


def refusal(body: dict[str, Any], model: type = MessagesRequest) -> str:
    with pytest.raises(APIError) as info:
        to_chat(parse_request(model, body))
    assert info.value.status == 400
    return info.value.message


def chat_of(**fields: Any) -> Any:
    return to_chat(parse_request(MessagesRequest, {**BASE, **fields}))


# --- requests --------------------------------------------------------------------------------------------------------

def test_unknown_fields_are_refused_by_name_wherever_they_stand() -> None:
    assert refusal({**BASE, "top_a": 1}) == "top_a: unknown field (this server does not implement it)"
    text = {"role": "user", "content": [{"type": "text", "text": "a", "colour": "red"}]}
    assert refusal({**BASE, "messages": [text]}).startswith("messages[0].content[0].colour: unknown field")
    nested = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                           "content": [{"type": "text", "text": "r", "score": 1}]}]}
    assert refusal({**BASE, "messages": [nested]}).startswith("messages[0].content[0].content[0].score: unknown")
    assert refusal({**BASE, "tools": [{**WEATHER, "examples": []}]}).startswith("tools[0].examples: unknown field")


def test_accepted_and_ignored_fields_change_nothing() -> None:
    plain = chat_of(system="Be brief.")
    marked = chat_of(system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
                     metadata={"user_id": "u1"}, service_tier="auto", cache_control={"type": "ephemeral"})
    assert [m.text() for m in plain.messages] == [m.text() for m in marked.messages] == ["Be brief.", "Hi"]


def test_missing_and_bad_values_name_their_field() -> None:
    assert refusal({k: v for k, v in BASE.items() if k != "max_tokens"}) == "max_tokens: required"
    assert refusal({**BASE, "max_tokens": 0}).startswith("max_tokens: ")
    assert refusal({**BASE, "messages": [{"role": "system", "content": "x"}]}).startswith("messages[0].role: ")
    assert refusal({**BASE, "thinking": {"type": "enabled"}}) == "thinking.budget_tokens: required"
    assert refusal({**BASE, "tool_choice": {"type": "sometimes"}}).startswith(
        "tool_choice: type 'sometimes' is not one of 'auto', 'any', 'tool', 'none'")
    assert refusal({**BASE, "tool_choice": {"name": "x"}}) == "tool_choice.type: required"
    assert refusal({**BASE, "stop_sequences": [""]}) == "stop_sequences: stop sequences must not be empty strings"
    assert refusal({**BASE, "messages": [{"role": "user", "content": []}]}) == \
        "messages[0].content: a message needs at least one block"


def test_lists_are_capped_as_the_chat_route_caps_them() -> None:
    assert refusal({**BASE, "stop_sequences": ["x"] * 65}) == "stop_sequences: at most 64 items, got 65"
    assert refusal({**BASE, "messages": BASE["messages"] * 4097}) == "messages: at most 4096 items, got 4097"
    many = [{"type": "text", "text": "a"}] * 257
    assert refusal({**BASE, "messages": [{"role": "user", "content": many}]}) == \
        "messages[0].content: at most 256 items, got 257"
    tools = [{**WEATHER, "name": f"tool_{i}"} for i in range(129)]
    assert refusal({**BASE, "tools": tools}) == "tools: at most 128 items, got 129"


def test_images_documents_and_server_tools_are_refused_in_one_line() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    msg = refusal({**BASE, "messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, image]}]})
    assert msg == ("messages[0].content[1]: image blocks are not supported; this server reads text, tool_use, "
                   "tool_result, thinking blocks")
    doc = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "document"}]}]}
    assert refusal({**BASE, "messages": [doc]}).startswith("messages[0].content[0].content[0]: document blocks")
    assert refusal({**BASE, "system": [{"type": "image"}]}).startswith("system[0]: image blocks are not supported")
    search = {"type": "web_search_20250305", "name": "web_search"}
    assert "server tool" in refusal({**BASE, "tools": [search]})


def test_tool_choice_must_name_a_declared_tool() -> None:
    assert refusal({**BASE, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_time"}}) == \
        "tool_choice.name: no tool is named 'get_time'"
    assert refusal({**BASE, "tool_choice": {"type": "any"}}) == "tool_choice: type 'any' needs tools"
    assert refusal({**BASE, "tools": [WEATHER, WEATHER]}) == "tools: tool names must be unique"


def test_a_conversation_must_end_with_the_user() -> None:
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is ("}]
    assert "continuing an assistant message is not supported" in refusal({**BASE, "messages": turns})


def test_blocks_in_the_wrong_role_are_refused() -> None:
    use = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}
    assert refusal({**BASE, "messages": [{"role": "user", "content": [use]}]}) == \
        "messages[0].content[0]: tool_use blocks belong in assistant messages"
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [result]},
             {"role": "user", "content": "ok"}]
    assert refusal({**BASE, "messages": turns}) == "messages[1].content[0]: tool_result blocks belong in user messages"


# --- translation to the chat request ---------------------------------------------------------------------------------

def test_a_tool_round_trip_becomes_tool_calls_and_tool_messages_in_order() -> None:
    turns = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Two cities.", "signature": ""},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "Here you go."},
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "no data"}],
             "is_error": True}]},
    ]
    chat = chat_of(messages=turns, tools=[WEATHER], system="You check weather.")
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "user"]
    assistant = chat.messages[2]
    assert assistant.text() == "Checking." and assistant.reasoning_content == "Two cities."
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in assistant.tool_calls] == \
        [("toolu_1", "get_weather", {"city": "Paris"}), ("toolu_2", "get_weather", {"city": "Rome"})]
    assert [(m.tool_call_id, m.text()) for m in chat.messages[3:5]] == [("toolu_1", "sunny"),
                                                                        ("toolu_2", "Error: no data")]
    assert chat.messages[5].text() == "Here you go."
    (tool,) = chat.tools
    assert tool.function.name == "get_weather" and tool.function.parameters == WEATHER["input_schema"]


def test_a_turn_of_only_tool_results_adds_no_empty_user_message() -> None:
    turns = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "get_weather",
                                                "input": {"city": "Oslo"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "snow"}]}]
    assert [m.role for m in chat_of(messages=turns, tools=[WEATHER]).messages] == ["user", "assistant", "tool"]


def test_tool_choice_and_thinking_map_to_the_chat_options() -> None:
    assert chat_of(tools=[WEATHER], tool_choice={"type": "any"}).tool_choice == "required"
    assert chat_of(tools=[WEATHER], tool_choice={"type": "auto"}).tool_choice == "auto"
    assert chat_of(tools=[WEATHER], tool_choice={"type": "none"}).tool_choice == "none"
    named = chat_of(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather",
                                                  "disable_parallel_tool_use": True})
    assert named.tool_choice.function.name == "get_weather" and named.parallel_tool_calls is False
    assert chat_of(tools=[WEATHER]).parallel_tool_calls is True
    assert chat_of(thinking={"type": "enabled", "budget_tokens": 64}).reasoning_budget == 64
    assert chat_of(thinking={"type": "disabled"}).chat_template_kwargs == {"enable_thinking": False}
    adaptive = chat_of(thinking={"type": "adaptive"})
    assert adaptive.reasoning_budget is None and adaptive.chat_template_kwargs is None


def test_sampling_and_stops_reach_the_chat_request() -> None:
    chat = chat_of(temperature=0.5, top_p=0.9, top_k=40, stop_sequences=["\n\n", "END"], stream=True)
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.top_k) == (16, 0.5, 0.9, 40)
    assert chat.stops() == ("\n\n", "END") and chat.stream and chat.include_usage()
    assert not chat.logprobs  # the chat path names the stop string itself


def test_count_tokens_takes_no_generation_fields() -> None:
    assert refusal({"model": "m", "messages": BASE["messages"], "max_tokens": 5}, CountTokensRequest) == \
        "max_tokens: unknown field (this server does not implement it)"
    chat = to_chat(parse_request(CountTokensRequest, {"model": "m", "messages": BASE["messages"], "tools": [WEATHER]}))
    assert chat.max_tokens is None and len(chat.tools) == 1


# --- translation of the reply ----------------------------------------------------------------------------------------

def completion(message: dict[str, Any], finish: str, stop: str | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "model": "tiny.gguf",
            "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish,
                         "stop_reason": stop, "logprobs": None}],
            "usage": {"prompt_tokens": 30, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 12}}}


def test_a_whole_reply_becomes_thinking_text_and_tool_use_blocks() -> None:
    call = {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    chat = completion({"content": "Let me look.", "reasoning_content": "Oslo it is.", "tool_calls": [call]},
                      "tool_calls")
    msg = to_message(chat, msg_id="msg_1")
    assert msg["content"] == [{"type": "thinking", "thinking": "Oslo it is.", "signature": ""},
                              {"type": "text", "text": "Let me look."},
                              {"type": "tool_use", "id": "call_9", "name": "get_weather", "input": {"city": "Oslo"}}]
    assert (msg["id"], msg["type"], msg["role"], msg["model"]) == ("msg_1", "message", "assistant", "tiny.gguf")
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("tool_use", None)
    assert msg["usage"] == {"input_tokens": 18, "output_tokens": 7, "cache_creation_input_tokens": 0,
                            "cache_read_input_tokens": 12}
    assert to_message(chat, msg_id="m", show_thinking=False)["content"][0]["thinking"] == ""


def test_finish_reasons_map_to_stop_reasons() -> None:
    assert to_message(completion({"content": "abc"}, "length"), msg_id="m")["stop_reason"] == "max_tokens"
    assert to_message(completion({"content": "abc"}, "stop"), msg_id="m")["stop_reason"] == "end_turn"
    assert to_message(completion({"content": None}, "stop"), msg_id="m")["content"] == []


def test_the_stop_sequence_is_the_one_the_chat_path_names() -> None:
    hit = to_message(completion({"content": "Hel"}, "stop", stop="lo"), msg_id="m")
    assert (hit["stop_reason"], hit["stop_sequence"]) == ("stop_sequence", "lo")
    assert stop_reason({"finish_reason": "stop", "stop_reason": None}) == ("end_turn", None)
    assert stop_reason({"finish_reason": "length", "stop_reason": None}) == ("max_tokens", None)
    assert stop_reason({"finish_reason": "tool_calls"}) == ("tool_use", None)


def test_tool_arguments_that_are_not_an_object_are_an_error() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}
    with pytest.raises(APIError, match="not a JSON object") as info:
        to_message(completion({"tool_calls": [call]}, "tool_calls"), msg_id="m")
    assert info.value.status == 500


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish, **extra}]}


def test_stream_chunks_become_block_events_in_order() -> None:
    t = StreamTranslator(msg_id="msg_1", model="tiny.gguf")
    start = t.start(18, 12)
    assert [name for name, _ in start] == ["message_start", "ping"]
    assert start[0][1]["message"]["usage"]["cache_read_input_tokens"] == 12
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                         "arguments": '{"city":"Oslo"}'}}
    chunks = [chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "Hm"}),
              chunk({"reasoning_content": "m."}), chunk({"content": "Ok"}), chunk({"content": "."}),
              chunk({"tool_calls": [call]}), chunk({"tool_calls": [{**call, "index": 1, "id": "call_2"}]}),
              chunk(finish="tool_calls"),
              {"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 9}}]
    events = [e for c in chunks for e in t.chunk(c)]
    assert [(n, p.get("index")) for n, p in events] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_stop", 2),
        ("content_block_start", 3), ("content_block_delta", 3), ("content_block_stop", 3),
        ("message_delta", None), ("message_stop", None)]
    assert events[0][1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert [p["delta"] for n, p in events[1:3]] == [{"type": "thinking_delta", "thinking": "Hm"},
                                                    {"type": "thinking_delta", "thinking": "m."}]
    assert events[8][1]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}
    assert events[9][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"city":"Oslo"}'}
    assert events[14][1] == {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                             "usage": {"input_tokens": 30, "output_tokens": 9, "cache_creation_input_tokens": 0,
                                       "cache_read_input_tokens": 0}}
    assert t.done


def test_a_stream_names_its_stop_sequence_from_the_last_chunk() -> None:
    t = StreamTranslator(msg_id="m", model="x")
    events = t.chunk(chunk({"content": "Hi"})) + t.chunk(chunk({}, "stop", stop_reason="\n\n"))
    events += t.chunk({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "\n\n"}


def test_an_error_chunk_is_an_error_event_and_the_end() -> None:
    t = StreamTranslator(msg_id="m", model="x")
    t.chunk(chunk({"content": "Hi"}))
    body = {"error": {"message": "the server is shutting down", "type": "server_error", "code": "shutting_down"}}
    assert t.chunk(body) == [("error", {"type": "error", "error": {"type": "overloaded_error",
                                                                    "message": "the server is shutting down"}})]
    assert t.done


# --- the official client against serve -------------------------------------------------------------------------------

KEY = "test-key-5678"
GREEDY = {"temperature": 0}  # the client no longer types sampling options: they go as extra body fields
ASK = [{"role": "user", "content": "What is a list in Python?"}]
TEMPLATES = Path(__file__).resolve().parent.parent / "fixtures" / "templates"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """The shipped model, a key, and one request waiting at most."""
    with ServerProcess("--api-key", KEY, "--max-queue", "0") as s:
        yield s
    assert s.stop() == 143, "".join(s.log)
    assert not any("Traceback" in line for line in s.log), "".join(s.log)


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A Qwen3 fixture carrying Qwen3's real chat template (tool calls in ``<tool_call>`` JSON), with room for the
    tools the template writes into the prompt (the fixture's own context is 128)."""
    template = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
    model = rewrite_gguf(fixture("qwen3moeyarn_q8_0.gguf"), tmp_path_factory.mktemp("qwen3") / "qwen3-tools.gguf",
                         keys={"tokenizer.chat_template": template, "qwen3moe.context_length": 2048})
    with ServerProcess("--model", str(model)) as s:
        yield s


@pytest.fixture()
def client(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def _post(server: ServerProcess, path: str, body: Any, **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with httpx.Client(base_url=server.url, timeout=120) as h:
        return h.post(path, content=content, headers={"x-api-key": KEY, "anthropic-version": "2023-06-01",
                                                      "content-type": "application/json", **headers})


def test_a_message_has_anthropics_shape_and_its_usage_counts_the_prompt(client: anthropic.Anthropic) -> None:
    msg = client.messages.create(model="claude-any", max_tokens=8, system="You explain Python.", messages=ASK,
                                 metadata={"user_id": "u-1"}, extra_body=GREEDY)
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == "colibri-tiny-q8_0.gguf"
    (block,) = msg.content
    assert block.type == "text" and block.text
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None and msg.usage.output_tokens == 8
    counted = client.messages.count_tokens(model="claude-any", system="You explain Python.", messages=ASK)
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == counted.input_tokens
    again = client.messages.create(model="claude-any", max_tokens=8, system="You explain Python.", messages=ASK,
                                   extra_body=GREEDY)
    assert again.content[0].text == block.text
    assert again.usage.cache_read_input_tokens > 0  # the same prompt again: its prefix comes from the KV cache
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == counted.input_tokens


def test_a_stream_carries_the_same_message_as_the_whole_reply(client: anthropic.Anthropic) -> None:
    args = dict(model="m", max_tokens=12, messages=ASK, extra_body=GREEDY)
    whole = client.messages.create(**args)
    with client.messages.stream(**args) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_the_raw_stream_sends_anthropics_events_in_order(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as h, \
            h.stream("POST", "/v1/messages", headers={"x-api-key": KEY},
                     json={"model": "m", "max_tokens": 5, "messages": ASK, "stream": True, **GREEDY}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        frames = [f for f in r.read().decode().split("\n\n") if f.strip()]
    events = []
    for frame in frames:
        fields = dict(line.split(": ", 1) for line in frame.splitlines())
        payload = json.loads(fields["data"])
        assert payload["type"] == fields["event"]  # each event's name is its payload's type
        events.append(payload)
    names = [e["type"] for e in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert events[0]["message"]["content"] == [] and events[0]["message"]["stop_reason"] is None
    assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == 5


def test_a_stop_sequence_ends_the_text_before_it_and_is_named(client: anthropic.Anthropic) -> None:
    args = dict(model="m", max_tokens=24, messages=ASK, extra_body=GREEDY)
    text = client.messages.create(**args).content[0].text
    words = text.split()
    assert len(words) >= 2, text
    stop = words[len(words) // 2]
    msg = client.messages.create(**args, stop_sequences=["never-produced", stop])
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in msg.content) == text[: text.index(stop)]
    with client.messages.stream(**args, stop_sequences=[stop]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text[: text.index(stop)]
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    plain = client.messages.create(**{**args, "max_tokens": 4}, stop_sequences=["never-produced"])
    assert (plain.stop_reason, plain.stop_sequence) == ("max_tokens", None)


def test_bad_requests_are_refused_with_anthropics_error_body(server: ServerProcess, client: anthropic.Anthropic
                                                             ) -> None:
    r = _post(server, "/v1/messages", {"model": "m", "messages": ASK})
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: required"}}
    with pytest.raises(anthropic.BadRequestError) as info:
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
        client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [image]}])
    assert info.value.status_code == 400
    assert info.value.body["error"]["message"].startswith("messages[0].content[0]: image blocks are not supported")
    with pytest.raises(anthropic.BadRequestError, match="top_a: unknown field"):
        client.messages.create(model="m", max_tokens=4, messages=ASK, extra_body={"top_a": 0.1})
    r = _post(server, "/v1/messages", b"not json")
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_refusals_before_the_body_is_read_take_anthropics_shape_too(server: ServerProcess) -> None:
    headers = {"x-api-key": KEY}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        form = http.post("/v1/messages", content=b"{}", headers={**headers, "content-type": "text/plain"})
        wrong_method = http.get("/v1/messages", headers=headers)
    assert (form.status_code, form.json()["type"], form.json()["error"]["type"]) == (
        415, "error", "invalid_request_error")
    assert wrong_method.status_code == 405 and wrong_method.json()["type"] == "error"


def test_the_key_is_taken_as_x_api_key_or_bearer_and_a_wrong_one_is_refused(server: ServerProcess) -> None:
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)
    assert bearer.messages.count_tokens(model="m", messages=ASK).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=4, messages=ASK)
    assert info.value.body == {"type": "error", "error": {"type": "authentication_error", "message": (
        "invalid or missing API key (Authorization: Bearer KEY, or x-api-key: KEY)")}}
    r = _post(server, "/v1/messages/count_tokens", {"model": "m", "messages": ASK}, **{"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_a_full_line_is_a_rate_limit_error_with_retry_after(server: ServerProcess) -> None:
    """No room to wait (--max-queue 0): of requests sent together, one generates, the others get 429 at once."""
    body = {"model": "m", "max_tokens": 200, "messages": ASK, **GREEDY}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: _post(server, "/v1/messages", body), range(4)))
    busy = [r for r in answers if r.status_code == 429]
    assert busy and len(busy) + sum(r.status_code == 200 for r in answers) == 4
    for r in busy:
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "rate_limit_error"


def test_count_tokens_counts_what_the_template_writes(tool_server: ServerProcess) -> None:
    client = anthropic.Anthropic(base_url=tool_server.url, api_key="none", max_retries=0, timeout=300)
    bare = client.messages.count_tokens(model="m", messages=ASK).input_tokens
    with_system = client.messages.count_tokens(model="m", messages=ASK, system="Be brief.").input_tokens
    with_tools = client.messages.count_tokens(model="m", messages=ASK, tools=[WEATHER]).input_tokens
    assert 0 < bare < with_system < with_tools
    with httpx.Client(base_url=tool_server.url) as h:
        rendered = h.post("/tokenize", json={"messages": ASK}).json()["count"]
    assert bare == rendered


def test_a_tool_use_round_trip(tool_server: ServerProcess) -> None:
    """tool_choice any: the grammar writes a call in Qwen3's syntax, which comes back as a tool_use block whose
    input fits the schema; its result goes back as a tool_result, and the answer is text."""
    client = anthropic.Anthropic(base_url=tool_server.url, api_key="none", max_retries=0, timeout=300)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(model="m", max_tokens=200, messages=ask, tools=[WEATHER],
                                   tool_choice={"type": "any"}, extra_body=GREEDY)
    assert first.stop_reason == "tool_use", first
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER["input_schema"])
    history = [*ask, {"role": "assistant", "content": first.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 °C, sunny"}]}]
    final = client.messages.create(model="m", max_tokens=8, messages=history, tools=[WEATHER],
                                   tool_choice={"type": "none"}, extra_body=GREEDY)
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in final.content] == ["text"]
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == client.messages.count_tokens(
        model="m", messages=history).input_tokens  # tool_choice none: the tools are not offered in the prompt


def test_a_named_tool_streams_as_input_json_deltas(tool_server: ServerProcess) -> None:
    client = anthropic.Anthropic(base_url=tool_server.url, api_key="none", max_retries=0, timeout=300)
    options = dict(model="m", max_tokens=200, messages=[{"role": "user", "content": "Weather in Rome?"}],
                   tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    with client.messages.stream(**options) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds and final.stop_reason == "tool_use"
    (use,) = final.content
    jsonschema.validate(use.input, WEATHER["input_schema"])
    whole = client.messages.create(**options)
    assert [(b.name, b.input) for b in whole.content] == [(use.name, use.input)]


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A Qwen3 fixture carrying DeepSeek-R1's chat template, whose prompt opens ``<think>`` for the reply."""
    template = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    model = rewrite_gguf(fixture("qwen3moeyarn_q8_0.gguf"), tmp_path_factory.mktemp("r1") / "qwen3-r1.gguf",
                         keys={"tokenizer.chat_template": template, "qwen3moe.context_length": 1024})
    with ServerProcess("--model", str(model)) as s:
        yield s


def test_thinking_comes_first_in_its_own_block_within_its_budget(thinking_server: ServerProcess) -> None:
    client = anthropic.Anthropic(base_url=thinking_server.url, api_key="none", max_retries=0, timeout=300)
    options = dict(model="m", max_tokens=30, messages=ASK, thinking={"type": "enabled", "budget_tokens": 6},
                   extra_body=GREEDY)
    whole = client.messages.create(**options)
    assert [b.type for b in whole.content] == ["thinking", "text"], whole  # the budget closed the span
    thinking, text = whole.content
    assert thinking.thinking and thinking.signature == "" and "<think>" not in text.text
    with client.messages.stream(**options) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == \
        [("thinking", thinking.thinking), ("text", text.text)]
    assert kinds.index("thinking") < kinds.index("text")
    hidden = client.messages.create(**{**options, "thinking": {"type": "enabled", "budget_tokens": 6,
                                                               "display": "omitted"}})
    assert [(b.type, b.thinking) for b in hidden.content[:1]] == [("thinking", "")]
    # The reply goes back as it came (thinking, signature and all) and the conversation goes on.
    history = [*ASK, {"role": "assistant", "content": whole.content}, {"role": "user", "content": "And a tuple?"}]
    assert client.messages.create(model="m", max_tokens=4, messages=history, extra_body=GREEDY).usage.output_tokens == 4


def test_a_stream_cut_by_shutdown_ends_with_an_error_event() -> None:
    """SIGTERM while a reply streams: the stream's last event is Anthropic's ``error`` (overloaded: the server is
    shutting down), with no ``message_stop``, and the official client raises it."""
    s = ServerProcess().start()
    try:
        client = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0, timeout=60)
        seen = []
        with pytest.raises(anthropic.APIStatusError) as info, \
                client.messages.stream(model="m", max_tokens=230, messages=ASK, extra_body=GREEDY) as stream:
            for event in stream:  # 230 tokens take seconds here: the signal lands mid-stream
                seen.append(event.type)
                if event.type == "message_start":
                    s._proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        assert info.value.body == {"type": "error", "error": {"type": "overloaded_error",
                                                              "message": "the server is shutting down"}}
        assert seen[0] == "message_start" and "message_stop" not in seen
        s._proc.wait(30)  # type: ignore[union-attr]  # it stops by itself: a second signal would cut that short
    finally:
        status = s.stop()
    assert status == 143, "".join(s.log)
    assert not any("Traceback" in line for line in s.log), "".join(s.log)
