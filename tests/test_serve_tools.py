"""Agent clients against ``serve``: tool-calling loops, JSON-schema answers and thinking, through the official
``openai`` client, on tiny fixtures of each family that carry their model's real chat template.

The fixtures' weights are random, so a model never calls a tool of its own
accord: ``tool_choice`` "required" (or a named function) makes the grammar
write the call in the template's own syntax, which the server must then parse
back into OpenAI ``tool_calls``; the tool's result goes back through the
template, and the final answer is free text.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from colibri_aio.serve.launch import ServerProcess
from support import FIXTURES, fixture, rewrite_gguf

sys.path.insert(0, str(FIXTURES))
from json_schemas import SCHEMAS  # noqa: E402

TEMPLATES = FIXTURES / "templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# A random model never ends its thinking by itself: where the template opens the span (MiniMax-M2's,
# DeepSeek-R1's), the budget closes it and the call follows; elsewhere it changes nothing.
BUDGET = {"reasoning_budget": 16}

# (fixture, the model's real template, what the parser must be): each family whose template calls tools.
FAMILIES = {
    "qwen3": ("qwen3moeyarn_q8_0.gguf", "Qwen-Qwen3-0.6B.jinja"),
    "qwen3next": ("qwen3next_q8_0.gguf", "Qwen-Qwen3-0.6B.jinja"),
    "qwen2moe": ("qwen2moe_q8_0.gguf", "Qwen-Qwen2.5-7B-Instruct.jinja"),
    "glm45": ("glm4moe_q8_0.gguf", "GLM-4.6.jinja"),
    "deepseek": ("deepseek2_q8_0.gguf", "deepseek-ai-DeepSeek-V3.1.jinja"),
    "gptoss": ("gptoss_mxfp4.gguf", "openai-gpt-oss-120b.jinja"),
    "mistral": ("mixtral_q8_0.gguf", "mistralai-Mistral-Nemo-Instruct-2407.jinja"),
    "minimax": ("minimaxm2_q8_0.gguf", "MiniMax-M2.jinja"),
    "llama4": ("llama4_q8_0.gguf", "vllm-llama4-pythonic.jinja"),   # pythonic calls: [get_weather(city="…")]
    # the model's own template: <|python_start|><|python_end|>{"name": "get_weather", "parameters": {…}}
    "llama4json": ("llama4_q8_0.gguf", "meta-llama-Llama-4-Scout-17B-16E-Instruct.jinja"),
}


def with_template(stem: str, template: str, tmp: Path) -> Path:
    """A copy of a family fixture whose chat template is its model's real one, and a context long enough for
    the tools' descriptions in a 512-token vocabulary."""
    import gguf

    source = (TEMPLATES / template).read_text()
    arch = gguf.GGUFReader(fixture(stem)).fields["general.architecture"].contents()
    return rewrite_gguf(fixture(stem), tmp / f"{Path(stem).stem}-{Path(template).stem}.gguf",
                        keys={"tokenizer.chat_template": source, f"{arch}.context_length": 4096})


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_server(request, tmp_path_factory) -> Iterator[ServerProcess]:
    stem, template = FAMILIES[request.param]
    model = with_template(stem, template, tmp_path_factory.mktemp(request.param))
    with ServerProcess("--model", str(model), "--ctx", "4096") as s:
        yield s


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)


def _check_call(name: str, arguments: str) -> dict:
    tool = {"get_weather": WEATHER, "get_time": TIME}[name]
    args = json.loads(arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def _streamed(stream) -> tuple[str, str, list[dict], str | None]:
    """(content, reasoning, tool calls, finish_reason) gathered from a chat stream's deltas."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for c in delta.tool_calls or ():
            call = calls.setdefault(c.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += c.id or ""
            call["name"] += (c.function.name or "") if c.function else ""
            call["arguments"] += (c.function.arguments or "") if c.function else ""
        finish = choice.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


def test_a_tool_calling_loop_through_the_models_own_template(family_server: ServerProcess) -> None:
    client = _client(family_server)
    first = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200, temperature=0,
                                           extra_body=BUDGET)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name in ("get_weather", "get_time")
    _check_call(call.function.name, call.function.arguments)
    # The call and its result go back through the template; the answer is text.
    history = [*ASK, {"role": "assistant", "content": choice.message.content,
                      "tool_calls": [call.model_dump(exclude_none=True)]},
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    final = client.chat.completions.create(model="m", messages=history, tools=[WEATHER, TIME], tool_choice="none",
                                           max_tokens=8, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length")
    assert not final.choices[0].message.tool_calls
    assert isinstance(final.choices[0].message.content, str)


def test_a_named_function_call_streams_as_tool_call_deltas(family_server: ServerProcess) -> None:
    client = _client(family_server)
    stream = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME],
                                            tool_choice={"type": "function", "function": {"name": "get_time"}},
                                            max_tokens=200, temperature=0.8, seed=3, stream=True, extra_body=BUDGET)
    content, _, calls, finish = _streamed(stream)
    assert finish == "tool_calls"
    assert [c["name"] for c in calls] == ["get_time"] * len(calls) and calls
    for c in calls:
        assert c["id"]
        _check_call(c["name"], c["arguments"])


def test_tools_with_the_automatic_choice_are_accepted(family_server: ServerProcess) -> None:
    """Every family's template has a tool syntax the server reads, so offering tools is never refused; whatever
    the random model writes comes back as content or as calls of the offered tools."""
    choice = _client(family_server).chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME],
                                                            max_tokens=8, temperature=0).choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    for call in choice.message.tool_calls or ():
        assert call.function.name in ("get_weather", "get_time")


def test_stream_and_whole_answer_agree(family_server: ServerProcess) -> None:
    client = _client(family_server)
    options = dict(model="m", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=200, temperature=0,
                   parallel_tool_calls=False, extra_body=BUDGET)
    whole = client.chat.completions.create(**options).choices[0].message
    _, _, calls, _ = _streamed(client.chat.completions.create(**options, stream=True))
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls] == \
        [(c["name"], json.loads(c["arguments"])) for c in calls]


# --- JSON-schema answers from the shipped model -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_server() -> Iterator[ServerProcess]:
    with ServerProcess() as s:
        yield s


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_answers_validate_every_time(tiny_server: ServerProcess, name: str) -> None:
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    client = _client(tiny_server)
    for seed, stream in ((0, False), (1, True)):
        options = dict(model="m", messages=ASK, response_format=fmt, max_tokens=400, temperature=1.0, seed=seed)
        if stream:
            text, _, _, finish = _streamed(client.chat.completions.create(**options, stream=True))
        else:
            choice = client.chat.completions.create(**options).choices[0]
            text, finish = choice.message.content, choice.finish_reason
        assert finish == "stop", (name, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_gives_an_object_or_says_it_was_cut(tiny_server: ServerProcess) -> None:
    """No schema bounds a json_object, and a random model rarely closes one: an answer that ends ("stop") is an
    object; one the budget cut says "length" (as OpenAI's does)."""
    ended = 0
    for seed in range(6):
        choice = _client(tiny_server).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=300, temperature=1, seed=seed,
            response_format={"type": "json_object"}).choices[0]
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
            ended += 1
        else:
            assert choice.message.content.startswith("{")
    assert ended


def test_a_schema_the_grammar_cannot_compile_is_a_400_naming_it(tiny_server: ServerProcess) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                  "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}
    with pytest.raises(openai.BadRequestError, match="response_format"):
        _client(tiny_server).chat.completions.create(model="m", messages=ASK, max_tokens=8, response_format=fmt)


def test_a_json_answer_from_gpt_oss_is_written_in_its_final_channel(tmp_path: Path) -> None:
    """gpt-oss answers in harmony's final channel: the grammar writes the channel's markers (special tokens) before
    the JSON, and the parser hands back only the JSON as content."""
    from colibri_aio.engine.sync import SyncEngine
    from colibri_aio.serve.chat_flow import plan_chat
    from colibri_aio.serve.requests import ChatRequest, parse
    from colibri_aio.serve.responses import ChatShape
    from colibri_aio.serve.session import Session

    schema = SCHEMAS[sorted(SCHEMAS)[0]]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    with SyncEngine.open(with_template(*FAMILIES["gptoss"], tmp_path), n_ctx=2048) as engine:
        session = Session(engine)
        plan = plan_chat(session, parse(ChatRequest, {"messages": ASK, "response_format": fmt}))
        pieces = list(engine.generate(plan.ids, max_tokens=400, constraint=plan.constraint, special=plan.special,
                                      temperature=0))
        choice = ChatShape("m", session.tokenizer, plan.parser).response(pieces, False)["choices"][0]
    assert "".join(p.text for p in pieces).startswith("<|channel|>final<|message|>")
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_tools_for_a_template_without_tool_syntax_are_a_400(tiny_server: ServerProcess) -> None:
    """The shipped model's template does not render tools: offering them would be silently dropped."""
    client = _client(tiny_server)
    for choice in ("auto", "required"):
        with pytest.raises(openai.BadRequestError, match="tool") as info:
            client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice=choice, max_tokens=4)
        assert info.value.status_code == 400
    r = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")
