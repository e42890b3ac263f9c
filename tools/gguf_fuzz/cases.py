"""One mutant through what a user runs: ``plan``, ``doctor --verify``, ``logits``, ``Engine.open`` and a chat prompt.

Each outcome is sorted into a class:

- ``ok``: the command succeeded (exit 0, or the API call returned);
- ``refused``: exit 2 with exactly one ``colibri-aio: error:`` line, the last
  on stderr, and no traceback (API: a :class:`UserError` whose message is one line);
- anything else is a failure: ``traceback`` (an exception escaped),
  ``not_one_line`` (exit 2 but not one error line), ``exit_<n>`` (another status).

This module runs inside a worker process (see :mod:`gguf_fuzz.campaign`):
the commands run in-process through :func:`colibri_aio.cli.main.main`, as
``tests/support.py``'s ``main_in_process`` runs them.
"""
from __future__ import annotations

import asyncio
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

ACTIONS = ("plan", "doctor", "logits", "open", "chat")
GOOD = ("ok", "refused")
ERROR_PREFIX = "colibri-aio: error: "
PROMPT = "The list type"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, café ☕"}]


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one action ended: its class, the one line (or the failure's summary), and its time."""

    action: str
    cls: str
    detail: str
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


def _failure(exc: BaseException) -> str:
    """An escaped exception in one line: type, message and the innermost frame that raised it."""
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" at {Path(frame.filename).name}:{frame.lineno} ({frame.name})" if frame else ""
    return f"{type(exc).__name__}: {str(exc)[:300]}{where}".replace("\n", "\\n")


def classify_cli(status: int, err: str) -> tuple[str, str]:
    """The class of a command's exit status and stderr, and the line that says why."""
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(ERROR_PREFIX)]
    if status == 0:
        return "ok", ""
    if status == 2 and len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in err:
        return "refused", errors[0][len(ERROR_PREFIX):]
    last = lines[-1] if lines else ""
    return ("not_one_line" if status == 2 else f"exit_{status}"), f"{len(lines)} lines on stderr, last: {last[:300]}"


def run_command(args: list[str]) -> tuple[str, str]:
    """A CLI command in this process, classified."""
    from support import main_in_process

    try:
        status, _, err = main_in_process(*args)
    except Exception as exc:  # noqa: BLE001 - an escaped exception is what the harness looks for
        return "traceback", _failure(exc)
    return classify_cli(status, err)


def _api(call) -> tuple[str, str]:
    from colibri_aio.errors import UserError

    try:
        call()
    except UserError as exc:
        text = str(exc)
        if "\n" in text or not text:
            return "not_one_line", text[:300].replace("\n", "\\n")
        return "refused", text
    except Exception as exc:  # noqa: BLE001
        return "traceback", _failure(exc)
    return "ok", ""


class _Session:
    """Engine.open on the mutant, then (if it opened) a plain prompt and a chat prompt on the same engine."""

    def __init__(self, path: Path, kernels: str | None) -> None:
        self.path, self.kernels = path, kernels
        self.loop = asyncio.new_event_loop()
        self.engine = None

    def open(self) -> None:
        from colibri_aio.engine.engine import Engine

        self.engine = self.loop.run_until_complete(Engine.open(self.path, history=False, kernels=self.kernels))
        ids = self.engine.prompt_ids(PROMPT)
        decoder = self.engine.tokenizer.stream_decoder()
        streamed = "".join(decoder.push(i) for i in ids) + decoder.flush()
        if streamed != self.engine.tokenizer.decode(ids):
            raise AssertionError("streamed text differs from decode()")

    def chat(self) -> None:
        if self.engine is None:
            raise RuntimeError("not open")
        self.engine.tokenizer.decode(self.engine.prompt_ids(CHAT))

    def close(self) -> None:
        try:
            if self.engine is not None:
                self.loop.run_until_complete(self.engine.aclose())
        finally:
            self.loop.close()


def run_actions(path: Path, out_dir: Path, kernels: str | None, started=lambda action: None) -> list[Outcome]:
    """Every action on one file; ``started(action)`` is told before each (so a hang can be placed)."""
    extra = ["--kernels", kernels] if kernels else []
    commands = {
        "plan": ["plan", str(path), "--no-history", "--no-measure"],  # the machine's speed is not the file's
        "doctor": ["doctor", str(path), "--verify"],
        "logits": ["logits", str(path), "--ids", "0,1,2", "--out", str(out_dir / "logits.npy"), "--no-history",
                   "--ctx", "8", *extra],
    }
    outcomes = []
    for action, args in commands.items():
        started(action)
        t0 = time.perf_counter()
        cls, detail = run_command(args)
        outcomes.append(Outcome(action, cls, detail, time.perf_counter() - t0))
    session = _Session(path, kernels)
    try:
        for action in ("open", "chat"):
            if action == "chat" and outcomes[-1].cls != "ok":
                break  # nothing to chat with
            started(action)
            t0 = time.perf_counter()
            cls, detail = _api(getattr(session, action))
            outcomes.append(Outcome(action, cls, detail, time.perf_counter() - t0))
    finally:
        cls, detail = _api(session.close)
        if cls != "ok":
            outcomes.append(Outcome("close", cls, detail, 0.0))
    return outcomes
