"""Llama 4's JSON tool calls, through the template shipped with Llama-4-Scout/Maverick
(fixtures/templates/meta-llama-Llama-4-Scout-17B-16E-Instruct.jinja): turns it renders are read back exactly, fed
whole, in random pieces and one character at a time; the layouts the models write besides (calls inside the
python tags, calls alone) are read too; markup that is not calls stays content; the forced-call grammar writes the
template's own layout, which the parser reads back, held to each function's schema."""
from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from colibri_aio.text.chat_template import ChatTemplate
from colibri_aio.text.replies import chat_syntax
from colibri_aio.text.replies.llama4_json import PYTHON_END, PYTHON_START, Llama4JsonSyntax, read_call
from colibri_aio.text.template_form import TemplateForm, assistant_message, probe_template_form, tool_message

from support import FIXTURES
from test_text_replies import BYTES, CALLS, TOOLS, accepts, assert_calls, pieces, run

SOURCE = (FIXTURES / "templates" / "meta-llama-Llama-4-Scout-17B-16E-Instruct.jinja").read_text()
SYNTAX = chat_syntax(SOURCE)
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
CONTENT = "Let me look that up."
END = "<|eot|>"


def render(messages: list, *, generation_prompt: bool, tools: list | None = TOOLS) -> str:
    variables = {"messages": messages, "bos_token": "<|begin_of_text|>", "add_generation_prompt": generation_prompt}
    if tools is not None:
        variables["tools"] = tools
    return ChatTemplate(SOURCE).render(variables)


def form() -> TemplateForm:
    return probe_template_form(lambda m, v: render(m, generation_prompt=False, **v), SYNTAX.name)


def calls_message(calls: list, content: str) -> dict:
    entries = [{"id": f"call{i}", "type": "function", "function": {"name": n, "arguments": a}}
               for i, (n, a) in enumerate(calls)]
    return assistant_message({"content": content}, entries, form())


def turn(calls: list, content: str = CONTENT) -> tuple[str, str]:
    """The generation prompt and the text after it that the template writes for an assistant turn."""
    prompt = render(USER, generation_prompt=True)
    full = render([*USER, calls_message(calls, content)], generation_prompt=False)
    assert full.startswith(prompt)
    generated = full[len(prompt):]
    assert generated.endswith(END)
    return prompt, generated[: -len(END)]


def call_json(name: str, arguments: dict) -> str:
    """One call as the template writes it (``tojson``'s spacing)."""
    return '{"name": "' + name + '", "parameters": ' + json.dumps(arguments, ensure_ascii=False) + "}"


def test_the_template_is_told_and_takes_calls_as_objects() -> None:
    assert (SYNTAX.name, SYNTAX.thinks) == ("llama4_json", False)
    assert isinstance(SYNTAX, Llama4JsonSyntax) and SYNTAX.tagged
    assert form() == TemplateForm(object_arguments=True, none_content=False, short_ids=False)


def test_the_template_writes_the_layout_read_here() -> None:
    """Content inside the python tags, then the calls back to back (what the parser and grammar assume)."""
    _, generated = turn(CALLS)
    assert generated == (PYTHON_START + CONTENT + PYTHON_END + "".join(call_json(n, a) for n, a in CALLS))


def test_a_whole_tool_loop_renders() -> None:
    messages = [*USER, calls_message(CALLS[:1], ""),
                tool_message({"content": json.dumps({"temperature": 21})}, "call0", form()),
                {"role": "assistant", "content": "It is 21 degrees."}, {"role": "user", "content": "Thanks"}]
    text = render(messages, generation_prompt=True)
    assert PYTHON_START + PYTHON_END + call_json(*CALLS[0]) + END in text
    assert '<|header_start|>ipython<|header_end|>\n\n"{\\"temperature\\": 21}"<|eot|>' in text
    assert text.endswith("Thanks<|eot|><|header_start|>assistant<|header_end|>\n\n")


@pytest.mark.parametrize("how", ["whole", "random", "chars"])
@pytest.mark.parametrize("n_calls", [1, 2])
@pytest.mark.parametrize("content", [CONTENT, ""])
def test_rendered_turn_is_read_back_exactly(content: str, n_calls: int, how: str) -> None:
    prompt, generated = turn(CALLS[:n_calls], content)
    for seed in range(4 if how == "random" else 1):
        reply = run(SYNTAX.parser(prompt=prompt, tools=TOOLS), pieces(generated, how, seed))
        assert (reply.content, reply.reasoning) == (content, "")
        assert_calls(reply.tool_calls, CALLS[:n_calls])


def test_each_call_is_returned_as_soon_as_its_object_closes() -> None:
    prompt, generated = turn(CALLS)
    parser = SYNTAX.parser(prompt=prompt, tools=TOOLS)
    closes = [generated.index(call_json(*CALLS[0])) + len(call_json(*CALLS[0])), len(generated)]
    content, got = "", []
    for i, ch in enumerate(generated):
        delta = parser.feed(ch)
        content += delta.content
        if delta.tool_calls:
            got.append(i + 1)
            # the span's content comes out with the first call, when the object after it shows it was content
            assert content == CONTENT
    assert got == closes
    assert not parser.finish()


# Layouts the models write besides the template's (the system prompt asks for the object alone).
OTHER_LAYOUTS = [
    (PYTHON_START + call_json(*CALLS[0]) + PYTHON_END, "", CALLS[:1]),
    (PYTHON_START + call_json(*CALLS[0]) + call_json(*CALLS[1]) + PYTHON_END + "\n", "", CALLS),
    (PYTHON_START + "\n" + call_json(*CALLS[0]) + "\n" + PYTHON_END + "\nDone.", "Done.", CALLS[:1]),
    (call_json(*CALLS[0]), "", CALLS[:1]),
    (call_json(*CALLS[0]) + "\n" + call_json(*CALLS[1]), "", CALLS),
    ("Sure. " + call_json(*CALLS[0]), "Sure.", CALLS[:1]),                # vLLM's llama4_json template's layout
    ('{\n  "name": "get_weather",\n  "parameters": {"city": "Paris", "days": 3}\n}', "", CALLS[:1]),
    ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"days\\": 3}"}', "", CALLS[:1]),
    ("Sure. " + PYTHON_START + "Checking." + PYTHON_END + call_json(*CALLS[0]), "Sure. Checking.", CALLS[:1]),
]


@pytest.mark.parametrize("text, content, calls", OTHER_LAYOUTS)
def test_the_layouts_models_write_are_read(text: str, content: str, calls: list) -> None:
    for how in ("whole", "random", "chars"):
        reply = run(SYNTAX.parser(prompt="", tools=TOOLS), pieces(text, how))
        assert reply.content == content, (how, text)
        assert_calls(reply.tool_calls, calls)


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": "Par',                        # never closes
    PYTHON_START + '{"name": "get_weather", "parameters": {"city": "Paris"}',      # nor does the span
    PYTHON_START + PYTHON_END + '{"name": "get_weather", "parameters": {"city": "Paris"}',
    '{"name": "get_weather", "parameters": {"city": Paris}}',                     # not JSON
    '{"name": "get_weather", "parameters": [1]}',                                  # arguments not an object
    PYTHON_START + PYTHON_END + '{"name": "get_weather", "parameters": "nope"}',
    '{"name": "get_weather"}',                                                     # no arguments at all
    '{"name": "", "parameters": {}}',                                              # no name
    '{"name": 3, "parameters": {}}',
    PYTHON_START + "print(1)" + PYTHON_END,                                        # code, no call follows
    PYTHON_START + "print(1)" + PYTHON_END + " and then {x}",
    PYTHON_START + "print(1)",
    PYTHON_START + PYTHON_END,
    '{"names": ["a"]} {"name" "x"}',
])
def test_markup_that_is_not_calls_stays_content(text: str) -> None:
    prompt = render(USER, generation_prompt=True)
    for how in ("whole", "chars"):
        reply = run(SYNTAX.parser(prompt=prompt, tools=TOOLS), pieces("Checking. " + text, how))
        assert reply.tool_calls == []
        assert reply.content == "Checking. " + text


@pytest.mark.parametrize("text", ['Use {"key": 1} or {} and {"name"', "a <|python b", '{"na', "{ {", "}{"])
def test_braces_in_prose_are_content(text: str) -> None:
    for how in ("whole", "chars"):
        reply = run(SYNTAX.parser(prompt="", tools=TOOLS), pieces(text, how))
        assert (reply.content, reply.tool_calls) == (text, [])


def test_prose_streams_and_only_a_possible_call_is_held() -> None:
    parser = SYNTAX.parser(prompt="", tools=TOOLS)
    assert parser.feed("Braces {").content == "Braces"   # " {" may still open a call
    assert parser.feed('"na').content == ""
    assert parser.feed('me": {"a": 1').content == ""    # it opens like a call: held until it closes
    assert parser.feed("}} x").content == ' {"name": {"a": 1}} x'
    assert parser.feed(" {y").content == " {y"
    assert not parser.finish()


def test_without_tools_the_markup_is_content() -> None:
    prompt, generated = turn(CALLS[:1])
    reply = run(SYNTAX.parser(prompt=prompt, tools=False), list(generated))
    assert (reply.content, reply.tool_calls) == (generated, [])


def test_read_call() -> None:
    assert read_call('{"name": "f", "parameters": {}}').name == "f"
    assert json.loads(read_call('{"type": "function", "name": "f", "parameters": {"a": [1]}}').arguments) == {"a": [1]}
    for text in ('{"name": "f", "parameters": null}', '["f"]', '{"name": "f", "parameters": "{bad"}', "{"):
        assert read_call(text) is None, text


def test_a_template_writing_the_objects_bare_is_told_too() -> None:
    """vLLM's tool_chat_template_llama4_json.jinja (and Llama 3.1's) write the same objects without the tags: the
    same syntax, whose grammar then writes the objects alone."""
    bare = ("{%- for tool_call in message.tool_calls %}{{- '{\"name\": \"' + tool_call.function.name + '\", ' }}"
            "{{- '\"parameters\": ' }}{{- tool_call.function.arguments | tojson }}{{- \"}\" }}{%- endfor %}")
    syntax = chat_syntax(bare)
    assert syntax.name == "llama4_json" and not syntax.tagged
    grammar = syntax.tool_call_grammar(TOOLS)
    assert accepts(grammar, call_json(*CALLS[0]), False)
    assert not accepts(grammar, PYTHON_START + PYTHON_END + call_json(*CALLS[0]), False)


# -- the grammar for forced calls --------------------------------------------------------------------------------------

def forced_text(calls: list) -> str:
    """What the grammar writes for ``calls``: the template's turn of calls only."""
    return turn(calls, "")[1]


@pytest.mark.parametrize("special", [False, True])
def test_grammar_writes_the_templates_turn_and_the_parser_reads_it(special: bool) -> None:
    """With the markers as special tokens (as in Llama 4's vocabulary) the grammar asks for those tokens."""
    ids = BYTES.ids if special else None
    grammar = SYNTAX.tool_call_grammar(TOOLS, special_tokens=ids)
    assert LLMatcher.validate_grammar(grammar) == ""
    assert (f"<[{BYTES.ids[PYTHON_START]}]> <[{BYTES.ids[PYTHON_END]}]>" in grammar) == special
    single = SYNTAX.tool_call_grammar(TOOLS, parallel=False, special_tokens=ids)
    for calls in (CALLS[:1], CALLS[1:], CALLS):
        text = forced_text(calls)
        assert accepts(grammar, text, special), text
        assert accepts(single, text, special) == (len(calls) == 1)
        if special:   # the markers spelled in ordinary tokens are not the markers
            assert not accepts(grammar, text, False)
        reply = run(SYNTAX.parser(prompt="", tools=TOOLS), pieces(text, "chars"))
        assert reply.content == ""
        assert_calls(reply.tool_calls, calls)


@pytest.mark.parametrize("calls, ok", [
    ([("search", {"query": "x"})], True),
    ([("search", {"query": "x", "limit": 2})], True),
    ([("search", {"query": "x", "limit": 0})], False),              # minimum 1
    ([("get_weather", {"days": 3})], False),                        # city is required
    ([("get_weather", {"city": "Paris", "days": "3"})], False),     # an integer
    ([("get_weathers", {"city": "Paris"})], False),                 # not a tool
])
def test_grammar_holds_calls_to_their_schema(calls: list, ok: bool) -> None:
    assert accepts(SYNTAX.tool_call_grammar(TOOLS), forced_text(calls), False) == ok


def test_grammar_wants_the_tags_and_nothing_between_the_calls() -> None:
    grammar = SYNTAX.tool_call_grammar(TOOLS)
    one, two = call_json(*CALLS[0]), call_json(*CALLS[1])
    assert accepts(grammar, PYTHON_START + PYTHON_END + one + two, False)
    assert not accepts(grammar, one, False)
    assert not accepts(grammar, PYTHON_START + PYTHON_END + one + "\n" + two, False)
    assert not accepts(grammar, PYTHON_START + one + PYTHON_END, False)


def test_grammar_of_one_named_function() -> None:
    named = SYNTAX.tool_call_grammar(TOOLS, name="search")
    assert accepts(named, forced_text(CALLS[1:]), False)
    assert not accepts(named, forced_text(CALLS[:1]), False)
