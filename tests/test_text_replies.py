"""Replies in each model's own markup: real chat templates (fixtures/templates/) render assistant turns with
tool calls and reasoning; the parser must read back exactly what was rendered, fed whole, in random pieces
and one character at a time; broken markup comes back as content; the tool-call grammar admits the calls the
templates write and refuses calls of unknown tools or with arguments that break the schema."""
from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from colibri_aio.errors import UserError
from colibri_aio.text.chat_template import ChatTemplate
from colibri_aio.text.replies import ChatSyntax, Reply, ReplyParser, chat_syntax

from support import FIXTURES

TEMPLATES = FIXTURES / "templates"

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"},
            "filters": {"type": "object", "properties": {"lang": {"type": "string"},
                                                         "tags": {"type": "array", "items": {"type": "string"}}}},
            "limit": {"type": "integer", "minimum": 1}},
            "required": ["query"]}}},
]
CALLS = [("get_weather", {"city": "Paris", "days": 3}),
         ("search", {"query": "café <b>ouvert</b> & \"quoted\"", "filters": {"lang": "fr", "tags": ["a", "b"]},
                     "limit": 5})]
REASONING = "The user wants the weather; I should call get_weather."
CONTENT = "Let me look that up."
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def tool_calls(calls: list, *, as_text: bool) -> list[dict]:
    return [{"id": f"call{i}abcd", "type": "function",
             "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False) if as_text else a}}
            for i, (n, a) in enumerate(calls)]


def render(template: str, messages: list, *, generation_prompt: bool, **variables: Any) -> str:
    source = (TEMPLATES / f"{template}.jinja").read_text()
    return ChatTemplate(source).render({"messages": messages, "tools": TOOLS, "bos_token": "<s>", "eos_token": "</s>",
                                        "add_generation_prompt": generation_prompt, **variables})


@dataclass
class Turn:
    """A generation prompt, the text the model would generate after it, and what the parser must find."""

    prompt: str
    generated: str
    content: str
    reasoning: str
    calls: list = field(default_factory=list)


def cut_end(text: str, *ends: str) -> str:
    for end in ends:
        if text.endswith(end):
            return text[: -len(end)]
    return text


def after_prompt(template: str, assistant: dict, ends: tuple, **variables: Any) -> tuple[str, str]:
    prompt = render(template, USER, generation_prompt=True, **variables)
    full = render(template, [*USER, assistant], generation_prompt=False, **variables)
    assert full.startswith(prompt), (prompt[-80:], full[-300:])
    return prompt, cut_end(full[len(prompt):], *ends)


def qwen3(calls: list, thinking: bool = True) -> Turn:
    variables = {} if thinking else {"enable_thinking": False}
    assistant = {"role": "assistant", "content": CONTENT, "reasoning_content": REASONING if thinking else "",
                 "tool_calls": tool_calls(calls, as_text=False)}
    prompt, generated = after_prompt("Qwen-Qwen3-0.6B", assistant, ("<|im_end|>\n",), **variables)
    return Turn(prompt, generated, CONTENT, REASONING if thinking else "", calls)


def qwen25(calls: list) -> Turn:
    assistant = {"role": "assistant", "content": CONTENT, "tool_calls": tool_calls(calls, as_text=False)}
    prompt, generated = after_prompt("Qwen-Qwen2.5-7B-Instruct", assistant, ("<|im_end|>\n",))
    return Turn(prompt, generated, CONTENT, "", calls)


def glm46(calls: list) -> Turn:
    assistant = {"role": "assistant", "content": CONTENT, "reasoning_content": REASONING,
                 "tool_calls": tool_calls(calls, as_text=False)}
    prompt, generated = after_prompt("GLM-4.6", assistant, ())
    return Turn(prompt, generated, CONTENT, REASONING, calls)


def minimax(calls: list) -> Turn:
    assistant = {"role": "assistant", "content": CONTENT, "reasoning_content": REASONING,
                 "tool_calls": tool_calls(calls, as_text=False)}
    prompt, generated = after_prompt("MiniMax-M2", assistant, ("[e~[\n",))
    return Turn(prompt, generated, CONTENT, REASONING, calls)


def deepseek_v31(calls: list) -> Turn:
    assistant = {"role": "assistant", "content": CONTENT, "tool_calls": tool_calls(calls, as_text=True)}
    prompt, generated = after_prompt("deepseek-ai-DeepSeek-V3.1", assistant, ("<｜end▁of▁sentence｜>",))
    return Turn(prompt, generated, CONTENT, "", calls)


def deepseek_v31_thinking(calls: list) -> Turn:
    """With thinking on the prompt opens <think>; the template does not keep past reasoning, so the
    model's reasoning and its close are put before the turn the template writes."""
    turn = deepseek_v31(calls)
    prompt = render("deepseek-ai-DeepSeek-V3.1", USER, generation_prompt=True, thinking=True)
    assert prompt.endswith("<think>")
    return Turn(prompt, REASONING + "</think>" + turn.generated, CONTENT, REASONING, calls)


def deepseek_r1(calls: list) -> Turn:
    """R1 opens <think> in the prompt; its template writes a tool-call turn after <｜Assistant｜>."""
    prompt = render("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", USER, generation_prompt=True)
    assert prompt.endswith("<think>\n")
    assistant = {"role": "assistant", "content": None, "tool_calls": tool_calls(calls, as_text=True)}
    full = render("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", [*USER, assistant], generation_prompt=False)
    turn = cut_end(full[full.rindex("<｜Assistant｜>") + len("<｜Assistant｜>"):], "<｜end▁of▁sentence｜>")
    return Turn(prompt, REASONING + "\n</think>\n\n" + turn, "", REASONING, calls)


def gpt_oss(calls: list, end: str = "<|call|>") -> Turn:
    assistant = {"role": "assistant", "content": "", "thinking": REASONING,
                 "tool_calls": tool_calls(calls[:1], as_text=False)}
    prompt, generated = after_prompt("openai-gpt-oss-120b", assistant, ())
    assert generated.endswith("<|call|>")
    return Turn(prompt, cut_end(generated, "<|call|>") + end, "", REASONING, calls[:1])


def gpt_oss_final(end: str = "<|return|>") -> Turn:
    assistant = {"role": "assistant", "content": CONTENT, "thinking": REASONING}
    prompt, generated = after_prompt("openai-gpt-oss-120b", assistant, ())
    assert generated.endswith("<|return|>")
    return Turn(prompt, cut_end(generated, "<|return|>") + end, CONTENT, REASONING)


def mistral_nemo(calls: list) -> Turn:
    assistant = {"role": "assistant", "tool_calls": tool_calls(calls, as_text=False)}
    prompt, generated = after_prompt("mistralai-Mistral-Nemo-Instruct-2407", assistant, ("</s>",))
    return Turn(prompt, generated, "", "", calls)


def mistral_small(calls: list) -> Turn:
    assistant = {"role": "assistant", "tool_calls": tool_calls(calls, as_text=False)}
    prompt, generated = after_prompt("Mistral-Small-3.2-24B-Instruct-2506", assistant, ("</s>",))
    return Turn(prompt, generated, "", "", calls)


def llama4(calls: list, content: str = CONTENT) -> Turn:
    """Llama 4's own template wraps the content in <|python_start|>…<|python_end|>; the calls follow."""
    assistant = {"role": "assistant", "content": content, "tool_calls": tool_calls(calls, as_text=False)}
    prompt, generated = after_prompt("meta-llama-Llama-4-Scout-17B-16E-Instruct", assistant, ("<|eot|>",))
    return Turn(prompt, generated, content, "", calls)


TURNS: dict[str, tuple[str, Callable[[list], Turn]]] = {
    "qwen3": ("Qwen-Qwen3-0.6B", qwen3),
    "qwen3-no-thinking": ("Qwen-Qwen3-0.6B", lambda c: qwen3(c, thinking=False)),
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct", qwen25),
    "glm-4.6": ("GLM-4.6", glm46),
    "minimax-m2": ("MiniMax-M2", minimax),
    "deepseek-v3.1": ("deepseek-ai-DeepSeek-V3.1", deepseek_v31),
    "deepseek-v3.1-thinking": ("deepseek-ai-DeepSeek-V3.1", deepseek_v31_thinking),
    "deepseek-r1": ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", deepseek_r1),
    "gpt-oss": ("openai-gpt-oss-120b", gpt_oss),
    "gpt-oss-no-end-text": ("openai-gpt-oss-120b", lambda c: gpt_oss(c, end="")),
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407", mistral_nemo),
    "mistral-small-3.2": ("Mistral-Small-3.2-24B-Instruct-2506", mistral_small),
    "llama4": ("meta-llama-Llama-4-Scout-17B-16E-Instruct", llama4),
    "llama4-no-content": ("meta-llama-Llama-4-Scout-17B-16E-Instruct", lambda c: llama4(c, content="")),
}


def syntax_of(template: str) -> ChatSyntax:
    return chat_syntax((TEMPLATES / f"{template}.jinja").read_text())


def pieces(text: str, how: str, seed: int = 0) -> list[str]:
    if how == "whole":
        return [text]
    if how == "chars":
        return list(text)
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 12)
        out.append(text[i:i + n])
        i += n
    return out


def run(parser: ReplyParser, parts: list[str]) -> Reply:
    """Feeds every part, finishes, and checks that the deltas add up to the reply."""
    content, reasoning, calls = [], [], []
    for part in parts:
        for delta in (parser.feed(part),):
            content.append(delta.content)
            reasoning.append(delta.reasoning)
            calls.extend(delta.tool_calls)
    last = parser.finish()
    content.append(last.content)
    reasoning.append(last.reasoning)
    calls.extend(last.tool_calls)
    reply = parser.reply
    assert ("".join(content), "".join(reasoning), calls) == (reply.content, reply.reasoning, reply.tool_calls)
    return reply


def assert_calls(got: list, expected: list) -> None:
    assert [(c.name, json.loads(c.arguments)) for c in got] == [(n, a) for n, a in expected]
    for call in got:
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False, separators=(",", ":"))
    assert len({c.id for c in got}) == len(got)


# -- chat_syntax --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("template, name, thinks", [
    ("Qwen-Qwen3-0.6B", "hermes", True),
    ("Qwen-Qwen2.5-7B-Instruct", "hermes", False),
    ("GLM-4.6", "glm45", True),
    ("MiniMax-M2", "minimax_m2", True),
    ("deepseek-ai-DeepSeek-V3.1", "deepseek_v3", True),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek_r1", True),
    ("openai-gpt-oss-120b", "harmony", True),
    ("mistralai-Mistral-Nemo-Instruct-2407", "mistral", False),
    ("Mistral-Small-3.2-24B-Instruct-2506", "mistral", False),
    ("microsoft-Phi-3.5-mini-instruct", "plain", False),
    ("vllm-llama4-pythonic", "pythonic", False),
    ("meta-llama-Llama-4-Scout-17B-16E-Instruct", "llama4_json", False),
])
def test_chat_syntax_is_told_from_the_real_template(template: str, name: str, thinks: bool) -> None:
    syntax = syntax_of(template)
    assert (syntax.name, syntax.thinks) == (name, thinks)


def test_no_template_is_plain() -> None:
    assert chat_syntax(None).name == "plain"
    assert chat_syntax("").name == "plain"
    assert chat_syntax("{% for m in messages %}{{ m.content }}{% endfor %}").name == "plain"


def test_reasoning_close_is_the_text_that_ends_thinking() -> None:
    assert syntax_of("Qwen-Qwen3-0.6B").reasoning_close == "</think>"
    assert syntax_of("openai-gpt-oss-120b").reasoning_close == \
        "<|end|><|start|>assistant<|channel|>final<|message|>"


# -- parsing what the real templates write --------------------------------------------------------------------

@pytest.mark.parametrize("how", ["whole", "random", "chars"])
@pytest.mark.parametrize("case", list(TURNS))
@pytest.mark.parametrize("n_calls", [1, 2])
def test_rendered_turn_is_read_back_exactly(case: str, n_calls: int, how: str) -> None:
    template, make = TURNS[case]
    turn = make(CALLS[:n_calls])
    for seed in range(3 if how == "random" else 1):
        parser = syntax_of(template).parser(prompt=turn.prompt, tools=TOOLS)
        reply = run(parser, pieces(turn.generated, how, seed))
        assert (reply.content, reply.reasoning) == (turn.content, turn.reasoning), turn.generated
        assert_calls(reply.tool_calls, turn.calls)


def test_glm_values_follow_the_declared_types() -> None:
    """A string argument that looks like a number stays a string; an integer is read as JSON."""
    calls = [("get_weather", {"city": "1984", "days": 2})]
    turn = glm46(calls)
    parser = syntax_of("GLM-4.6").parser(prompt=turn.prompt, tools=TOOLS)
    assert_calls(run(parser, [turn.generated]).tool_calls, calls)
    # without the declarations, a bare value that parses as JSON is read as JSON
    parser = syntax_of("GLM-4.6").parser(prompt=turn.prompt, tools=True)
    assert_calls(run(parser, [turn.generated]).tool_calls, [("get_weather", {"city": 1984, "days": 2})])


def test_gpt_oss_final_answer_with_and_without_the_end_text() -> None:
    for end in ("<|return|>", ""):
        turn = gpt_oss_final(end)
        reply = run(syntax_of("openai-gpt-oss-120b").parser(prompt=turn.prompt, tools=TOOLS), list(turn.generated))
        assert (reply.content, reply.reasoning, reply.tool_calls) == (CONTENT, REASONING, [])


def test_gpt_oss_channel_first_header_as_the_model_writes_it() -> None:
    text = ('<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary '
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
    reply = run(syntax_of("openai-gpt-oss-120b").parser(prompt="<|start|>assistant", tools=True), list(text))
    assert reply.reasoning == "Need weather."
    assert_calls(reply.tool_calls, [("get_weather", {"city": "Paris"})])


def test_in_reasoning_follows_the_thinking_span() -> None:
    turn = qwen3(CALLS[:1])
    parser = syntax_of("Qwen-Qwen3-0.6B").parser(prompt=turn.prompt, tools=True)
    assert not parser.in_reasoning
    parser.feed("<think>\nhmm")
    assert parser.in_reasoning
    parser.feed("</think>\n\nok")
    assert not parser.in_reasoning
    harmony = syntax_of("openai-gpt-oss-120b").parser(prompt="<|start|>assistant", tools=True)
    harmony.feed("<|channel|>analysis<|message|>x")
    assert harmony.in_reasoning
    harmony.feed("<|end|><|start|>assistant<|channel|>final<|message|>y")
    assert not harmony.in_reasoning


@pytest.mark.parametrize("template", ["Qwen-Qwen3-0.6B", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "MiniMax-M2"])
def test_prompt_that_opened_thinking_starts_in_reasoning(template: str) -> None:
    prompt = render(template, USER, generation_prompt=True) + ("<think>\n" if template.startswith("Qwen") else "")
    parser = syntax_of(template).parser(prompt=prompt, tools=True)
    assert parser.in_reasoning
    reply = run(parser, list(f"\n{REASONING}\n</think>\n\n{CONTENT}"))
    assert (reply.reasoning, reply.content) == (REASONING, CONTENT)


def test_prompt_that_closed_thinking_reads_a_later_think_tag_as_content() -> None:
    prompt = render("Qwen-Qwen3-0.6B", USER, generation_prompt=True, enable_thinking=False)
    parser = syntax_of("Qwen-Qwen3-0.6B").parser(prompt=prompt, tools=False)
    assert run(parser, list("Use <think> tags.")).content == "Use <think> tags."


# -- broken markup and plain text -----------------------------------------------------------------------------

BROKEN = {
    "Qwen-Qwen3-0.6B": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',   # unclosed
                        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par</tool_call>',
                        '<tool_call>\n["get_weather"]\n</tool_call>'],
    "GLM-4.6": ["<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris",
                "<tool_call>get_weather\n<arg_key>city</arg_key>\nParis\n</tool_call>"],
    "MiniMax-M2": ['<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n',
                   '<minimax:tool_call>\n<invoke name="get_weather">oops</invoke>\n</minimax:tool_call>'],
    "deepseek-ai-DeepSeek-V3.1": ["<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": ",
                                  "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{bad}"
                                  "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"],
    "mistralai-Mistral-Nemo-Instruct-2407": ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par',
                                             '[TOOL_CALLS][{"arguments": {}}]'],
    "Mistral-Small-3.2-24B-Instruct-2506": ['[TOOL_CALLS]get_weather[ARGS]{"city": ',
                                            "[TOOL_CALLS]get_weather{}"],
    "vllm-llama4-pythonic": ['[get_weather(city="Paris", ', '[get_weather(city=Paris)]'],
    "meta-llama-Llama-4-Scout-17B-16E-Instruct": [
        '<|python_start|><|python_end|>{"name": "get_weather", "parameters": {"city": "Par',
        '<|python_start|>{"name": "get_weather", "parameters": {"city": Paris}}<|python_end|>',
        '{"name": "get_weather", "parameters": ["Paris"]}'],
}


def content_prompt(template: str) -> str:
    """A generation prompt after which the reply is content: thinking off where the template can turn it off,
    else (MiniMax-M2 always opens it, gpt-oss always starts a header) closed or skipped by hand."""
    prompt = render(template, USER, generation_prompt=True, enable_thinking=False, thinking=False)
    if prompt.endswith("<think>\n"):
        prompt += "</think>\n\n"
    if prompt.endswith("<|start|>assistant"):
        prompt += "<|channel|>final<|message|>"
    return prompt


@pytest.mark.parametrize("template, text", [(t, x) for t, texts in BROKEN.items() for x in texts])
def test_broken_markup_comes_back_as_content(template: str, text: str) -> None:
    syntax = syntax_of(template)
    prompt = content_prompt(template)
    for how in ("whole", "chars"):
        reply = run(syntax.parser(prompt=prompt, tools=TOOLS), pieces("Checking. " + text, how))
        assert reply.tool_calls == []
        assert reply.content == "Checking. " + text


def test_harmony_call_with_bad_json_comes_back_as_content() -> None:
    body = '{"city": '
    text = f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{body}"
    for end in ("<|call|>", ""):
        reply = run(syntax_of("openai-gpt-oss-120b").parser(prompt="<|start|>assistant", tools=True), [text + end])
        assert (reply.content, reply.tool_calls) == (body, [])


def test_without_tools_the_markup_stays_content() -> None:
    turn = qwen3(CALLS[:1], thinking=False)
    reply = run(syntax_of("Qwen-Qwen3-0.6B").parser(prompt=turn.prompt, tools=False), [turn.generated])
    assert reply.tool_calls == [] and reply.content == turn.generated


PLAIN = "The answer is 42 (a < b, [x] {y}).\nDone."


@pytest.mark.parametrize("template", sorted(p.stem for p in TEMPLATES.glob("*.jinja")))
def test_text_without_markup_streams_through_unchanged(template: str) -> None:
    """Every character that cannot start a marker comes out with the feed that brought it."""
    syntax = syntax_of(template)
    prompt = content_prompt(template)
    markers_start = {"<", "[", " ", "\n"}   # may begin a marker, or be whitespace before one
    parser = syntax.parser(prompt=prompt, tools=TOOLS)
    out = []
    for i, ch in enumerate(PLAIN):
        delta = parser.feed(ch)
        out.append(delta.content)
        assert delta.reasoning == "" and delta.tool_calls == []
        if ch not in markers_start and PLAIN[i - 1] not in markers_start:
            assert "".join(out) == PLAIN[: i + 1], (template, i)
    out.append(parser.finish().content)
    assert "".join(out) == PLAIN == parser.reply.content


def test_plain_template_with_tool_markup_is_all_content() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    reply = run(syntax_of("microsoft-Phi-3.5-mini-instruct").parser(prompt="", tools=TOOLS), list(text))
    assert (reply.content, reply.tool_calls) == (text, [])


def test_parser_refuses_feeding_after_finish() -> None:
    parser = syntax_of("Qwen-Qwen2.5-7B-Instruct").parser(prompt="", tools=True)
    assert parser.feed("a <tool").content == "a"   # " <tool" may still become a call
    assert parser.finish().content == " <tool"
    assert not parser.finish()
    with pytest.raises(RuntimeError, match="finished"):
        parser.feed("b")


# -- grammars -------------------------------------------------------------------------------------------------

SPECIAL = ["<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|constrain|>", "<|call|>",
           "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
           "<｜tool▁sep｜>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<tool_call>", "</tool_call>",
           "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<minimax:tool_call>", "</minimax:tool_call>",
           "<|python_start|>", "<|python_end|>"]


class ByteTokenizer:
    """A test vocabulary: the 256 bytes, the markers above as special tokens, and an end token."""

    def __init__(self) -> None:
        self.tokens = [bytes([i]) for i in range(256)] + [b"\xff" + s.encode() for s in SPECIAL] + [b"\xff<eos>"]
        self.eos_token_id = len(self.tokens) - 1
        self.bos_token_id = None
        self.special_token_ids = list(range(256, len(self.tokens)))
        self.ids = {s: 256 + i for i, s in enumerate(SPECIAL)}

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)

    def encode(self, text: str, special: bool) -> list[int]:
        """Bytes, with each marker as its special token when ``special``."""
        if not special:
            return list(text.encode())
        pattern = "(" + "|".join(re.escape(s) for s in SPECIAL) + ")"
        out: list[int] = []
        for part in re.split(pattern, text):
            out.extend([self.ids[part]] if part in self.ids else list(part.encode()))
        return out


BYTES = ByteTokenizer()
LL_TOKENIZER = LLTokenizer(TokenizerWrapper(BYTES))


def accepts(grammar: str, text: str, special: bool) -> bool:
    matcher = LLMatcher(LL_TOKENIZER, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(BYTES.encode(text, special)) and matcher.is_accepting()


def call_text(template: str, calls: list) -> str:
    """The tool-call part of the turn the real template writes (the text the grammar must admit)."""
    case = {"Qwen-Qwen3-0.6B": qwen3, "GLM-4.6": glm46, "MiniMax-M2": minimax, "openai-gpt-oss-120b": gpt_oss,
            "deepseek-ai-DeepSeek-V3.1": deepseek_v31, "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": deepseek_r1,
            "mistralai-Mistral-Nemo-Instruct-2407": mistral_nemo,
            "Mistral-Small-3.2-24B-Instruct-2506": mistral_small,
            # a turn of calls only: what the grammar writes
            "meta-llama-Llama-4-Scout-17B-16E-Instruct": lambda c: llama4(c, content="")}[template]
    text = case(calls).generated
    starts = ["<tool_call>", "<minimax:tool_call>", "<|start|>assistant to=", "<｜tool▁calls▁begin｜>", "[TOOL_CALLS]",
              "<|python_start|>"]
    begin = min(i for i in (text.find(s) for s in starts) if i >= 0)
    text = text[begin:]
    if template == "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B" and len(calls) == 1:
        text += "<｜tool▁calls▁end｜>"   # the template leaves it out after one call; the model writes it
    return cut_end(text, "<|call|>")


GRAMMAR_TEMPLATES = ["Qwen-Qwen3-0.6B", "GLM-4.6", "MiniMax-M2", "deepseek-ai-DeepSeek-V3.1",
                     "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "openai-gpt-oss-120b",
                     "mistralai-Mistral-Nemo-Instruct-2407", "Mistral-Small-3.2-24B-Instruct-2506",
                     "meta-llama-Llama-4-Scout-17B-16E-Instruct"]


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("template", GRAMMAR_TEMPLATES)
def test_grammar_admits_the_calls_the_template_writes(template: str, special: bool) -> None:
    syntax = syntax_of(template)
    ids = BYTES.ids if special else None
    one = syntax.tool_call_grammar(TOOLS, special_tokens=ids)
    assert LLMatcher.validate_grammar(one) == ""
    for calls in (CALLS[:1], CALLS[1:]):
        assert accepts(one, call_text(template, calls), special), call_text(template, calls)
    if syntax.name != "harmony":   # a harmony message makes one call
        two = call_text(template, CALLS)
        assert accepts(syntax.tool_call_grammar(TOOLS, special_tokens=ids), two, special)
        assert not accepts(syntax.tool_call_grammar(TOOLS, parallel=False, special_tokens=ids), two, special)


@pytest.mark.parametrize("template", GRAMMAR_TEMPLATES)
def test_grammar_refuses_unknown_tools_and_bad_arguments(template: str) -> None:
    syntax = syntax_of(template)
    grammar = syntax.tool_call_grammar(TOOLS)
    good = call_text(template, CALLS[:1])
    assert accepts(grammar, good, False)
    assert not accepts(grammar, good.replace("get_weather", "get_weathers"), False)      # unknown tool
    assert not accepts(grammar, call_text(template, [("get_weather", {"city": "Paris", "days": "three"})]), False)
    assert not accepts(grammar, call_text(template, [("get_weather", {"days": 3})]), False)   # required city
    named = syntax.tool_call_grammar(TOOLS, name="search")
    assert not accepts(named, good, False)
    assert accepts(named, call_text(template, CALLS[1:]), False)


def test_grammar_refuses_a_named_function_not_in_tools() -> None:
    with pytest.raises(UserError, match="'nope'"):
        syntax_of("Qwen-Qwen3-0.6B").tool_call_grammar(TOOLS, name="nope")
    with pytest.raises(UserError, match="no tool-call syntax"):
        syntax_of("microsoft-Phi-3.5-mini-instruct").tool_call_grammar(TOOLS)


FREE_FORM = [{"type": "function", "function": {"name": "note", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("template", GRAMMAR_TEMPLATES)
def test_free_form_arguments(template: str) -> None:
    """A function whose schema declares no properties takes any arguments, in the grammar and the parser."""
    calls = [("note", {"text": "buy <milk>", "count": 2})]
    text = call_text(template, calls)
    assert accepts(syntax_of(template).tool_call_grammar(FREE_FORM), text, False), text
    parser = syntax_of(template).parser(prompt=content_prompt(template), tools=FREE_FORM)
    assert_calls(run(parser, list(text)).tool_calls, calls)


def test_harmony_text_without_any_header_is_content() -> None:
    parser = syntax_of("openai-gpt-oss-120b").parser(prompt="", tools=True)
    assert run(parser, list("Just words.")).content == "Just words."


@pytest.mark.parametrize("case, closes", [("qwen3", "</tool_call>"), ("glm-4.6", "</tool_call>"),
                                          ("deepseek-v3.1", "<｜tool▁calls▁end｜>"),
                                          ("mistral-small-3.2", '"days": 3}'), ("mistral-nemo", 'abcd"}]'),
                                          ("llama4", '"days": 3}}')])
def test_each_call_is_returned_as_soon_as_its_markup_closes(case: str, closes: str) -> None:
    template, make = TURNS[case]
    turn = make(CALLS)
    parser = syntax_of(template).parser(prompt=turn.prompt, tools=TOOLS)
    first = turn.generated.index(closes) + len(closes)
    for i, ch in enumerate(turn.generated):
        if parser.feed(ch).tool_calls:
            assert i + 1 == first
            break
    else:
        pytest.fail("no call came before the end of the generation")


def test_hermes_reads_a_list_of_calls_and_arguments_as_text() -> None:
    text = ('<tool_call>\n[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}]\n</tool_call>')
    reply = run(syntax_of("Qwen-Qwen2.5-7B-Instruct").parser(prompt="", tools=True), list(text))
    assert_calls(reply.tool_calls, [("get_weather", {"city": "Paris"}), ("search", {"query": "x"})])


def test_glm45_layout_is_read_too() -> None:
    """GLM-4.5's template puts the newline before each key and none before the close."""
    text = ("\n<think>Need it.</think>\nSure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
            "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value></tool_call>")
    reply = run(syntax_of("GLM-4.6").parser(prompt="<|user|>\nWeather?<|assistant|>", tools=TOOLS), list(text))
    assert (reply.reasoning, reply.content) == ("Need it.", "Sure.")
    assert_calls(reply.tool_calls, [("get_weather", {"city": "Paris", "days": 2})])
