"""Thinking kept apart from the answer: ``reasoning_content`` beside ``content``, a thinking budget that closes the
span after N tokens, ``chat_template_kwargs`` reaching the template, on fixtures with real thinking templates."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from colibri_aio.engine.sync import SyncEngine
from colibri_aio.serve.chat_flow import plan_chat
from colibri_aio.serve.launch import ServerProcess
from colibri_aio.serve.requests import ChatRequest, parse
from colibri_aio.serve.session import Session
from test_serve_tools import with_template

ASK = [{"role": "user", "content": "Why is the sky blue?"}]
R1 = ("deepseek2_q8_0.gguf", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja")   # its prompt opens <think>
QWEN3 = ("qwen3moeyarn_q8_0.gguf", "Qwen-Qwen3-0.6B.jinja")                     # the model opens <think> itself


@pytest.fixture(scope="module")
def r1_model(tmp_path_factory) -> Path:
    return with_template(*R1, tmp_path_factory.mktemp("r1"))


@pytest.fixture(scope="module")
def r1_server(r1_model: Path) -> Iterator[ServerProcess]:
    with ServerProcess("--model", str(r1_model), "--ctx", "1024", "--reasoning-budget", "12") as s:
        yield s


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)


def test_thinking_comes_back_apart_from_the_answer(r1_server: ServerProcess) -> None:
    r = _client(r1_server).chat.completions.create(model="m", messages=ASK, max_tokens=40, temperature=0)
    message = r.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    assert message.content and "<think>" not in message.content and "</think>" not in message.content


def test_streamed_thinking_equals_the_whole_reply(r1_server: ServerProcess) -> None:
    client = _client(r1_server)
    whole = client.chat.completions.create(model="m", messages=ASK, max_tokens=40, temperature=0).choices[0].message
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model="m", messages=ASK, max_tokens=40, temperature=0, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
    assert (reasoning, content) == (whole.model_extra["reasoning_content"], whole.content)


def test_a_request_budget_overrides_the_servers(r1_server: ServerProcess) -> None:
    client = _client(r1_server)
    short = client.chat.completions.create(model="m", messages=ASK, max_tokens=40, temperature=0,
                                           extra_body={"reasoning_budget": 2}).choices[0].message
    long = client.chat.completions.create(model="m", messages=ASK, max_tokens=40, temperature=0).choices[0].message
    assert len(short.model_extra["reasoning_content"]) < len(long.model_extra["reasoning_content"])


@pytest.mark.parametrize("budget", [0, 1, 7])
def test_the_budget_closes_thinking_after_exactly_n_tokens(r1_model: Path, budget: int) -> None:
    with SyncEngine.open(r1_model) as engine:
        session = Session(engine)
        body = parse(ChatRequest, {"messages": ASK, "reasoning_budget": budget})
        plan = plan_chat(session, body)
        assert plan.parser.in_reasoning
        tokens = [p.token for p in engine.generate(plan.ids, max_tokens=budget + 8, constraint=plan.constraint,
                                                   special=plan.special)]
        close = session.tokenizer.encode("</think>", parse_special=True)
        assert tokens[budget:budget + len(close)] == close
        assert all(session.tokenizer.decode([t]) != "</think>" for t in tokens[:budget])


def test_template_kwargs_reach_the_template(tmp_path: Path) -> None:
    with SyncEngine.open(with_template(*QWEN3, tmp_path), n_ctx=1024) as engine:
        session = Session(engine)
        off = plan_chat(session, parse(ChatRequest, {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}))
        on = plan_chat(session, parse(ChatRequest, {"messages": ASK}))
    assert off.prompt.endswith("<think>\n\n</think>\n\n") and not on.prompt.endswith("</think>\n\n")
    assert not off.parser.in_reasoning


@pytest.mark.parametrize("kwargs, message", [
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs: 'messages' is set by the server"),
    ({"tool_choice": "required"}, "tool_choice: \"required\" needs tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
])
def test_bad_options_are_a_400_naming_the_field(r1_server: ServerProcess, kwargs: dict, message: str) -> None:
    with pytest.raises(openai.BadRequestError, match=message.replace("(", r"\(")):
        _client(r1_server).chat.completions.create(model="m", messages=ASK, max_tokens=4, extra_body=kwargs)


def test_reasoning_effort_reaches_gpt_oss_template(tmp_path: Path) -> None:
    with SyncEngine.open(with_template("gptoss_mxfp4.gguf", "openai-gpt-oss-120b.jinja", tmp_path), n_ctx=1024) as e:
        session = Session(e)
        high = plan_chat(session, parse(ChatRequest, {"messages": ASK, "reasoning_effort": "high"}))
        default = plan_chat(session, parse(ChatRequest, {"messages": ASK}))
    assert "Reasoning: high" in high.prompt and "Reasoning: medium" in default.prompt
    assert session.syntax.name == "harmony" and high.special
