"""What every reply syntax shares: the parsed pieces of a reply, the streaming parser's contract, and helpers.

A model's reply, as generated text, mixes three things: reasoning (a thinking span), content (the answer shown
to the user) and tool calls, each written in markup of the model's own (its chat template shows which). A
:class:`ReplyParser` reads that text piece by piece as it is generated and returns :class:`ReplyDelta` s: the
reasoning and content that are certain so far, and each tool call once it is whole. It never returns text that
could still turn out to be the start of a marker (it holds such a suffix back until the next piece decides),
and at :meth:`ReplyParser.finish` nothing is lost: markup that never closed, or whose JSON does not parse,
comes back as content.

A :class:`ChatSyntax` is what a template's replies look like: it makes parsers, and writes the grammar (Lark,
in llguidance's dialect) that forces a tool call in that syntax.
"""
from __future__ import annotations

import json
import secrets
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from colibri_aio.errors import UserError
from colibri_aio.text.grammar import lark_json
from colibri_aio.text.sampling import longest_partial_suffix

Tools = Sequence[Mapping[str, Any]]   # OpenAI tool dicts: {"type": "function", "function": {...}}


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: ``arguments`` is a JSON object as compact text."""

    id: str
    name: str
    arguments: str


@dataclass
class ReplyDelta:
    """What one :meth:`ReplyParser.feed` (or :meth:`ReplyParser.finish`) made certain."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)   # calls completed by this feed, each whole

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


@dataclass
class Reply:
    """A whole reply (or all of it so far)."""

    content: str
    reasoning: str
    tool_calls: list[ToolCall]


def new_call_id() -> str:
    """A fresh tool-call id as OpenAI writes them: ``call_`` and 24 hex characters."""
    return "call_" + secrets.token_hex(12)


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def make_call(name: Any, arguments: Any) -> ToolCall | None:
    """A call from a parsed name and arguments (a dict, or a JSON object as text); None when either is not
    what a call needs (a non-empty name, a JSON object)."""
    if not isinstance(name, str) or not name.strip():
        return None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), name.strip(), compact_json(arguments))


def first_marker(text: str, markers: Collection[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest of ``markers`` in ``text`` (the longest one when two start at the same place)."""
    best: tuple[int, str] | None = None
    for marker in markers:
        i = text.find(marker, start)
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(marker) > len(best[1]))):
            best = (i, marker)
    return best


class ReplyParser:
    """Reads one generation's text, piece by piece, into reasoning, content and tool calls.

    Subclasses implement :meth:`_feed` and :meth:`_finish`, each filling the delta they are given; this class
    keeps the running :attr:`reply`.
    """

    def __init__(self) -> None:
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[ToolCall] = []
        self._finished = False

    def feed(self, text: str) -> ReplyDelta:
        """The next piece of generated text (special tokens' text included); returns what became certain."""
        if self._finished:
            raise RuntimeError("this reply parser has finished; make a new one for a new generation")
        delta = ReplyDelta()
        if text:
            self._feed(text, delta)
        return self._keep(delta)

    def finish(self) -> ReplyDelta:
        """The generation ended: everything held back, settled (unclosed or broken tool markup as content)."""
        if self._finished:
            return ReplyDelta()
        delta = ReplyDelta()
        self._finish(delta)
        self._finished = True
        return self._keep(delta)

    @property
    def reply(self) -> Reply:
        """Everything parsed so far."""
        return Reply("".join(self._content), "".join(self._reasoning), list(self._calls))

    @property
    def in_reasoning(self) -> bool:
        """Whether the text now being generated is inside the thinking span."""
        return False

    def _keep(self, delta: ReplyDelta) -> ReplyDelta:
        self._content.append(delta.content)
        self._reasoning.append(delta.reasoning)
        self._calls.extend(delta.tool_calls)
        return delta

    def _feed(self, text: str, delta: ReplyDelta) -> None:
        raise NotImplementedError

    def _finish(self, delta: ReplyDelta) -> None:
        raise NotImplementedError


class TrailingCallsParser(ReplyParser):
    """A parser for syntaxes whose calls follow the content with no opening marker of their own (a JSON object,
    a Python list): content streams, its trailing whitespace held while a call could follow (and dropped before
    one), and the text is scanned by a small state machine, one :meth:`_step` at a time, in a buffer.

    Subclasses set their states' steps: :meth:`_step` returns whether it moved on (call it again).
    ``closing``: a marker that may follow calls and is the markup's (:meth:`_step_after` drops it)."""

    closing = ""

    def __init__(self, *, tools: bool | Tools) -> None:
        super().__init__()
        self._tools = bool(tools)
        self._buf = ""
        self._state = "content"
        self._ws = ""             # trailing whitespace of the content, held while a call could follow
        self._lstrip = False      # drop the leading whitespace of the next content (it follows calls)

    def _emit(self, text: str, delta: ReplyDelta) -> None:
        """``text`` is content: its trailing whitespace is held until more content comes."""
        if self._lstrip:
            text = text.lstrip()
            if not text:
                return
            self._lstrip = False
        body = text.rstrip()
        if not body:
            self._ws += text
            return
        delta.content += self._ws + body
        self._ws = text[len(body):]

    def _emit_to(self, end: int, delta: ReplyDelta) -> None:
        """The buffer's first ``end`` characters are content: :meth:`_emit` them and keep the rest."""
        self._emit(self._buf[:end], delta)
        self._buf = self._buf[end:]

    def _emit_all_but_partial(self, markers: Collection[str], delta: ReplyDelta) -> None:
        """No marker in the buffer: all of it is content but a tail that could begin one of ``markers``."""
        self._emit_to(len(self._buf) - longest_partial_suffix(self._buf, markers), delta)

    def _feed(self, text: str, delta: ReplyDelta) -> None:
        if not self._tools:
            delta.content += text
            return
        self._buf += text
        while self._step(delta):
            pass

    def _step(self, delta: ReplyDelta) -> bool:
        raise NotImplementedError

    def _step_after(self) -> bool:
        """After calls: whitespace and one :attr:`closing` marker are the markup's; anything else is content."""
        text = self._buf.lstrip()
        if not text:
            self._buf = ""
            return False
        if self.closing and text.startswith(self.closing):
            self._buf = text[len(self.closing):]
        elif self.closing and self.closing.startswith(text):
            self._buf = text
            return False
        self._state = "content"
        return True


@dataclass(frozen=True)
class FunctionSpec:
    """One tool a grammar may call: its name and its arguments' JSON schema."""

    name: str
    parameters: dict[str, Any]

    def properties(self) -> list[tuple[str, dict[str, Any], bool]]:
        """Each declared argument: (name, schema, required), in the schema's order."""
        props = self.parameters.get("properties") or {}
        required = set(self.parameters.get("required") or ())
        return [(k, v if isinstance(v, dict) else {}, k in required) for k, v in props.items()]


def function_specs(tools: Tools, name: str | None = None) -> list[FunctionSpec]:
    """The functions of OpenAI ``tools`` (only ``name`` when given); a UserError for a tool that is not a
    function with a name, or for a ``name`` that is not among them."""
    specs: list[FunctionSpec] = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
            raise UserError(f"tools[{i}] is not a function with a name")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, Mapping):
            raise UserError(f"tools[{i}].function.parameters is not a JSON schema object")
        specs.append(FunctionSpec(function["name"], dict(parameters)))
    if name is not None:
        specs = [s for s in specs if s.name == name]
        if not specs:
            raise UserError(f"tool_choice names the function {name!r}, which is not among the request's tools")
    if not specs:
        raise UserError("a tool call was required but the request has no tools")
    return specs


def schemas_by_name(tools: bool | Tools) -> dict[str, dict[str, Any]]:
    """Each function's parameters schema, from ``tools`` when it is the request's tool list (else empty)."""
    if isinstance(tools, bool) or not tools:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            params = function.get("parameters")
            out[function["name"]] = dict(params) if isinstance(params, Mapping) else {}
    return out


def is_string_schema(schema: Mapping[str, Any] | None) -> bool:
    """Whether an argument's schema says it is text (a value written bare in XML-like markup stays a string)."""
    if not schema:
        return False
    kind = schema.get("type")
    if kind == "string":
        return True
    if isinstance(kind, list):
        return "string" in kind and len([k for k in kind if k != "null"]) == 1
    return "enum" in schema and all(isinstance(v, str) for v in schema["enum"])


def xml_value(text: str, schema: Mapping[str, Any] | None) -> Any:
    """An argument written bare between tags (GLM, MiniMax): JSON when it parses as JSON and the schema does
    not say string; else the text itself. Without a schema, only a value that parses to something other
    than a JSON string is read as JSON (the templates write strings bare)."""
    if is_string_schema(schema):
        return text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if schema is None and isinstance(value, str):
        return text
    return value


class Lark:
    """Pieces of a Lark grammar in llguidance's dialect: literals, markers that may be special tokens, JSON."""

    def __init__(self, special_tokens: Mapping[str, int] | None) -> None:
        self.special = dict(special_tokens or {})
        self.rules: list[str] = []

    @staticmethod
    def text(s: str) -> str:
        """A literal string (JSON's escapes are Lark's)."""
        return json.dumps(s, ensure_ascii=False)

    def marker(self, s: str) -> str:
        """A marker: the special token when the model's vocabulary has it as one (its text cannot be spelled
        by ordinary tokens then), else the literal text."""
        return f"<[{self.special[s]}]>" if s in self.special else self.text(s)

    def rule(self, name: str, body: str) -> str:
        self.rules.append(f"{name}: {body}")
        return name

    def json_rule(self, name: str, schema: Mapping[str, Any]) -> str:
        """JSON valid under ``schema``, spelled as every other grammar of the server spells it (``", "`` and
        ``": "``, as the templates' ``tojson`` writes it, and no free whitespace)."""
        return self.rule(name, lark_json(schema))

    def text_until(self, name: str, close: str, schema: Mapping[str, Any] | None = None) -> str:
        """Text that ends at the first ``close`` (which it includes): one of a string schema's ``enum``, or
        held to its ``pattern`` or ``minLength``/``maxLength`` (without ``<``, so the text cannot run into
        markup), else free."""
        schema = schema or {}
        if "enum" in schema or "const" in schema:
            values = schema["enum"] if "enum" in schema else [schema["const"]]
            choices = " | ".join(self.text(str(v)) for v in values)
            return self.rule(name, f"({choices}) {self.marker(close)}")
        if "pattern" in schema:
            pattern = str(schema["pattern"]).removeprefix("^").removesuffix("$").replace("/", "\\/")
            return self.rule(name, f"/{pattern}/ {self.marker(close)}")
        low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
        if low or high is not None:
            bounds = f"{low},{'' if high is None else int(high)}"
            return self.rule(name, f"/[^<]{{{bounds}}}/ {self.marker(close)}")
        if close in self.special:
            # Ordinary text can never hold a special token, so the text simply runs up to it.
            return self.rule(name, f"/(?s:.*)/ {self.marker(close)}")
        self.rules.append(f"{name}[suffix={self.text(close)}]: /(?s:.*)/")
        return name

    def grammar(self, start: str) -> str:
        return "\n".join([f"start: {start}", *self.rules]) + "\n"


def repeat(item: str, parallel: bool, separator: str = "") -> str:
    """One ``item``, or one or more with ``separator`` (a Lark expression) between them."""
    if not parallel:
        return item
    sep = f"{separator} " if separator else ""
    return f"{item} ({sep}{item})*"


class ChatSyntax:
    """What a template's replies look like: how to parse them and how to force a tool call in them."""

    name: str = "plain"
    thinks: bool = False
    reasoning_close: str = "</think>"

    def parser(self, *, prompt: str, tools: bool | Tools) -> ReplyParser:
        """A parser for one generation. ``prompt``: the rendered prompt (whether it opened or closed the
        thinking span at its end); ``tools``: whether the request had tools (the request's tool list may be
        passed instead of True, so that arguments written bare follow their declared types)."""
        raise NotImplementedError

    def tool_call_grammar(self, tools: Tools, *, name: str | None = None, parallel: bool = True,
                          special_tokens: Mapping[str, int] | None = None) -> str:
        """A Lark grammar (llguidance's dialect, start rule ``start``) that admits one tool call (or, with
        ``parallel``, one or more) in this syntax, of ``tools`` or only the function ``name``; arguments are
        held to each function's schema by ``%json``. ``special_tokens`` maps marker texts that the model's
        vocabulary has as single special tokens to their ids, so the grammar asks for those tokens.

        The rule ``call`` is one call of any of the functions (:meth:`_call`); :meth:`_calls` frames it."""
        g = Lark(special_tokens)
        alternatives = [g.rule(f"call_{i}", self._call(g, spec, i))
                        for i, spec in enumerate(function_specs(tools, name))]
        g.rule("call", " | ".join(alternatives))
        return g.grammar(self._calls(g, parallel))

    def _call(self, g: Lark, spec: FunctionSpec, i: int) -> str:
        """The Lark expression of one call of ``spec`` (the ``i``-th function: its rules' names)."""
        raise NotImplementedError

    def _calls(self, g: Lark, parallel: bool) -> str:
        """The start rule's expression: the rule ``call`` once, or repeated with ``parallel``, in its markers."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<ChatSyntax {self.name} thinks={self.thinks}>"
