"""``python -m colibri_aio chat`` as people use it: lines through a pipe, and a terminal (pty) with Ctrl-C."""
from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

from support import FIXTURES

GREEDY = ["--temperature", "0", "--logit-bias", "0=-100", "--logit-bias", "2=-100"]
STATUS = re.compile(r"\[(\d+) tokens, [\d.]+ tok/s; prompt (\d+) tokens, (\d+) from the KV cache")


def test_chat_through_a_pipe_keeps_history_and_reuses_the_cache() -> None:
    lines = "What is a list?\nAnd a tuple?\n/reset\nWhat is a list?\n"
    r = subprocess.run([sys.executable, "-m", "colibri_aio", "chat", "--max-tokens", "8", "--io", "pread", *GREEDY],
                       input=lines, capture_output=True, text=True, timeout=300, cwd=FIXTURES.parent)
    assert r.returncode == 0, r.stderr
    turns = [tuple(map(int, m)) for m in STATUS.findall(r.stderr)]
    assert len(turns) == 3, r.stderr
    (gen1, prompt1, cached1), (_, prompt2, cached2), (_, prompt3, cached3) = turns
    assert gen1 == 8 and cached1 == 0
    assert prompt1 <= cached2 < prompt2            # turn 2 found turn 1 in the KV cache
    assert "[new conversation]" in r.stderr
    assert prompt3 == prompt1 and cached3 < prompt3  # after /reset the history is gone
    replies = r.stdout.splitlines()
    assert len(replies) == 3 and replies[0] == replies[2] and replies[0]


class Terminal:
    """A child process on a pseudo-terminal: type into it, read what it shows."""

    def __init__(self, *args: str) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the chat, with the pty as its controlling terminal
            os.chdir(FIXTURES.parent)
            os.execvp(sys.executable, [sys.executable, "-m", "colibri_aio", *args])
        self.screen = ""

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def expect(self, pattern: str, timeout: float = 300.0) -> re.Match[str]:
        """Wait until ``pattern`` appears in what was shown since the last match."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.screen)
            if m:
                self.screen = self.screen[m.end():]
                return m
            left = deadline - time.monotonic()
            assert left > 0, f"{pattern!r} never appeared; the terminal shows:\n{self.screen}"
            if select.select([self.fd], [], [], min(left, 0.5))[0]:
                try:
                    self.screen += os.read(self.fd, 65536).decode(errors="replace")
                except OSError:  # the child has gone
                    pass

    def wait(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            if select.select([self.fd], [], [], 0.1)[0]:
                try:
                    os.read(self.fd, 65536)
                except OSError:
                    pass
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError("the chat did not exit")


def test_ctrl_c_stops_a_reply_not_the_chat() -> None:
    # A long reply (up to the end of the context) is still being written when Ctrl-C arrives, a few
    # milliseconds after its first characters; should a fast machine finish it first, the test tries again.
    term = Terminal("chat", "--max-tokens", "250", "--io", "pread", *GREEDY)
    term.expect(r"> ")
    for attempt in range(3):
        term.type(f"What is a list? ({attempt})\r")
        term.expect(r"\(\d\)\r?\n")          # the line is echoed ...
        term.expect(r"\S")                    # ... and the reply starts
        term.type("\x03")
        m = term.expect(r"\[stopped\]|\[\d+ tokens")
        term.expect(r"> ")
        if m.group(0) == "[stopped]":
            break
    else:
        raise AssertionError("every reply finished before Ctrl-C reached it")
    # Ctrl-C at the prompt: a fresh prompt, not the end. A person types it long after the prompt shows; a
    # SIGINT in the microseconds between readline printing the prompt and waiting for a key would only be
    # seen at the next key (CPython's readline has no pselect), so the test waits like a person would.
    time.sleep(0.5)
    term.type("\x03")
    term.expect(r"> ")
    term.type("And a tuple?\r")
    m = term.expect(STATUS.pattern)
    assert int(m.group(3)) > 0                # the interrupted conversation is still in the KV cache
    term.expect(r"> ")
    term.type("/exit\r")
    assert term.wait() == 0


def _thinking_model(tmp_path) -> str:
    """A fixture with DeepSeek-R1's real template, whose prompt opens the thinking span: a random model then
    thinks to the end of its token budget."""
    from support import rewrite_gguf

    template = (FIXTURES / "templates" / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    return str(rewrite_gguf(FIXTURES / "deepseek2_q8_0.gguf", tmp_path / "r1.gguf",
                            keys={"tokenizer.chat_template": template}))


def test_thinking_is_tagged_through_a_pipe_and_left_out_of_the_history(tmp_path) -> None:
    model = _thinking_model(tmp_path)
    r = subprocess.run([sys.executable, "-m", "colibri_aio", "chat", model, "--max-tokens", "6", *GREEDY],
                       input="Why?\nAnd?\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    replies = r.stdout.splitlines()
    assert len(replies) == 2 and all(line.startswith("<think>") and line.endswith("</think>") for line in replies)
    (_, prompt1, _), (_, prompt2, _) = [tuple(map(int, m)) for m in STATUS.findall(r.stderr)]
    # The second prompt holds the first turn without its thinking (the answer was empty): a few tokens more.
    assert prompt2 < prompt1 + 12, r.stderr


def test_thinking_is_dimmed_on_a_terminal(tmp_path) -> None:
    term = Terminal("chat", _thinking_model(tmp_path), "--max-tokens", "6", *GREEDY)
    term.expect(r"> ")
    term.type("Why?\r")
    term.expect("\x1b\\[2m")               # faint on
    term.expect("\x1b\\[0m")               # and off again before the status line
    term.expect(STATUS.pattern)
    term.expect(r"> ")
    term.type("/exit\r")
    assert term.wait() == 0
