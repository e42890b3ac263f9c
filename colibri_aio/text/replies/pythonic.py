"""Pythonic tool calls (Llama 4, Llama 3.2 and their kin): a Python list of calls with keyword arguments,

    [get_weather(city="Paris", days=3), search(query="cafés")]

written after any content, sometimes inside ``<|python_start|>…<|python_end|>``. The list is read with
Python's own parser (:mod:`ast`, nothing is evaluated): it must be a list of calls of plain or dotted names
with keyword arguments only, each value a literal (a string, a number, True/False/None, or lists, tuples and
dicts of them). Anything else (a list of other things, a positional argument, a variable, an expression) is
not a call: the text stays content, as broken markup does in the other syntaxes. Tool names with hyphens
(``get-weather(``) and arguments named by Python keywords (``from=``), which OpenAI tools may have and the
grammar then writes, are read too (stand-in names for Python's parser, mapped back).

Values are read both as Python writes them (``True``, ``None``) and as JSON does (``true``, ``null``): the
forced-call grammar (:meth:`PythonicSyntax.tool_call_grammar`) writes each argument as JSON, because
llguidance's ``%json`` then holds it to its schema (enums, patterns, lengths, nested objects), and every JSON
value is a Python literal except those three names, which are read here as JSON means them. A double-quoted
string is decoded as JSON when it is valid JSON (``\\/`` and surrogate pairs mean what JSON says).

Templates write past calls with every value quoted (``days="3"``): when the request's tools are known, a
string whose schema says it is not a string (an integer, an object…) is read as the literal it spells.

Streaming: text before a ``[`` streams as content; a ``[`` is held while what follows could still be
``[name(`` (an identifier, then an open parenthesis). Once it is, the list is held until its brackets close
(strings and nesting followed), then read; if it does not read as calls it is given back as content.
"""
from __future__ import annotations

import ast
import io
import json
import keyword
import re
import tokenize
import warnings
from collections.abc import Mapping
from typing import Any

from colibri_aio.text.grammar import lark_json
from colibri_aio.text.replies.base import (ChatSyntax, FunctionSpec, Lark, ReplyDelta, ReplyParser, ToolCall, Tools,
                                           TrailingCallsParser,
                                           first_marker, is_string_schema, make_call, repeat, schemas_by_name)

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_JSON_NAMES = {"true": True, "false": False, "null": None}
_NAME_START = re.compile(r"[A-Za-z_]")
_NAME_CHAR = re.compile(r"[\w.-]")
_CLOSERS = {")": "(", "]": "[", "}": "{"}


class _NotLiteral(ValueError):
    """A part of the call list that is not a literal value."""


def _literal(node: ast.AST, source: str) -> Any:
    """The JSON value a literal node spells; :class:`_NotLiteral` for anything else."""
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, str):
            segment = ast.get_source_segment(source, node) or ""
            if segment.startswith('"') and not segment.startswith('"""'):
                try:
                    decoded = json.loads(segment)
                except ValueError:
                    return value
                return decoded if isinstance(decoded, str) else value
            return value
        if value is None or isinstance(value, (bool, int)):
            return value
        if isinstance(value, float) and value == value and abs(value) != float("inf"):
            return value
        raise _NotLiteral("not a JSON value")
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand, source)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _NotLiteral("a sign on something other than a number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item, source) for item in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for key, value in zip(node.keys, node.values):
            if key is None:   # {**other}
                raise _NotLiteral("an unpacked dict")
            name = _literal(key, source)
            if not isinstance(name, str):
                raise _NotLiteral("a dict key that is not a string")
            out[name] = _literal(value, source)
        return out
    raise _NotLiteral(type(node).__name__)


def _dotted(node: ast.AST) -> str | None:
    """``name`` or ``a.b.name`` as text; None for any other callee."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


_TYPES: dict[str, tuple[type, ...]] = {"integer": (int,), "number": (int, float), "boolean": (bool,),
                                       "array": (list,), "object": (dict,), "null": (type(None),)}


def _typed(value: Any, schema: Mapping[str, Any] | None) -> Any:
    """A string argument read as the literal it spells when its schema says it is not a string (templates
    quote every value they write); the string itself otherwise."""
    if not isinstance(value, str) or not schema or is_string_schema(schema):
        return value
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or ())
    wanted = tuple(t for kind in kinds for t in _TYPES.get(kind, ()))
    if not wanted:
        return value
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            node = ast.parse(value.strip(), mode="eval").body
        read = _literal(node, value.strip())
    except (SyntaxError, ValueError, RecursionError):
        return value
    if isinstance(read, bool) and bool not in wanted:
        return value
    return read if isinstance(read, wanted) else value


def _placeholders(text: str) -> tuple[str, dict[str, str]]:
    """``text`` with what a tool's name or argument may be but a Python name may not, each replaced by a
    stand-in name: a callee spelled with hyphens (``get-weather(``) and an argument named by a Python keyword
    (``from="Paris"``). Returns the text and each stand-in's original; the text unchanged when it does not
    tokenize."""
    try:
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(text).readline)
                  if t.type in (tokenize.NAME, tokenize.OP, tokenize.STRING, tokenize.NUMBER)]
    except (tokenize.TokenError, SyntaxError):
        return text, {}
    line_starts = [0]
    for line in text.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))

    def offset(pos: tuple[int, int]) -> int:
        return line_starts[pos[0] - 1] + pos[1]

    edits: list[tuple[int, int, str]] = []
    depth = 0
    for i, tok in enumerate(tokens):
        before = tokens[i - 1].string if i else ""
        after = tokens[i + 1].string if i + 1 < len(tokens) else ""
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        elif tok.type == tokenize.NAME and keyword.iskeyword(tok.string) and before in ("(", ",") and after == "=":
            edits.append((offset(tok.start), offset(tok.end), tok.string))
        elif tok.type == tokenize.NAME and depth == 1 and before in ("[", ","):
            j = i   # a callee: NAME, then "-" or "." and NAME, up to "("
            while j + 2 < len(tokens) and tokens[j + 1].string in ("-", ".") and tokens[j + 2].type == tokenize.NAME:
                j += 2
            name = text[offset(tok.start):offset(tokens[j].end)]
            if "-" in name and j + 1 < len(tokens) and tokens[j + 1].string == "(" and re.fullmatch(r"[\w.-]+", name):
                edits.append((offset(tok.start), offset(tokens[j].end), name))
    originals: dict[str, str] = {}
    n = 0
    for start, end, original in reversed(edits):
        while f"_{n}_" in text:
            n += 1
        stand_in = f"_{n}_"
        n += 1
        originals[stand_in] = original
        text = text[:start] + stand_in + text[end:]
    return text, originals


def read_calls(text: str, schemas: Mapping[str, Mapping[str, Any]] | None = None) -> list[ToolCall] | None:
    """The calls of a list written in Python, ``[f(a=1), g(b="x")]``; None unless it is exactly that.
    ``schemas``: each function's parameters schema, for reading quoted values by their declared type.
    Tool names with hyphens and arguments named by Python keywords (``from=``) are read too."""
    source = text.strip()
    originals: dict[str, str] = {}
    tree = _parse(source)
    if tree is None:
        source, originals = _placeholders(source)
        tree = _parse(source) if originals else None
    if tree is None:
        return None
    body = tree.body
    if not isinstance(body, ast.List) or not body.elts:
        return None
    calls = []
    for node in body.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _dotted(node.func)
        if name is None:
            return None
        name = originals.get(name, name)
        props = ((schemas or {}).get(name) or {}).get("properties") or {}
        arguments = {}
        for kw in node.keywords:
            key = originals.get(kw.arg, kw.arg) if kw.arg is not None else None
            if key is None or key in arguments:   # f(**x), or a name given twice
                return None
            try:
                value = _literal(kw.value, source)
            except (_NotLiteral, RecursionError):
                return None
            schema = props.get(key)
            arguments[key] = _typed(value, schema if isinstance(schema, Mapping) else None)
        call = make_call(name, arguments)
        if call is None:
            return None
        calls.append(call)
    return calls


def _parse(source: str) -> ast.Expression | None:
    try:
        with warnings.catch_warnings():
            # JSON's "\/" is an escape Python does not know: it warns, keeps the backslash, and _literal
            # decodes such a string as JSON instead
            warnings.simplefilter("ignore")
            return ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _opening(text: str, i: int) -> int | None:
    """Whether ``text[i:]`` (a ``[``) opens a call list: the index past ``[name(`` when it does, -1 when it
    cannot, None when the text ends before that is known."""
    j = i + 1
    n = len(text)
    while j < n and text[j].isspace():
        j += 1
    if j == n:
        return None
    if not _NAME_START.match(text[j]):
        return -1
    while j < n and _NAME_CHAR.match(text[j]):
        j += 1
    while j < n and text[j].isspace():
        j += 1
    if j == n:
        return None
    return j + 1 if text[j] == "(" else -1


def scan_list(text: str, pos: int, stack: list[str], quote: str) -> tuple[str, int, str]:
    """Follows a call list's brackets and strings from ``pos`` (``stack``, its open brackets, is updated; ``quote``
    is the open string's quote or ""). Returns (``closed``, the index past its closing bracket), (``broken``, the
    index past a bracket that closes one it did not open) or (``open``, where to go on from), with the quote."""
    n = len(text)
    while pos < n:
        ch = text[pos]
        if quote:
            if ch == "\\":
                if pos + 1 == n:
                    break          # the escaped character is still to come
                pos += 2
                continue
            if ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            stack.append(ch)
        elif ch in _CLOSERS:
            if not stack or stack[-1] != _CLOSERS[ch]:
                return "broken", pos + 1, quote
            stack.pop()
            if not stack:
                return "closed", pos + 1, quote
        pos += 1
    return "open", pos, quote


class PythonicParser(TrailingCallsParser):
    """Content and call lists from a reply (see the module's docstring). States: ``content``; ``list`` (a call
    list opened, held until it closes); ``after`` (a list was read: whitespace and ``<|python_end|>`` that
    follow it are the markup's)."""

    closing = PYTHON_END

    def __init__(self, *, tools: bool | Tools) -> None:
        super().__init__(tools=tools)
        self._schemas = schemas_by_name(tools)
        self._lead = ""          # what came before the list's "[" (whitespace, <|python_start|>), held with it
        self._stack: list[str] = []   # the call list's open brackets,
        self._quote = ""              # its open string's quote,
        self._at = 0                  # and how far it has been scanned

    def _step(self, delta: ReplyDelta) -> bool:
        if self._state == "list":
            return self._step_list(delta)
        if self._state == "after":
            return self._step_after()
        return self._step_content(delta)

    def _step_content(self, delta: ReplyDelta) -> bool:
        markers = ["[", PYTHON_START]
        found = first_marker(self._buf, markers)
        if found is None:
            self._emit_all_but_partial(markers, delta)
            return False
        i, marker = found
        if marker == PYTHON_START:
            j = i + len(PYTHON_START)
            rest = self._buf[j:].lstrip()
            if not rest:
                self._emit_to(i, delta)
                return False
            bracket = len(self._buf) - len(rest)
            if rest[0] != "[":
                self._emit_to(j, delta)   # the marker, with nothing that calls after it: content
                return True
        else:
            bracket = i
        opened = _opening(self._buf, bracket)
        if opened is None:
            self._emit_to(i, delta)
            return False
        if opened < 0:
            self._emit_to(bracket + 1, delta)
            return True
        self._emit(self._buf[:i], delta)
        self._lead, self._ws = self._ws + self._buf[i:bracket], ""
        self._buf = self._buf[bracket:]
        self._state, self._stack, self._quote, self._at = "list", [], "", 0
        return True

    def _step_list(self, delta: ReplyDelta) -> bool:
        status, end, self._quote = scan_list(self._buf, self._at, self._stack, self._quote)
        if status == "open":
            self._at = end
            return False
        calls = read_calls(self._buf[:end], self._schemas) if status == "closed" else None
        text, self._buf = self._buf[:end], self._buf[end:]
        if calls is None:
            # not a call list (or a bracket closed one it did not open): the text as written, as content
            self._give_back(self._lead + text, delta)
            return True
        delta.tool_calls.extend(calls)
        self._lead, self._state, self._lstrip = "", "after", True
        return True

    def _give_back(self, text: str, delta: ReplyDelta) -> None:
        """Held text that was not a call list: content, as written."""
        self._lstrip = False
        self._emit(text, delta)
        self._lead, self._state = "", "content"

    def _finish(self, delta: ReplyDelta) -> None:
        if not self._tools:
            return
        if self._state == "list":
            self._give_back(self._lead + self._buf, delta)
        elif self._state == "after":
            if self._buf.strip() and self._buf.strip() != PYTHON_END:
                self._state = "content"
                self._emit(self._buf, delta)
        else:
            self._emit(self._buf, delta)
        self._buf = ""
        if self._ws and not self._lstrip:
            delta.content += self._ws   # whitespace after the last words, at the very end: the model's own
        self._ws = ""


class PythonicSyntax(ChatSyntax):
    name = "pythonic"
    thinks = False

    def parser(self, *, prompt: str, tools: bool | Tools) -> ReplyParser:
        return PythonicParser(tools=tools)

    def _call(self, g: Lark, spec: FunctionSpec, i: int) -> str:
        """``name(key=<JSON>, …)``: the declared arguments in the schema's order, the optional ones may be left
        out, with commas only between those written. Every rule matches some text; where a rule may be
        skipped its use carries ``?``."""
        shared = {k: spec.parameters[k] for k in ("$defs", "definitions") if k in spec.parameters}
        if not spec.properties() and spec.parameters.get("additionalProperties") is not False:
            # no arguments declared: any, each a name and a JSON value
            pair = g.rule(f"pair_{i}", f'/[A-Za-z_][A-Za-z0-9_]*/ "=" {lark_json({})}')
            return f'{g.text(spec.name + "(")} ({pair} (", " {pair})*)? ")"'

        def use(rule: str | None, nullable: bool) -> str:
            return "" if rule is None else f" {rule}?" if nullable else f" {rule}"

        # after: the arguments from k on, some argument already written (so each comes after a comma);
        # first: the same with none written yet. None: no arguments left; nullable: all that are left optional.
        after: str | None = None
        first: str | None = None
        nullable = True
        for k, (key, schema, required) in reversed(list(enumerate(spec.properties()))):
            value = g.rule(f"arg_{i}_{k}", lark_json({**shared, **schema}))
            item = f"{g.text(key + '=')} {value}"
            rest = use(after, nullable)
            if required:
                after_body, first_body = f'", " {item}{rest}', f"{item}{rest}"
            else:
                after_body = f'", " {item}{rest}' + (f" | {after}" if after else "")
                first_body = f"{item}{rest}" + (f" | {first}" if first else "")
            after = g.rule(f"after_{i}_{k}", after_body)
            first = g.rule(f"first_{i}_{k}", first_body)
            nullable = nullable and not required
        return f'{g.text(spec.name + "(")}{use(first, nullable)} ")"'

    def _calls(self, g: Lark, parallel: bool) -> str:
        return f'"[" {repeat("call", parallel, chr(34) + ", " + chr(34))} "]"'
