"""The engine without an event loop of one's own: opened once, usable from plain code, from inside a running
event loop (as in Jupyter) and from several threads; nothing left behind at exit."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import colibri_aio
from colibri_aio import SyncEngine
from support import FIXTURES, fixture

MODEL = fixture("tiny_q8_0.gguf")


def test_one_open_serves_many_generations() -> None:
    with SyncEngine.open(MODEL, io="pread") as engine:
        inner = engine.engine
        first = [p.token for p in engine.generate("The list type", max_tokens=5)]
        second = [p.token for p in engine.generate("The list type", max_tokens=5)]
        stats = engine.stats()  # the second prompt was found in the KV cache, all but its last token
        assert engine.engine is inner
        assert stats.prompt_tokens + stats.prompt_tokens_cached == 2 * len(inner.prompt_ids("The list type"))
        assert engine.text("The list type", max_tokens=5) == inner.tokenizer.decode(first, skip_special=True)
        rows = engine.logits([1, 2, 3])
    assert first == second and rows.shape == (3, inner.model.args.vocab_size)
    assert engine.closed and inner.source.reader.in_flight == 0


async def test_works_inside_a_running_event_loop() -> None:
    """Like a notebook cell: an event loop is running in this thread, and the plain API still works."""
    asyncio.get_running_loop()
    with SyncEngine.open(MODEL, io="pread") as engine:
        text = engine.text("The list type", max_tokens=6)
    plain = "".join(p.text for p in colibri_aio.generate("The list type", model=MODEL, max_tokens=6))
    assert text == plain and text


def test_threads_share_one_engine_without_mixing_streams() -> None:
    prompts = ["The list type", "def f(x):", "Python"]
    with SyncEngine.open(MODEL, io="pread", cache_per_layer=2) as engine:
        alone = {p: engine.text(p, max_tokens=10, temperature=0.7, seed=3) for p in prompts}
        got: dict[str, str] = {}

        def worker(prompt: str) -> None:
            got[prompt] = engine.text(prompt, max_tokens=10, temperature=0.7, seed=3)

        threads = [threading.Thread(target=worker, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert got == alone


def test_early_break_lets_the_next_generation_in() -> None:
    with SyncEngine.open(MODEL, io="pread") as engine:
        for n, _ in enumerate(engine.generate("The list type", max_tokens=50)):
            if n == 2:
                break
        assert len(list(engine.generate("Python", max_tokens=3, wait=False))) == 3


def test_a_second_call_from_the_thread_holding_a_stream_fails_instead_of_hanging() -> None:
    import pytest

    from colibri_aio import EngineBusyError

    with SyncEngine.open(MODEL, io="pread") as engine:
        first = engine.generate("The list type", max_tokens=20)
        next(first)
        with pytest.raises(EngineBusyError, match="still open"):
            engine.text("Python", max_tokens=2)
        with pytest.raises(EngineBusyError):
            engine.logits([1, 2])
        first.close()
        assert engine.text("Python", max_tokens=2)


SCRIPT = """
import sys
import colibri_aio
model = sys.argv[1]
if sys.argv[2] == "abandoned-generator":
    stream = colibri_aio.generate("The list type", model=model, max_tokens=50)
    next(stream)
else:
    engine = colibri_aio.SyncEngine.open(model)
    for n, piece in enumerate(engine.generate("The list type", max_tokens=50)):
        if n == 2:
            break
print("done", flush=True)
"""


def _history_runs(cache: Path) -> int:
    [path] = (cache / "colibri_aio" / "usage").glob("*.json")
    return json.loads(path.read_text())["runs"]


def test_what_is_left_open_at_exit_is_closed_quietly(tmp_path: Path) -> None:
    """An abandoned generator or an engine never closed: the program ends at once, without a word on
    stderr, and the engine's reads are drained and its usage history saved."""
    for case in ("abandoned-generator", "never-closed"):
        cache = tmp_path / case
        r = subprocess.run([sys.executable, "-c", SCRIPT, str(MODEL), case], capture_output=True, text=True,
                           timeout=120, cwd=FIXTURES.parent, env={**os.environ, "XDG_CACHE_HOME": str(cache)})
        assert r.returncode == 0 and r.stdout == "done\n" and r.stderr == "", (case, r.stderr)
        assert _history_runs(cache) == 1


CTRL_C = """
import sys
import colibri_aio
engine = colibri_aio.SyncEngine.open(None, prefetch="on")
try:
    for n, piece in enumerate(engine.generate("The list type", max_tokens=240)):
        if n == 0:
            print("first", flush=True)
except KeyboardInterrupt:
    print("interrupted", engine.engine.source.reader.in_flight, flush=True)
print("again", len(engine.text("Python", max_tokens=3)) > 0, flush=True)
engine.close()
"""


def test_ctrl_c_in_a_generation_cleans_up_and_the_engine_goes_on(tmp_path: Path) -> None:
    import signal

    p = subprocess.Popen([sys.executable, "-c", CTRL_C], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=FIXTURES.parent, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    assert p.stdout is not None and p.stdout.readline() == "first\n"
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert out == "interrupted 0\nagain True\n" and err == ""


def test_an_interrupt_while_a_call_is_handed_to_the_loop_stops_that_call_before_going_on(monkeypatch) -> None:
    """Ctrl-C can land inside the hand-over to the engine's loop, after the coroutine was queued: the call must
    still be stopped and waited for, or closing the stream next finds it running ("already running")."""
    from colibri_aio.engine import sync

    portal = sync._LoopThread()
    ended = threading.Event()

    async def long_step() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            ended.set()

    handed_over = asyncio.run_coroutine_threadsafe
    calls = []

    def interrupted(coro, loop):  # noqa: ANN001, ANN202
        future = handed_over(coro, loop)
        calls.append(coro)
        if len(calls) == 1:  # the call's own hand-over; the clean-up's round trips go through
            raise KeyboardInterrupt
        return future

    monkeypatch.setattr(sync.asyncio, "run_coroutine_threadsafe", interrupted)
    try:
        try:
            portal.call(long_step())
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("the interrupt was swallowed")
        assert ended.is_set()  # stopped and unwound before the interrupt went on
    finally:
        monkeypatch.undo()
        portal.stop()
