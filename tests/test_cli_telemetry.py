"""On a terminal the text stays readable: live telemetry is one status line on the last row, which the
text never reaches; the full table is behind --stats. Checked on a pseudo-terminal read by a terminal
emulator (pyte)."""
from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest

from support import FIXTURES, run_cli

pyte = pytest.importorskip("pyte", reason="pyte (a terminal emulator, in the test extras) reads the screen")

ROWS, COLS = 24, 100
RUN = ("run", "fixtures/tiny_q8_0.gguf", "--max-tokens", "250", "--stats-interval", "0.02", "--io", "pread")


def _on_a_terminal(*args: str, stdout_to_pipe: bool = False) -> tuple[bytes, bytes]:
    """Run the CLI with stderr (and stdout, unless ``stdout_to_pipe``) on a ROWS x COLS pseudo-terminal;
    return (everything the terminal received, stdout if it went to a pipe)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLS, 0, 0))
    p = subprocess.Popen([sys.executable, "-m", "colibri_aio", *args], stdin=slave,
                         stdout=subprocess.PIPE if stdout_to_pipe else slave, stderr=slave, cwd=FIXTURES.parent)
    os.close(slave)
    screen = bytearray()
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the other end is closed
            break
        if not chunk:
            break
        screen += chunk
    out = p.stdout.read() if p.stdout is not None else b""
    assert p.wait(60) == 0, screen.decode(errors="replace")
    os.close(master)
    return bytes(screen), out


@pytest.fixture(scope="module")
def plain() -> subprocess.CompletedProcess[str]:
    """The same run without a terminal: the text alone on stdout."""
    r = run_cli(*RUN)
    assert r.returncode == 0 and "tok/s" not in r.stdout
    return r


def test_status_line_never_lands_in_the_text(plain: subprocess.CompletedProcess[str]) -> None:
    raw, _ = _on_a_terminal(*RUN)
    draws = re.findall(rb"\x1b7\x1b\[(\d+);1H\x1b\[2K([^\x1b]*)\x1b8", raw)
    assert draws, raw[:500]
    assert {int(row) for row, _ in draws} == {ROWS}                     # always the last row
    assert all(b"tok/s" in text and b"expert hit" in text for _, text in draws if text)
    assert f"\x1b[1;{ROWS - 1}r".encode() in raw and raw.count(b"\x1b[r") == 1  # reserved, then given back
    screen = pyte.Screen(COLS, ROWS)
    stream = pyte.ByteStream(screen)
    shown_mid_run = None
    for part in re.split(rb"(\x1b8)", raw):              # the screen after each status draw
        stream.feed(part)
        if part == b"\x1b8" and shown_mid_run is None and "tok/s" in screen.display[-1]:
            shown_mid_run = list(screen.display)
    assert shown_mid_run is not None
    assert not any("tok/s" in row for row in shown_mid_run[:-1])        # the text rows never hold the status
    text_rows = [row.rstrip() for row in screen.display if row.strip()]
    assert not any("tok/s" in row and "expert hit" in row and "|" in row and "prefill" not in row
                   for row in text_rows)                                # cleared at the end
    words = [w for w in plain.stdout.split() if w.isalpha() and len(w) > 3][-3:]
    tail = " ".join(text_rows)
    assert all(w in tail for w in words)                                # the text's end is on screen, whole


def test_text_to_a_pipe_status_redrawn_on_the_terminal(plain: subprocess.CompletedProcess[str]) -> None:
    raw, out = _on_a_terminal(*RUN, stdout_to_pipe=True)
    # The text is the text, nothing else. ``plain`` was read in text mode, which turns a "\r" the model
    # generated into "\n": read these bytes the same way.
    text = out.decode().replace("\r\n", "\n").replace("\r", "\n")
    assert text == plain.stdout
    assert b"\r\x1b[K" in raw and b"tok/s" in raw and b"\x1b[1;" not in raw


def test_stats_shows_the_table_and_no_stats_nothing() -> None:
    table, _ = _on_a_terminal(*RUN, "--stats")
    assert b"r_await" in table and b"\x1b7" not in table
    quiet, _ = _on_a_terminal(*RUN, "--no-stats")
    assert b"tok/s 0" not in quiet and b"\x1b7" not in quiet and b"r_await" not in quiet
