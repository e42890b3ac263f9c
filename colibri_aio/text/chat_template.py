"""Chat templates: the model file's Jinja code, run in a sandbox with limits on time and size.

A chat template is code from whoever made the model file. Jinja's
:class:`ImmutableSandboxedEnvironment` already refuses attribute access to
internals (``''.__class__``), calls to unsafe methods and mutation of the
caller's objects; the environment here has a loader that loads nothing, so
``import``, ``include`` and ``extends`` are refused. What a sandbox does not stop
is a template that runs forever or builds gigabytes; these limits do:

- **time**: :data:`MAX_RENDER_SECONDS` of wall time per render. A trace
  function on the template's own frames (only those: the rest of the
  process runs untraced) checks the clock on every line, so a loop that never
  ends, or nested loops of 10^10 steps, stop there;
- **size**: :data:`MAX_OUTPUT_CHARS` for the rendered text, which is read
  chunk by chunk as it is produced; and before each operation that could make
  a large string or list in one step (``*``, ``**``, ``+``, ``%``, every call and
  filter, attribute and item reads) the operands are checked against the same
  cap, and the characters produced by these operations in one render are
  counted against :data:`MAX_PRODUCED_CHARS` (so that building large strings
  over and over and dropping them is stopped too);
- **source**: a template longer than :data:`MAX_TEMPLATE_CHARS` is not compiled.

Anything that goes wrong (a syntax error, a refused operation, an exception
the template raises or causes) becomes one :class:`UserError` line naming the
model file. What is left: one C-level operation that multiplies inputs that
are each under the cap in a way none of these checks estimates could still
allocate much more than the cap before Python sees its result.
"""
from __future__ import annotations

import functools
import json
import math
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any

from jinja2 import BaseLoader, TemplateError, TemplateSyntaxError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from colibri_aio.errors import UserError

MAX_TEMPLATE_CHARS = 1 << 20   # 1 Mi characters of template source (real ones are 1-20 KB)
MAX_RENDER_SECONDS = 5.0       # real templates render in milliseconds
MAX_OUTPUT_CHARS = 1 << 25     # 32 Mi characters: more than any model's context holds as text
MAX_PRODUCED_CHARS = 4 * MAX_OUTPUT_CHARS
MAX_INT_BITS = 1 << 12         # integers a template computes with (4096 bits, ~1233 digits)
_TEMPLATE_FILE = "<template>"  # the file name Jinja compiles a template from a string under
_DIGITS = re.compile(r"\d+")


class TemplateLimitError(SecurityError):
    """A chat template went past a limit on time or size."""


class _Budget:
    """The limits of one render: a deadline and the characters produced so far."""

    def __init__(self, seconds: float, produced: int) -> None:
        self.deadline = time.monotonic() + seconds
        self.seconds = seconds
        self.left = produced

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"rendering took longer than {self.seconds:g} s")

    def spend(self, chars: int) -> None:
        self.left -= chars
        if self.left < 0:
            raise TemplateLimitError(f"the template produced more than {MAX_PRODUCED_CHARS} characters")


_render = threading.local()  # .budget while this thread renders a template


def _budget() -> _Budget | None:
    return getattr(_render, "budget", None)


def _size(value: Any, depth: int = 0) -> int:
    """The characters ``value`` would take as text, roughly, looking into lists and dicts (a list of many
    references to one long string is long text); stops counting past the output cap."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple, dict)) and depth < 8:
        total = 2
        for item in (value.items() if isinstance(value, dict) else value):
            total += 2 + _size(item, depth + 1)
            if total > MAX_OUTPUT_CHARS:
                break
        return total
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length() // 3 + 1
    return 8


def _length(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple, dict)) else 0


def _check_size(value: Any, what: str, *, made: bool = True) -> Any:
    """A value a template operation returned: refused past the output cap; counted against the
    render's budget if the operation ``made`` it (a new string, not one read from a variable)."""
    if _length(value) > MAX_OUTPUT_CHARS:
        raise TemplateLimitError(f"{what} would be larger than {MAX_OUTPUT_CHARS} characters")
    budget = _budget()
    if made and budget is not None and isinstance(value, str):
        budget.spend(len(value))
    return value


def _check_arguments(args: Iterable[Any], what: str) -> None:
    """No count or width past the cap, no argument past it."""
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_OUTPUT_CHARS:
            raise TemplateLimitError(f"{what} is given {a}, more than the limit of {MAX_OUTPUT_CHARS}")
        if _length(a) > MAX_OUTPUT_CHARS:
            raise TemplateLimitError(f"{what} is given a value larger than {MAX_OUTPUT_CHARS} characters")


def _refuse_past_cap(estimate: int, what: str) -> None:
    if estimate > MAX_OUTPUT_CHARS:
        raise TemplateLimitError(f"{what} would build more than {MAX_OUTPUT_CHARS} characters")


def _check_format(text: str) -> None:
    """A format string with a width or precision past the cap would build that much text."""
    for digits in _DIGITS.findall(text):
        if len(digits) > 9 or int(digits) > MAX_OUTPUT_CHARS:
            raise TemplateLimitError(f"a format string asks for a field of {digits} characters")


def _check_binop(operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                _refuse_past_cap(_size(seq) * max(n, 0), f"repeating a {type(seq).__name__} {n} times")
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateLimitError(f"an integer product of more than {MAX_INT_BITS} bits")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if right * math.log2(abs(left)) > MAX_INT_BITS:
                raise TemplateLimitError(f"an integer power of more than {MAX_INT_BITS} bits")
    elif operator == "+":
        if isinstance(left, (str, list, tuple)):
            _refuse_past_cap(_size(left) + _size(right), "a concatenation")
    elif operator == "%" and isinstance(left, str):
        _check_format(left)


def _replace_estimate(text: str, old: Any, new: Any) -> int:
    return (len(text) // max(len(str(old)), 1) + 1) * len(str(new)) + len(text)


def _check_call(obj: Any, args: tuple, kwargs: dict) -> None:
    """Arguments, and what the string methods that multiply their input would build."""
    name = getattr(obj, "__name__", None) or getattr(obj, "name", None) or type(obj).__name__
    _check_arguments((*args, *kwargs.values()), f"{name}()")
    owner = getattr(obj, "__self__", None)
    if isinstance(owner, str) and name == "replace" and len(args) >= 2:
        _refuse_past_cap(_replace_estimate(owner, args[0], args[1]), "str.replace")
    if isinstance(owner, str) and name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        _refuse_past_cap(owner.count("\t") * (tab if isinstance(tab, int) else 8) + len(owner), "str.expandtabs")
    if isinstance(owner, str) and name == "join" and args and isinstance(args[0], (list, tuple)):
        _refuse_past_cap(len(owner) * len(args[0]) + _size(args[0]), "str.join")


def _check_filter(name: str, values: list, kwargs: dict) -> None:
    """What the filters that multiply their input would build."""
    if not values:
        return
    text = values[0] if isinstance(values[0], str) else ""
    rest = [*values[1:], *kwargs.values()]
    if name == "format":
        _check_format(text)
    elif name == "join" and isinstance(values[0], (list, tuple)):
        sep = rest[0] if rest and isinstance(rest[0], str) else ""
        _refuse_past_cap(len(sep) * len(values[0]) + _size(values[0]), "filter join")
    elif name == "replace" and len(rest) >= 2:
        _refuse_past_cap(_replace_estimate(text, rest[0], rest[1]), "filter replace")
    elif name == "indent" and rest:
        width = rest[0] if isinstance(rest[0], (int, str)) else 4
        _refuse_past_cap((text.count("\n") + 1) * (_length(width) or max(int(width), 0)) + len(text), "filter indent")
    elif name == "wordwrap":
        width = rest[0] if rest and isinstance(rest[0], int) else 79
        wrap = next((r for r in rest if isinstance(r, str)), "\n")
        _refuse_past_cap((len(text) // max(width, 1) + 1) * len(wrap) + len(text), "filter wordwrap")


def _guard_filter(name: str, f: Callable) -> Callable:
    """A filter held to the limits; Jinja's pass_context/pass_environment marker (and the argument it
    passes first) are kept."""
    skip = 1 if hasattr(f, "jinja_pass_arg") else 0

    @functools.wraps(f)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        if budget is not None:
            budget.tick()
        head, values = args[:skip], list(args[skip:])
        if name == "join" and values and not isinstance(values[0], (str, list, tuple, dict)):
            values[0] = list(values[0])  # a generator: made into a list (each item was checked) to be measured
        _check_arguments((*values, *kwargs.values()), f"filter {name}")
        _check_filter(name, values, kwargs)
        return _check_size(f(*head, *values, **kwargs), f"the result of filter {name}")

    return guarded


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes; chat templates want the plain JSON text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class GenerationTag(Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` and renders the body unchanged.

    Templates written for training mark the assistant's text with this tag
    (Hugging Face uses it to build loss masks); for inference it is a no-op.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _NoTemplates(BaseLoader):
    """A chat template is one self-contained text: ``import``, ``include`` and ``extends`` find nothing."""

    def get_source(self, environment: Any, template: str) -> Any:
        raise SecurityError(f"a chat template cannot load other templates ({template!r})")


class ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox with the size limits at its hooks (binary operators, calls, attribute and item reads)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return _check_size(super().call_binop(context, operator, left, right), f"the result of {operator}")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - Jinja's names
        budget = _budget()
        if budget is not None:
            budget.tick()
        _check_call(__obj, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        return _check_size(result, "the result of a call")

    def getattr(self, obj: Any, attribute: str) -> Any:
        if isinstance(obj, str) and attribute in ("format", "format_map"):
            _check_format(obj)
        return _check_size(super().getattr(obj, attribute), f"attribute {attribute}", made=False)

    def getitem(self, obj: Any, argument: Any) -> Any:
        return _check_size(super().getitem(obj, argument), "an item", made=False)

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        """Refuse at once (Jinja's default is an undefined value that only fails when used further)."""
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def make_template_environment() -> ChatTemplateEnvironment:
    """The sandboxed environment with the helpers Hugging Face chat templates expect, every filter guarded."""
    env = ChatTemplateEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, GenerationTag],
                                  loader=_NoTemplates())
    del env.globals["lipsum"]  # no chat template writes lorem ipsum; with a huge count it is a memory bomb
    env.filters["tojson"] = _tojson
    env.filters = {name: _guard_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _trace_template_lines(budget: _Budget) -> Callable:
    """A trace function that follows only frames of template code, checking the deadline on each line."""

    def on_line(frame: Any, event: str, arg: Any) -> Callable:
        if event == "line":
            budget.tick()
        return on_line

    def on_call(frame: Any, event: str, arg: Any) -> Callable | None:
        if frame.f_code.co_filename == _TEMPLATE_FILE:
            budget.tick()
            return on_line
        return None

    return on_call


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, TemplateSyntaxError):
        return f"{exc.message} (line {exc.lineno})"
    text = " ".join(str(exc).split()) or type(exc).__name__
    if not isinstance(exc, TemplateError):
        text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= 300 else text[:297] + "..."


class ChatTemplate:
    """One model's chat template, compiled once; :meth:`render` runs it within the limits.

    ``origin`` (the model file) starts every error message.
    """

    def __init__(self, source: str, origin: str = "") -> None:
        self.origin = f"{origin}: " if origin else ""
        if len(source) > MAX_TEMPLATE_CHARS:
            raise UserError(f"{self.origin}the chat template has {len(source)} characters, more than "
                            f"{MAX_TEMPLATE_CHARS}")
        try:
            self._template = make_template_environment().from_string(source)
        except Exception as exc:  # noqa: BLE001 - any failure to compile the file's code is the file's
            raise UserError(f"{self.origin}the chat template does not compile: {_one_line(exc)}") from None

    def render(self, variables: Mapping[str, Any], *, seconds: float | None = None) -> str:
        """The template's text for ``variables``; a :class:`UserError` when it fails or passes a limit
        (``seconds``: the time limit, :data:`MAX_RENDER_SECONDS` by default)."""
        budget = _Budget(MAX_RENDER_SECONDS if seconds is None else seconds, MAX_PRODUCED_CHARS)
        before, previous = _budget(), sys.gettrace()
        _render.budget = budget
        sys.settrace(_trace_template_lines(budget))
        chunks, total = [], 0
        try:
            for chunk in self._template.generate(**variables):
                total += len(chunk)
                if total > MAX_OUTPUT_CHARS:
                    raise TemplateLimitError(f"the rendered text is longer than {MAX_OUTPUT_CHARS} characters")
                chunks.append(chunk)
        except Exception as exc:  # noqa: BLE001 - whatever the template's code raises is the template's failure
            raise UserError(f"{self.origin}the chat template failed: {_one_line(exc)}") from None
        finally:
            sys.settrace(previous)
            _render.budget = before
        text = "".join(chunks)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # bytes of the file that were not UTF-8, kept as lone surrogates
            raise UserError(f"{self.origin}the chat template rendered text that is not UTF-8 "
                            f"(at character {exc.start})") from None
        return text
