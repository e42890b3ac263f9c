"""Request bodies read strictly and within bounds: unknown fields, caps, nesting, and the guard in front of the
routes (Host, Content-Type, body size and pace). The whole server under the same inputs: test_serve_abuse.py."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from colibri_aio.serve.errors import APIError
from colibri_aio.serve.guard import HostAllowList, Limits, RequestGuard
from colibri_aio.serve.requests import (MAX_DEPTH, MAX_MESSAGES, MAX_TOKEN_IDS, ChatRequest, CompletionRequest, load_json, parse,
                                       parse_json)

MSG = [{"role": "user", "content": "hi"}]


def _refusal(body: object, model: type = ChatRequest) -> APIError:
    with pytest.raises(APIError) as err:
        parse_json(model, json.dumps(body).encode())
    assert err.value.status == 400 and "\n" not in err.value.message
    return err.value


# --- no field silently dropped ----------------------------------------------------------------------------------

@pytest.mark.parametrize("body,param", [
    ({"messages": MSG, "foo": 1}, "foo"),
    ({"messages": [{"role": "user", "content": "hi", "foo": 2}]}, "messages[0].foo"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "bar": 1}]}]},
     "messages[0].content[0].bar"),
    ({"messages": MSG, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "strictly": True}}]},
     "tools[0].function.strictly"),
    ({"messages": MSG, "mirostat": 2}, "mirostat"),            # llama-server's sampler: changes the answer
    ({"messages": MSG, "min_tokens": 5}, "min_tokens"),         # vLLM's
])
def test_an_unknown_field_is_a_400_naming_it(body: dict, param: str) -> None:
    err = _refusal(body)
    assert (err.param, err.message) == (param, f"{param}: unknown field")


def test_fields_that_change_nothing_here_are_accepted() -> None:
    body = parse(ChatRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a",
                                                                          "cache_control": {"type": "ephemeral"}}]}],
                               "user": "u1", "store": True, "metadata": {"a": "b"}, "service_tier": "auto",
                               "prediction": {"type": "content", "content": "x"}, "prompt_cache_key": "k",
                               "stream_options": {"include_usage": True, "include_obfuscation": False},
                               "modalities": ["text"]})
    assert body.messages[0].text() == "a" and body.stream_options.include_usage
    assert parse(CompletionRequest, {"prompt": "x", "user": "u1"}).prompt == "x"


def test_fields_not_implemented_pass_only_empty() -> None:
    # What the openai SDK's own reply object holds when it is sent back as the next turn.
    reply = {"role": "assistant", "content": "x", "refusal": None, "annotations": [], "audio": None,
             "function_call": None, "tool_calls": [{"id": "c1", "index": 0, "type": "function",
                                                    "function": {"name": "f", "arguments": "{}"}}]}
    assert parse(ChatRequest, {"messages": [*MSG, reply], "audio": None, "functions": []}).messages[1].content == "x"
    for body, param in [({"messages": MSG, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
                        ({"messages": MSG, "web_search_options": {"search_context_size": "low"}}, "web_search_options"),
                        ({"messages": MSG, "functions": [{"name": "f"}]}, "functions"),
                        ({"messages": [{**reply, "refusal": "I will not"}]}, "messages[0].refusal")]:
        err = _refusal(body)
        assert (err.param, err.message) == (param, f"{param}: not supported by this server")
    assert _refusal({"messages": MSG, "n": 2}).param == "n"
    assert _refusal({"messages": MSG, "modalities": ["text", "audio"]}).param == "modalities[1]"


def test_a_content_part_other_than_text_is_named() -> None:
    err = _refusal({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert err.param == "messages[0].content[0]" and "image_url" in err.message and "only text" in err.message


def test_tokenize_bodies_are_strict_too() -> None:
    from colibri_aio.serve.app import DetokenizeRequest, TokenizeRequest

    assert parse(TokenizeRequest, {"content": "x", "model": "m"}).content == "x"   # vLLM's clients name the model
    for body, param in [({"messages": []}, "messages"), ({"content": "x", "add_bos": True}, "add_bos")]:
        with pytest.raises(APIError) as err:
            parse(TokenizeRequest, body)
        assert err.value.param == param
    with pytest.raises(APIError) as err:
        parse(DetokenizeRequest, {"tokens": [1] * (MAX_TOKEN_IDS + 1)})
    assert err.value.param == "tokens"


# --- caps and malformed values --------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("messages", MSG * (MAX_MESSAGES + 1)),
    ("stop", [f"s{i}" for i in range(10_000)]),
    ("stop", "x" * 5000),
    ("logit_bias", {str(i): 1 for i in range(10_000)}),
    ("tools", [{"type": "function", "function": {"name": f"f{i}"}} for i in range(1000)]),
])
def test_lists_past_their_cap_are_refused_by_name(field: str, value: object) -> None:
    body = {"messages": MSG, field: value}
    assert _refusal(body).param == field


def test_caps_inside_messages_and_prompts() -> None:
    parts = [{"type": "text", "text": "a"}] * 1000
    assert _refusal({"messages": [{"role": "user", "content": parts}]}).param == "messages[0].content"
    assert _refusal({"prompt": [1] * (MAX_TOKEN_IDS + 1)}, CompletionRequest).param == "prompt"


@pytest.mark.parametrize("key", ["²", "١٢", "3.0", "", " 5", "1e3", "9" * 40])
def test_logit_bias_keys_must_be_ascii_token_ids(key: str) -> None:
    err = _refusal({"messages": MSG, "logit_bias": {key: 1}})
    assert err.param == "logit_bias" and "token ids" in err.message


def test_deep_json_is_a_400_not_a_crash() -> None:
    for raw in (b"[" * 100_000, b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"):
        for decode in (lambda r: parse_json(ChatRequest, r), load_json):
            with pytest.raises(APIError, match="nested too deeply"):
                decode(raw)
    nested: object = "leaf"
    for _ in range(MAX_DEPTH + 1):
        nested = {"a": nested}
    err = _refusal({"messages": MSG, "chat_template_kwargs": {"x": nested}})
    assert err.param == "chat_template_kwargs" and f"{MAX_DEPTH} levels" in err.message
    with pytest.raises(APIError, match=f"more than {MAX_DEPTH} levels"):
        load_json(json.dumps({"x": nested}).encode())
    shallow = {"messages": MSG, "chat_template_kwargs": {"x": {"a": {"b": [1, [2, [3]]]}}}}
    assert parse_json(ChatRequest, json.dumps(shallow).encode()).chat_template_kwargs["x"]["a"]["b"][1] == [2, [3]]


@pytest.mark.parametrize("raw,message", [
    (b'{"messages": ', "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "temperature: .*finite"),
    (b"[1, 2]", "must be a JSON object"),
    (b'"text"', "must be a JSON object"),
])
def test_a_body_that_is_no_json_object_is_refused(raw: bytes, message: str) -> None:
    with pytest.raises(APIError, match=message) as err:
        parse_json(ChatRequest, raw)
    assert err.value.status == 400


# --- the guard ------------------------------------------------------------------------------------------------------

async def _echo(request: Request) -> JSONResponse:
    body = await request.body()
    return JSONResponse({"size": len(body), "head": body[:20].decode(errors="replace")})


def _client(limits: Limits) -> httpx.AsyncClient:
    app = RequestGuard(Starlette(routes=[Route("/echo", _echo, methods=["GET", "POST"])]), limits)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost")


async def _chunks(n: int, size: int, pause: float = 0.0) -> AsyncIterator[bytes]:
    for _ in range(n):
        if pause:
            await asyncio.sleep(pause)
        yield b" " * size


JSON = {"Content-Type": "application/json"}


@pytest.mark.asyncio
async def test_the_body_is_handed_on_whole_within_the_limit() -> None:
    async with _client(Limits(max_body=1000)) as c:
        r = await c.post("/echo", content=b'{"a": 1}' + b" " * 992, headers=JSON)
        assert r.status_code == 200 and r.json() == {"size": 1000, "head": '{"a": 1}' + " " * 12}
        assert (await c.post("/echo", content=_chunks(10, 100), headers=JSON)).json()["size"] == 1000
        assert (await c.get("/echo")).status_code == 200  # no body, no Content-Type needed


@pytest.mark.asyncio
async def test_a_body_past_the_limit_is_413_declared_or_not() -> None:
    async with _client(Limits(max_body=1000)) as c:
        declared = await c.post("/echo", content=b" " * 1001, headers=JSON)
        streamed = await c.post("/echo", content=_chunks(100, 100), headers=JSON)
    for r in (declared, streamed):
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
        assert r.headers["connection"] == "close"
    assert "1000 bytes" in declared.json()["error"]["message"]


@pytest.mark.asyncio
async def test_a_body_that_trickles_past_the_read_timeout_is_408() -> None:
    async with _client(Limits(read_timeout=0.3)) as c:
        r = await c.post("/echo", content=_chunks(100, 1, pause=0.05), headers=JSON)
    assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"


@pytest.mark.asyncio
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None])
async def test_a_body_that_is_not_json_is_415(content_type: str | None) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    async with _client(Limits()) as c:
        r = await c.post("/echo", content=b'{"prompt": "x"}', headers=headers)
        ok = await c.post("/echo", content=b"{}", headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    assert ok.status_code == 200


@pytest.mark.parametrize("host,allowed", [
    ("localhost:8080", True), ("LOCALHOST.", True), ("127.0.0.1:8080", True), ("[::1]:8080", True),
    ("10.1.2.3", True), ("app.localhost", True), ("box.lan:8080", True), ("extra.example", True),
    ("evil.example", False), ("localhost.evil.example", False), ("box.lan.evil.example", False), ("", False),
])
def test_the_host_allow_list(host: str, allowed: bool) -> None:
    hosts = HostAllowList.for_server("box.lan", ["Extra.Example"])
    assert hosts.allows(host) is allowed
    assert hosts.allows(None) and HostAllowList.for_server("127.0.0.1", ["*"]).allows("evil.example")


@pytest.mark.asyncio
async def test_a_host_not_allowed_is_421_before_the_body_is_read() -> None:
    async with _client(Limits(hosts=HostAllowList.for_server("127.0.0.1"))) as c:
        refused = await c.post("/echo", content=b" " * 10, headers={**JSON, "Host": "rebind.evil.example"})
        answered = await c.get("/echo", headers={"Host": "localhost:8080"})
    assert refused.status_code == 421 and refused.json()["error"]["code"] == "host_not_allowed"
    assert "--allowed-hosts" in refused.json()["error"]["message"]
    assert answered.status_code == 200
    async with _client(Limits(hosts=None)) as c:  # a key is set: any Host
        assert (await c.get("/echo", headers={"Host": "rebind.evil.example"})).status_code == 200


# --- the command line -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,env,message", [
    (["--api-key", ""], {}, "API key is empty"),
    ([], {"COLIBRI_API_KEY": ""}, "API key is empty"),
    (["--max-body", "lots"], {}, "--max-body"),
    (["--max-body", "0"], {}, "--max-body"),
    (["--read-timeout", "0"], {}, "--read-timeout"),
    (["--max-connections", "0"], {}, "--max-connections"),
    (["--ray", "--allowed-hosts", "a.example"], {}, "--allowed-hosts"),
])
def test_serve_refuses_a_bad_limit_in_one_line(args: list[str], env: dict[str, str], message: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from support import main_in_process

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    status, _, err = main_in_process("serve", "--port", "0", *args)
    assert status == 2 and len(err.strip().splitlines()) == 1 and message in err, err
