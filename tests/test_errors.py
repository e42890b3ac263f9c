"""one_line: whatever a message carries from a model file, the error path prints one printable line."""
from __future__ import annotations

from colibri_aio.errors import MAX_LINE, ModelFormatError, one_line


def test_newlines_and_runs_of_space_become_one_space() -> None:
    assert one_line(ModelFormatError("bad\n  template\r\n\tline 3")) == "bad template line 3"


def test_control_characters_and_lone_surrogates_are_escaped() -> None:
    text = one_line("name \x1b[2J\x07 and \udcff end")
    assert text == "name \\x1b[2J\\x07 and \\udcff end"
    assert text.isprintable()
    text.encode("utf-8")  # printable on a strict UTF-8 stream


def test_a_long_message_is_cut() -> None:
    text = one_line("x" * 10_000)
    assert len(text) == MAX_LINE and text.endswith("...")
    assert one_line("short") == "short"
