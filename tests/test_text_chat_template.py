"""Chat templates are code from the model file: the sandbox refuses escapes, imports, endless loops and
runaway sizes, each as one UserError line that names the model file."""
from __future__ import annotations

import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

import colibri_aio.text.chat_template as chat_template
from colibri_aio.errors import UserError
from colibri_aio.text.chat_template import MAX_OUTPUT_CHARS, ChatTemplate

from support import FIXTURES, main_in_process

sys.path.insert(0, str(FIXTURES.parent / "tools"))
from gguf_fuzz.layout import read_layout  # noqa: E402
from gguf_fuzz.mutate import replace_template  # noqa: E402

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
ORIGIN = "/models/hostile.gguf"


def render(source: str, **variables) -> str:
    return ChatTemplate(source, ORIGIN).render({"messages": MESSAGES, "add_generation_prompt": True, **variables})


def refused(source: str, match: str) -> str:
    with pytest.raises(UserError, match=match) as info:
        render(source)
    message = str(info.value)
    assert message.startswith(f"{ORIGIN}: the chat template ") and "\n" not in message
    return message


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__base__ }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ self.__init__.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
    "{% set _ = messages.append({'role': 'user'}) %}",
])
def test_attribute_access_and_mutation_are_refused(source: str) -> None:
    refused(source, "unsafe|not safely callable")


@pytest.mark.parametrize("source, name", [
    ("{% import 'os' as os %}{{ os.system('id') }}", "os"),
    ("{% include '/etc/passwd' %}", "/etc/passwd"),
    ("{% extends 'base.html' %}", "base.html"),
    ("{% from 'subprocess' import run %}", "subprocess"),
])
def test_imports_and_includes_are_refused(source: str, name: str) -> None:
    refused(source, f"cannot load other templates \\('{name}'\\)")


def test_a_loop_without_end_stops_at_the_time_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_template, "MAX_RENDER_SECONDS", 0.5)
    t0 = time.monotonic()
    refused("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "rendering took longer than 0.5 s")
    assert time.monotonic() - t0 < 10
    refused("{% macro f(n) %}{% for i in range(100000) %}{% endfor %}{{ f(n) if n else '' }}{% endmacro %}{{ f(1) }}",
            "longer than 0.5 s|recursion")


def test_rendering_gigabytes_stops_at_the_output_limit() -> None:
    refused("{% for i in range(100000) %}{% for j in range(100000) %}0123456789abcdef0123456789abcdef{% endfor %}"
            "{% endfor %}", f"the rendered text is longer than {MAX_OUTPUT_CHARS} characters")


@pytest.mark.parametrize("source", [
    "{{ 'a' * 100000000000 }}",
    "{{ (messages * 1000000000) | length }}",
    "{% set big = ['x' * 1000000] * 1000 %}{{ big }}",
    "{{ 10 ** 100000000 }}",
    "{{ '%0999999999d' % 1 }}",
    "{{ '{:>9999999999}'.format('x') }}",
    "{{ '%s' | format(1) }}{{ '%999999999s' | format(1) }}",
    "{{ 'x' | center(10000000000) }}",
    "{{ ('a\n' * 100000) | indent(100000) }}",
    "{{ ('a' * 1000000).replace('', 'bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb') }}",
    "{{ (range(100000) | list) | join('x' * 10000) }}",
    "{{ range(10000000000) | list }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('ab') }}",
    "{% set ns = namespace(n=0) %}{% for i in range(100000) %}{% set ns.n = ns.n + ('x' * 1000000) | length %}"
    "{% endfor %}",
])
def test_one_step_memory_bombs_are_refused_before_they_allocate(source: str) -> None:
    tracemalloc.start()
    try:
        refused(source, "failed")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * MAX_OUTPUT_CHARS, f"{peak / 2**20:.0f} MiB allocated while refusing"


@pytest.mark.parametrize("source, match", [
    ("{% for m in messages %}{{ m.content }", "does not compile: unexpected '}' \\(line 1\\)"),
    ("{% if x %}\n\n{% endfor %}", "does not compile: .*endfor.* \\(line 3\\)"),
    ("{{ messages \udcff }}", "does not compile: unexpected char '\\\\udcff'"),
    ("{{ raise_exception('this model only speaks French') }}", "failed: this model only speaks French$"),
    ("{{ 1 / 0 }}", "failed: ZeroDivisionError: division by zero"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "failed: RecursionError"),
    ("{{ messages[0].content.nope.deeper }}", "failed: 'str object' has no attribute 'nope'"),
    ("ab{{ '\udcff' }}", "rendered text that is not UTF-8 \\(at character 2\\)"),
])
def test_broken_templates_are_one_line(source: str, match: str) -> None:
    refused(source, match)


def test_an_overlong_template_is_not_compiled() -> None:
    with pytest.raises(UserError, match=f"{ORIGIN}: the chat template has .* characters, more than"):
        ChatTemplate("x" * (chat_template.MAX_TEMPLATE_CHARS + 1), ORIGIN)


def test_the_limits_leave_ordinary_templates_and_the_trace_function_alone() -> None:
    def tracer(frame, event, arg):
        return None

    sys.settrace(tracer)
    try:
        out = render("{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}{% endfor %}"
                     "{{ (messages | map(attribute='role') | join(',')) }}{{ '%05d' % 42 }}{{ 'ab' * 3 }}"
                     "{{ '{:>4}'.format(7) }}{{ [1, 2] + [3] }}{{ 2 ** 10 }}")
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)
    assert out == "<system>Be brief.<user>Hellosystem,user00042ababab   7[1, 2, 3]1024"


def test_limits_hold_per_thread() -> None:
    """A render in another thread runs under its own budget and does not stop this one's."""
    slow = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", ORIGIN)
    errors: list[BaseException] = []

    def run_slow() -> None:
        try:
            slow.render({}, seconds=1.0)
        except UserError as exc:
            errors.append(exc)

    thread = threading.Thread(target=run_slow)
    thread.start()
    assert render("{% for m in messages %}{{ m.role }}{% endfor %}") == "systemuser"
    thread.join()
    assert len(errors) == 1 and "longer than 1 s" in str(errors[0])


def test_a_hostile_template_in_a_model_file_is_one_line_from_run_chat(tmp_path: Path) -> None:
    src = FIXTURES / "tiny_q8_0.gguf"
    path = tmp_path / "hostile_template.gguf"
    path.write_bytes(replace_template(bytearray(src.read_bytes()), read_layout(src), "{{ ''.__class__.__mro__ }}"))
    status, out, err = main_in_process("run", str(path), "--chat", "--max-tokens", "1", "--no-history",
                                       "--kernels", "numpy")
    assert status == 2, err
    assert err.strip().splitlines()[-1] == (f"colibri-aio: error: {path}: the chat template failed: access to "
                                            f"attribute '__class__' of 'str' object is unsafe")
    assert main_in_process("run", str(path), "--max-tokens", "1", "--no-history", "--kernels", "numpy")[0] == 0


def test_reading_long_messages_many_times_is_not_counted_as_producing_text() -> None:
    """A template that looks at every message for every message (quadratic reads) stays within the budget."""
    messages = [{"role": "user", "content": "x" * 20_000} for _ in range(150)]
    source = ("{% for m in messages %}{% for n in messages %}{% if n.content and n.role == 'tool' %}!{% endif %}"
              "{% endfor %}{{ m.role }}{% endfor %}")
    assert ChatTemplate(source, ORIGIN).render({"messages": messages}) == "user" * 150
