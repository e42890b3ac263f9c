"""``python -m colibri_aio chat``: a conversation in the terminal on the server's session machinery.

Replies stream to stdout; status lines (the model, each reply's tokens,
speed and the prompt tokens found in the KV cache) go to stderr. Commands:
``/reset`` starts over, ``/exit`` (or end of input) quits, ``/help``.
Ctrl-C stops the reply being written, not the program.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import IO, Any

from colibri_aio.errors import UserError
from colibri_aio.serve.session import ChatSession, Session
from colibri_aio.engine.sync import SyncEngine

HELP = "/reset starts a new conversation, /exit quits (or Ctrl-D); Ctrl-C stops a reply"


def chat(model: Any, *, system: str | None, max_tokens: int | None, sampling: dict[str, Any],
         open_options: dict[str, Any], stdin: IO[str] = sys.stdin, stdout: IO[str] = sys.stdout,
         stderr: IO[str] = sys.stderr, prompt_cache: Path | None = None) -> int:
    """Run the conversation until /exit or end of input; ``prompt_cache``: a slot file restored at the start
    when it exists (a long system prompt is prefilled once across runs) and saved at the end."""
    interactive = stdin.isatty() and stdout.isatty()
    if interactive:
        importlib.import_module("readline")  # line editing and history for input()
    with SyncEngine.open(model, **open_options) as engine:
        session = Session(engine)
        params = session.defaults.override(sampling)
        params.check(session.vocab_size)
        conversation = ChatSession(session, system=system, sampling=params, max_tokens=max_tokens)
        print(f"[{engine.describe()}]", file=stderr)
        if prompt_cache is not None and prompt_cache.exists():
            n = engine.restore_slot(prompt_cache)
            print(f"[prompt cache: {n} positions restored from {prompt_cache}]", file=stderr)
        print(f"[chat with {session.model_name}: {HELP}]", file=stderr, flush=True)
        while True:
            try:
                line = _read_line(stdin, stdout, "> " if interactive else "")
            except KeyboardInterrupt:  # at the prompt: a fresh line, not the end
                print(file=stdout, flush=True)
                continue
            if line is None or line.strip() in ("/exit", "/quit"):
                if prompt_cache is not None:
                    engine.save_slot(prompt_cache)
                return 0
            text = line.strip()
            if not text:
                continue
            if text == "/reset":
                conversation.reset()
                print("[new conversation]", file=stderr, flush=True)
            elif text == "/help":
                print(f"[{HELP}]", file=stderr, flush=True)
            else:
                _reply(conversation, text, stdout, stderr)


def _read_line(stdin: IO[str], stdout: IO[str], prompt: str) -> str | None:
    """One line of input (None at the end); input() when it is the terminal, for line editing."""
    if stdin is sys.stdin and stdout is sys.stdout:
        try:
            return input(prompt)
        except EOFError:
            return None
    stdout.write(prompt)
    stdout.flush()
    line = stdin.readline()
    return line if line else None


DIM, PLAIN = "\x1b[2m", "\x1b[0m"  # SGR faint and reset: thinking shown dimmed on a terminal


def _reply(conversation: ChatSession, text: str, stdout: IO[str], stderr: IO[str]) -> None:
    """Stream one reply, its thinking dimmed on a terminal (in ``<think>`` tags otherwise); Ctrl-C stops it (the
    engine drains), an error is one line."""
    dropped = conversation.dropped
    tty = stdout.isatty()
    thinking = False
    try:
        for delta in conversation.turn(text):
            if delta.reasoning:
                if not thinking:
                    stdout.write(DIM if tty else "<think>")
                    thinking = True
                stdout.write(delta.reasoning)
            if delta.content:
                if thinking:
                    stdout.write(PLAIN if tty else "</think>\n")
                    thinking = False
                stdout.write(delta.content)
            stdout.flush()
        if thinking:
            stdout.write(PLAIN if tty else "</think>")
    except KeyboardInterrupt:
        if thinking and tty:
            stdout.write(PLAIN)
        print(file=stdout, flush=True)
        print("[stopped]", file=stderr, flush=True)
        return
    except UserError as exc:
        print(f"colibri-aio: error: {exc}", file=stderr, flush=True)
        return
    print(file=stdout, flush=True)
    last = conversation.last
    if conversation.dropped > dropped:
        print(f"[the oldest {conversation.dropped - dropped} turn(s) were dropped to fit the context]", file=stderr)
    if last is not None:
        print(f"[{last.generated_tokens} tokens, {last.decode_tps:.1f} tok/s; prompt {last.prompt_tokens} tokens, "
              f"{last.cached_tokens} from the KV cache, prefilled at {last.prefill_tps:.1f} tok/s; "
              f"{last.finish_reason}]", file=stderr, flush=True)
