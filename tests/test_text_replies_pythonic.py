"""Pythonic tool calls (Llama 4): turns rendered by the real template (fixtures/templates/vllm-llama4-pythonic.jinja)
are read back exactly, fed whole, in random pieces and one character at a time; lists that are not calls stay
content; the forced-call grammar writes calls the parser reads, held to each function's schema."""
from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from colibri_aio.text.chat_template import ChatTemplate
from colibri_aio.text.replies import chat_syntax
from colibri_aio.text.replies.pythonic import read_calls
from colibri_aio.text.template_form import TemplateForm, assistant_message, probe_template_form, tool_message

from support import FIXTURES
from test_text_replies import TOOLS, accepts, assert_calls, pieces, run

SOURCE = (FIXTURES / "templates" / "vllm-llama4-pythonic.jinja").read_text()
SYNTAX = chat_syntax(SOURCE)
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
CONTENT = "Let me look that up."
# The template writes every value as "%s" in double quotes (so a value holding a double quote would not be Python
# any more): these values survive it, and the parser gives numbers, lists and objects back by their schema.
CALLS = [("get_weather", {"city": "Paris", "days": 3}),
         ("search", {"query": "café <b>ouvert</b> & 'quoted'", "filters": {"lang": "fr", "tags": ["a", "b"]},
                     "limit": 5})]
END = "<|eot|>"


def render(messages: list, *, generation_prompt: bool, tools: list | None = TOOLS) -> str:
    variables = {"messages": messages, "bos_token": "<|begin_of_text|>", "add_generation_prompt": generation_prompt}
    if tools is not None:
        variables["tools"] = tools
    return ChatTemplate(SOURCE).render(variables)


def calls_message(calls: list, content: str) -> dict:
    form = probe_template_form(lambda m, v: render(m, generation_prompt=False, **v), SYNTAX.name)
    entries = [{"id": f"call{i}", "type": "function", "function": {"name": n, "arguments": a}}
               for i, (n, a) in enumerate(calls)]
    return assistant_message({"content": content}, entries, form)


def turn(calls: list, content: str = CONTENT) -> tuple[str, str]:
    """The generation prompt and the text after it that the template writes for an assistant turn."""
    prompt = render(USER, generation_prompt=True)
    full = render([*USER, calls_message(calls, content)], generation_prompt=False)
    assert full.startswith(prompt)
    generated = full[len(prompt):]
    assert generated.endswith(END)
    return prompt, generated[: -len(END)]


def test_the_template_is_told_pythonic_and_takes_calls_as_objects() -> None:
    assert (SYNTAX.name, SYNTAX.thinks) == ("pythonic", False)
    form = probe_template_form(lambda m, v: render(m, generation_prompt=False, **v), SYNTAX.name)
    assert form == TemplateForm(object_arguments=True, none_content=False, short_ids=False)


def test_a_whole_tool_loop_renders() -> None:
    form = TemplateForm()
    messages = [*USER, calls_message(CALLS[:1], ""),
                tool_message({"content": json.dumps({"temperature": 21})}, "call0", form),
                {"role": "assistant", "content": "It is 21 degrees."}, {"role": "user", "content": "Thanks"}]
    text = render(messages, generation_prompt=True)
    assert '[get_weather(city="Paris", days="3")]<|eot|>' in text
    assert '<|header_start|>ipython<|header_end|>\n\n"{\\"temperature\\": 21}"<|eot|>' in text
    assert text.endswith("Thanks<|eot|><|header_start|>assistant<|header_end|>\n\n")


@pytest.mark.parametrize("how", ["whole", "random", "chars"])
@pytest.mark.parametrize("n_calls", [1, 2])
@pytest.mark.parametrize("content", [CONTENT, ""])
def test_rendered_turn_is_read_back_exactly(content: str, n_calls: int, how: str) -> None:
    prompt, generated = turn(CALLS[:n_calls], content)
    assert generated.startswith(content + "[")
    for seed in range(4 if how == "random" else 1):
        reply = run(SYNTAX.parser(prompt=prompt, tools=TOOLS), pieces(generated, how, seed))
        assert (reply.content, reply.reasoning) == (content, "")
        assert_calls(reply.tool_calls, CALLS[:n_calls])


def test_without_the_schemas_quoted_values_stay_strings() -> None:
    prompt, generated = turn(CALLS[:1])
    reply = run(SYNTAX.parser(prompt=prompt, tools=True), [generated])
    assert_calls(reply.tool_calls, [("get_weather", {"city": "Paris", "days": "3"})])


def test_content_streams_and_the_list_is_held_until_it_closes() -> None:
    prompt, generated = turn(CALLS)
    parser = SYNTAX.parser(prompt=prompt, tools=TOOLS)
    opened = generated.index("[")
    seen = ""
    for i, ch in enumerate(generated):
        delta = parser.feed(ch)
        seen += delta.content
        if i < opened:   # content comes out as it is written (a space once a word follows it)
            assert seen == generated[: i + 1].rstrip()
        if i < len(generated) - 1:
            assert not delta.tool_calls, i
        else:
            assert len(delta.tool_calls) == 2
    assert seen == CONTENT and not parser.finish()


@pytest.mark.parametrize("text", [
    '[get_weather("Paris")]',                      # a positional argument
    "[get_weather(city=paris)]",                   # a variable
    '[get_weather(city="Par" + "is")]',            # an expression
    '[get_weather(city=__import__("os").getcwd())]',
    '[get_weather(**{"city": "Paris"})]',
    '[get_weather(city="a", city="b")]',           # one name twice
    '[get_weather(city="Paris"), 3]',              # a list of other things
    '[get_weather(city="Paris")',                   # never closes
    '[get_weather(city="Paris"))] and then',        # a bracket closing one it did not open
    "[get_weather(city='Paris)]",                   # a string that never ends
    '[(lambda: 1)()]',
    '[get_weather(city=float("nan"))]',
    '[get_weather(city={1: 2})]',                   # a key that is not a string
    "<|python_start|> print(1)",
])
def test_lists_that_are_not_calls_stay_content(text: str) -> None:
    prompt = render(USER, generation_prompt=True)
    for how in ("whole", "chars"):
        reply = run(SYNTAX.parser(prompt=prompt, tools=TOOLS), pieces("Checking. " + text, how))
        assert reply.tool_calls == []
        assert reply.content == "Checking. " + text


@pytest.mark.parametrize("text", ["See [1], [x] and a[i](j).", "[ 2 ] [a] [f] [f(]", "<|python_end|> [", "[]"])
def test_brackets_in_prose_are_content(text: str) -> None:
    for how in ("whole", "chars"):
        reply = run(SYNTAX.parser(prompt="", tools=TOOLS), pieces(text, how))
        assert (reply.content, reply.tool_calls) == (text, [])


def test_values_as_python_and_as_json_write_them() -> None:
    text = ('<|python_start|>[note(a=True, b=false, c=None, d=null, e=-2.5, f=[1, (2, 3)], g={"k": [true]}, '
            'h="\\u00e9\\/\\ud83d\\ude00", i=\'single\', j=+4)]<|python_end|>')
    reply = run(SYNTAX.parser(prompt="", tools=True), list(text + "\nDone."))
    assert reply.content == "Done."
    assert_calls(reply.tool_calls, [("note", {"a": True, "b": False, "c": None, "d": None, "e": -2.5, "f": [1, [2, 3]],
                                              "g": {"k": [True]}, "h": "é/😀", "i": "single", "j": 4})])


def test_dotted_names_and_spacing() -> None:
    calls = read_calls('[ tools.get_weather( city = "Paris" ) ,\n  search(query="x") ]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("tools.get_weather", {"city": "Paris"}),
                                                                  ("search", {"query": "x"})]


def test_a_quoted_value_is_read_by_its_schema_only_when_it_fits() -> None:
    schemas = {"f": {"properties": {"n": {"type": "integer"}, "s": {"type": "string"}, "b": {"type": "boolean"},
                                    "o": {"type": "object"}}}}
    (call,) = read_calls('[f(n="3", s="3", b="True", o="{\'a\': [1]}")]', schemas)
    assert json.loads(call.arguments) == {"n": 3, "s": "3", "b": True, "o": {"a": [1]}}
    (call,) = read_calls('[f(n="three", b="1", o="[1]")]', schemas)
    assert json.loads(call.arguments) == {"n": "three", "b": "1", "o": "[1]"}


def test_without_tools_a_call_list_is_content() -> None:
    prompt, generated = turn(CALLS[:1])
    reply = run(SYNTAX.parser(prompt=prompt, tools=False), list(generated))
    assert (reply.content, reply.tool_calls) == (generated, [])


# -- the grammar for forced calls --------------------------------------------------------------------------------------

def json_call(name: str, arguments: dict) -> str:
    """A call as the grammar spells it: each argument as JSON after ``key=``."""
    inner = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in arguments.items())
    return f"{name}({inner})"


JSON_CALLS = [("get_weather", {"city": "Paris", "days": 3}),
              ("search", {"query": 'café "quoted" \\ <b>', "filters": {"lang": "fr", "tags": ["a", "b"]}, "limit": 5})]


def test_grammar_admits_calls_that_the_parser_reads_back() -> None:
    grammar = SYNTAX.tool_call_grammar(TOOLS)
    assert LLMatcher.validate_grammar(grammar) == ""
    single = SYNTAX.tool_call_grammar(TOOLS, parallel=False)
    for calls in ([JSON_CALLS[0]], [JSON_CALLS[1]], JSON_CALLS):
        text = "[" + ", ".join(json_call(n, a) for n, a in calls) + "]"
        assert accepts(grammar, text, False), text
        assert accepts(single, text, False) == (len(calls) == 1)
        reply = run(SYNTAX.parser(prompt="", tools=TOOLS), pieces(text, "chars"))
        assert reply.content == ""
        assert_calls(reply.tool_calls, calls)


@pytest.mark.parametrize("text, ok", [
    ('[search(query="x")]', True),
    ('[search(query="x", limit=2)]', True),
    ('[search(query="x", filters={"lang": "fr"})]', True),
    ('[search(limit=2, query="x")]', False),                  # the schema's order
    ('[search(query="x", limit=0)]', False),                  # minimum 1
    ('[get_weather(days=3)]', False),                         # city is required
    ('[get_weather(city="Paris", days="3")]', False),         # an integer, as JSON
    ('[get_weather(city="Paris", days=3.5)]', False),
    ('[get_weathers(city="Paris")]', False),                  # not a tool
    ('[get_weather(city="Paris"),]', False),
    ('get_weather(city="Paris")', False),                     # the list's brackets
])
def test_grammar_holds_calls_to_their_schema(text: str, ok: bool) -> None:
    assert accepts(SYNTAX.tool_call_grammar(TOOLS), text, False) == ok


def test_grammar_of_one_named_function() -> None:
    named = SYNTAX.tool_call_grammar(TOOLS, name="search")
    assert accepts(named, '[search(query="x")]', False)
    assert not accepts(named, '[get_weather(city="Paris")]', False)


def test_optional_and_free_arguments() -> None:
    tools = [{"type": "function", "function": {"name": "note", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "opt", "parameters": {
                 "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}}}},
             {"type": "function", "function": {"name": "none", "parameters": {
                 "type": "object", "properties": {}, "additionalProperties": False}}}]
    grammar = SYNTAX.tool_call_grammar(tools)
    for text, ok in [("[note()]", True), ('[note(text="buy <milk>", count=2, done=null)]', True),
                     ("[opt()]", True), ("[opt(b=true)]", True), ("[opt(a=1, b=false)]", True),
                     ("[opt(, b=false)]", False), ("[opt(b=true, a=1)]", False), ("[opt(a=1, )]", False),
                     ("[none()]", True), ("[none(x=1)]", False)]:
        assert accepts(grammar, text, False) == ok, text
    reply = run(SYNTAX.parser(prompt="", tools=tools), ['[note(text="buy <milk>", count=2, done=null), opt(b=true)]'])
    assert_calls(reply.tool_calls, [("note", {"text": "buy <milk>", "count": 2, "done": None}), ("opt", {"b": True})])


def test_hyphenated_names_and_keyword_arguments() -> None:
    """OpenAI tool names may hold hyphens and arguments may be named by Python keywords: the grammar writes
    them as they are, and the parser reads them back."""
    tools = [{"type": "function", "function": {"name": "book-flight", "parameters": {
        "type": "object", "properties": {"from": {"type": "string"}, "class": {"type": "string"},
                                         "_0_": {"type": "integer"}}, "required": ["from"]}}}]
    text = '[book-flight(from="PAR", class="eco", _0_=1), book-flight(from="from=x")]'
    assert accepts(SYNTAX.tool_call_grammar(tools), text, False)
    for how in ("whole", "chars"):
        reply = run(SYNTAX.parser(prompt="", tools=tools), pieces(text, how))
        assert_calls(reply.tool_calls, [("book-flight", {"from": "PAR", "class": "eco", "_0_": 1}),
                                        ("book-flight", {"from": "from=x"})])
    for not_calls in ('[book - flight(from="PAR")]', '[f(a=1) - g(b=2)]', '[book-flight("PAR")]'):
        assert read_calls(not_calls) is None, not_calls
